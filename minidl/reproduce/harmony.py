"""Harmony (Li et al., VLDB 2022) on its own setup, in the simulator: swap volume and throughput of Harmony's
schedule against training under virtualized memory that re-swaps every micro-batch.

The setup is the paper's: 4 GPUs of profile `gtx1080ti` (11 GiB, 10 GiB usable as Harmony's scheduler caps them;
11.5 GiB/s host swap and 8.2 GiB/s GPU to GPU per direction, the figures of Harmony's simulator), fp32, SGD with
momentum updated on the host (Harmony offloads the optimizer), minibatch 64, the models as Harmony's model library
builds them (`vgg416`, `resnet1026`; `bert96` and `gpt2_xl` where the zoo has them).

- **Harmony** is minidl's pipeline of layer packs over the 4 devices (`memory/schedulers/pipeline.py`: packs round
  robin on the devices, all micro-batches through a pack before the next, each backward pack re-forwarded from its
  stashed input and followed by its update, activations passed device to device, each device's memory planned
  exactly under its 10 GiB). Of a small grid of micro-batch counts and pack counts, the fastest simulated step.
- **The baseline** is `memory/swapper.py`: each micro-batch swaps its layers' weights in (forward and backward), its
  stashed activations out and back, its gradients out, through the host; data parallel over the 4 devices (`dp`)
  or GPipe across them (`pp`), each at its fastest micro-batch size that fits.

In bf16 (`--math bf16`: half activations, the weights' half copies swapped in, float32 masters and gradients) the
same comparison again, rows `bf16/...`: what halving the stashes and the weights in flight does to both schedules'
swap volume (the 1080 Ti computes half operands at its float32 rate: no faster half arithmetic).

Both are priced by one roofline per route step and one link model (`memory/simulate.py`). Ratios are against the
stronger baseline: swap volume against the one that swaps least, throughput against the faster. The `--quick`
rows are VGG-416 at minibatch 8 with one packing, also rows of the full run.
"""
from __future__ import annotations

import time

from ..core.errors import BudgetError
from ..memory.schedulers.pipeline import plan_pipeline_fixed
from ..memory.simulate import get_profile
from ..memory.swapper import MODES, simulate_swapper
from ..models import MODELS as ZOO
from ..models import build_model
from .tables import Report, Row, Table, machine_meta

PROFILE = "gtx1080ti"
DEVICES = 4
BATCH = 64
SLOTS = ("momentum",)
CITATION = ("Li et al., \"Harmony: Overcoming the Hurdles of GPU Memory Capacity to Train Massive DNN Models on "
            "Commodity Servers\", VLDB 2022")
PAPER_SWAP, PAPER_SPEEDUP = "~100x", "7.6x"      # "up to", over its four models (the abstract)
SCORES = "attention rebuilds its scores in backward (a packed route would stash them from the first forward)"
RELU = "ReLU not in place (PyTorch's is): the baseline stashes conv and ReLU outputs both"

#: key -> (registry name, build arguments, label, what differs from the paper's setup)
MODELS = {
    "vgg416": ("vgg416", {}, "VGG-416", RELU),
    "resnet1026": ("resnet1026", {}, "ResNet-1026", RELU),
    "bert96": ("bert96", {"seq": 512, "keep_scores": False}, "BERT-96 (512 tokens)",
               f"{SCORES}; no token-type table, no attention dropout"),
    "gpt2_xl": ("gpt2_xl", {"seq": 1024, "keep_scores": False}, "GPT2-XL (1024 tokens)",
                f"{SCORES}; 1024 tokens (GPT-2's context); no attention dropout"),
}
#: Harmony's grid: micro-batch counts x packs in all (cut by FLOPs, `pipeline.compute_packs`)
GRID = ((8, 16), (64,))
QUICK = ("vgg416", 8, ((2,), (16,)))      # model, minibatch, grid of the --quick rows


def available() -> list[str]:
    """The models of `MODELS` the zoo has (the transformer rows need the transformer models)."""
    return [k for k, (name, *_) in MODELS.items() if name in ZOO]


MATHS = ("fp32", "bf16")


def _build(key: str, batch: int):
    name, kw, *_ = MODELS[key]
    return build_model(name, batch=batch, **kw)


def _summary(r, t0: float) -> dict:
    roles: dict[str, int] = {}
    for d in r.device_plans:
        for k, v in d.host_by_role.items():
            roles[k] = roles.get(k, 0) + v
    return {"micro_batches": r.micro_batches, "packs": len(r.packs), "host_bytes": r.host_bytes,
            "host_by_role": roles, "device_bytes": r.p2p_bytes, "step_time_s": r.step_time_s,
            "peak_bytes": r.peak_bytes, "homed_layers": [d.homed_layers for d in r.device_plans],
            "planning_s": time.perf_counter() - t0}


def harmony(key: str, batch: int, grid, math: str = "fp32") -> dict[str, dict]:
    """Harmony's pipeline: of `grid`, the fastest that fits, with each device's weights resident where they fit
    ("fit", minidl's plan); and the same packing with every layer's weights on the host ("host", as Harmony's
    runtime swaps each pack's weights in for its tasks). Bytes exact, step times simulated."""
    net = _build(key, batch)
    budget = get_profile(PROFILE).usable_bytes
    best, t = None, time.perf_counter()
    for m in grid[0]:
        for p in grid[1]:
            try:
                r = plan_pipeline_fixed(net, DEVICES, m, p, budget, PROFILE, SLOTS, cut="compute", math=math)
            except BudgetError:
                continue
            if best is None or (r.step_time_s, r.host_bytes) < (best.step_time_s, best.host_bytes):
                best = r
    if best is None:
        raise BudgetError(f"Harmony on {key}: no pipeline of the grid {grid} fits {PROFILE}")
    fit = _summary(best, t)
    t = time.perf_counter()
    host = plan_pipeline_fixed(net, DEVICES, best.micro_batches, len(best.packs), budget, PROFILE, SLOTS,
                               cut="compute", weights="host", math=math)
    return {"fit": fit, "host": _summary(host, t), "parameters": net.num_params()}


def baseline(key: str, batch: int, mode: str, math: str = "fp32") -> dict:
    r = simulate_swapper(lambda b: _build(key, b), batch, DEVICES, PROFILE, mode, SLOTS, math)
    return {"mode": mode, "micro_batch": r.micro_batch, "micro_batches": r.micro_batches, "host_bytes": r.host_bytes,
            "host_by_role": r.host_by_role, "device_bytes": r.p2p_bytes, "step_time_s": r.step_time_s,
            "compute_time_s": r.compute_time_s}


def compare(key: str, batch: int, grid, log, math: str = "fp32") -> dict:
    """Harmony (both variants) and both baselines on one model in `math`, with the ratios (`ratios`)."""
    h = harmony(key, batch, grid, math)
    base = {mode: baseline(key, batch, mode, math) for mode in MODES}
    log(f"  {key} at minibatch {batch} ({math}): " + "; ".join(
        f"Harmony ({v}) {_gb(x['host_bytes'])} through the host, {x['step_time_s']:.2f} s"
        for v, x in h.items() if v in VARIANTS)
        + "; " + ", ".join(f"baseline {m} {_gb(b['host_bytes'])}, {b['step_time_s']:.2f} s"
                           for m, b in base.items()))
    return ratios({"model": key, "batch": batch, "parameters": h.pop("parameters"), "harmony": h,
                   "baselines": base, "math": math})


def ratios(c: dict) -> dict:
    """`c` with its ratios against the baselines (a pure function of the figures: pages re-make from them)."""
    base, h = c["baselines"], c["harmony"]
    least = min(base.values(), key=lambda b: (b["host_bytes"], b["step_time_s"]))
    fastest = min(base.values(), key=lambda b: b["step_time_s"])
    c = {**c, "swap_baseline": least["mode"], "speed_baseline": fastest["mode"]}
    for v, x in h.items():
        c[f"swap_reduction_{v}"] = least["host_bytes"] / x["host_bytes"] if x["host_bytes"] else None
        c[f"speedup_{v}"] = fastest["step_time_s"] / x["step_time_s"]
        for m, b in base.items():
            c[f"speedup_{v}_{m}"] = b["step_time_s"] / x["step_time_s"]
    return c


def _gb(x: int) -> str:
    return f"{x / 1e9:.1f} GB"


def _swap(c: dict, v: str) -> str:
    """Ours, in the paper's unit: how many times less the baseline swaps."""
    b = c["baselines"][c["swap_baseline"]]["host_bytes"]
    if c[f"swap_reduction_{v}"] is None:
        return f"no swap left ({_gb(b)} -> 0)"
    return f"{c[f'swap_reduction_{v}']:.1f}x ({_gb(b)} -> {_gb(c['harmony'][v]['host_bytes'])})"


def _figures(c: dict) -> str:
    h, b = c["harmony"], c["baselines"]
    return "; ".join([f"Harmony M={h['fit']['micro_batches']}, {h['fit']['packs']} packs: "
                      + ", ".join(f"{VARIANTS[v]}: {_gb(x['host_bytes'])} host, {_gb(x['device_bytes'])} GPU-GPU, "
                                  f"{x['step_time_s']:.2f} s" for v, x in h.items())]
                     + [f"{m} u={x['micro_batch']} x {x['micro_batches']}: {_gb(x['host_bytes'])} host, "
                        f"{x['step_time_s']:.2f} s (the busiest device computes {x['compute_time_s']:.2f} s)"
                        for m, x in b.items()])


#: Harmony's two variants, as the rows name them
VARIANTS = {"fit": "weights resident where they fit", "host": "weights on the host"}


def _rows(c: dict, label: str, differs: str, quick: bool, prefix: str) -> list[tuple[str, Row]]:
    detail = {k: c[k] for k in ("batch", "parameters", "harmony", "baselines", "swap_baseline", "speed_baseline")}
    out = []
    for v, words in VARIANTS.items():
        name = f"{label}, {words}"
        out.append(("swap", Row(f"swap/{prefix}/{v}", name, None, _swap(c, v), differs, quick,
                                {**detail, "swap_reduction": c[f"swap_reduction_{v}"]})))
        versus = ", ".join(f"{c[f'speedup_{v}_{m}']:.2f}x vs {m}" for m in MODES)
        out.append(("throughput", Row(f"throughput/{prefix}/{v}", name, None, versus, differs, quick,
                                      {**detail, "speedup": c[f"speedup_{v}"]})))
    return out


def measure(quick: bool, log, math: str = "fp32") -> tuple[dict, list[dict]]:
    """The --quick check and (unless `quick`) every model the zoo has, compared (`compare`) in `math`."""
    qkey, qbatch, qgrid = QUICK
    check = compare(qkey, qbatch, qgrid, log, math)
    return check, [] if quick else [compare(key, BATCH, GRID, log, math) for key in available()]


def run(quick: bool, log) -> Report:
    check, compared = measure(quick, log)
    return build_report(check, compared, quick, measure(quick, log, "bf16"))


def build_report(check: dict, compared: list[dict], quick: bool, half: tuple[dict, list[dict]] | None = None) -> Report:
    """The tables of `measure`'s figures (see the module doc)."""
    swap = Table("swap", "Swap volume: the baseline's over Harmony's, per training step", "x less",
                 note="Bytes between host and devices per step, all 4 devices together, against the baseline that "
                      "swaps least. Weights resident where they fit: minidl's plan, which moves nothing through "
                      "the host when each device holds its packs' training state and stashes; weights on the "
                      "host: the same packing with every pack's weights swapped in for its blocks and its "
                      "gradients out, as Harmony's runtime does (the paper's ratio is finite: its Harmony still "
                      "swaps). The paper gives its headline over four models, not per model.")
    speed = Table("throughput", "Throughput: Harmony's over each baseline's", "x",
                  note="Simulated step times (roofline per route step, the profile's links, copies overlapped "
                       "where the schedule allows); the best row is against the faster baseline. Where Harmony is "
                       "not faster: the baseline's copies hide behind compute (compare its step with its compute "
                       "below), while Harmony re-runs every pack's forward before its backward.")
    figures = Table("figures", "What each schedule moves and how long its step takes", "GB, s",
                    note="dp: 4 replicas, u samples x M micro-batches each; pp: GPipe over the 4 devices, u x M in "
                         "all; Harmony: M micro-batches, packs in all, round robin on the 4 devices.")
    mixed = Table("bf16", "In bf16: swap volume, the baseline's over Harmony's, and what each moves", "x less",
                  note="bf16: activations and the weights' half copies in 16 bits, float32 masters, gradients and "
                       "momentum; the paper's runs are float32 (its 1080 Ti baseline fp16). The same grid and "
                       "baselines as in float32.")
    tables = {"swap": swap, "throughput": speed}
    qkey = check["model"]
    label = f"{MODELS[qkey][2]}, minibatch {check['batch']}, one packing (the --quick check)"
    differs = f"minibatch {check['batch']}, not {BATCH}; {MODELS[qkey][3]}"
    for which, r in _rows(check, label, differs, True, f"quick/{qkey}"):
        tables[which].rows.append(r)
    figures.rows.append(Row(f"figures/quick/{qkey}", label, None, _figures(check), differs, True))
    missing = [k for k in MODELS if k not in {c["model"] for c in compared}]
    for c in compared:
        _, _, label, differs = MODELS[c["model"]]
        label = f"{label}, minibatch {c['batch']}"
        for which, r in _rows(c, label, differs, False, c["model"]):
            tables[which].rows.append(r)
        figures.rows.append(Row(f"figures/{c['model']}", label, None, _figures(c), differs))
    for c in ([half[0], *half[1]] if half is not None else []):
        key = c["model"]
        quick_row = c is half[0]
        label = f"{MODELS[key][2]}, minibatch {c['batch']}" + (", one packing (the --quick check)" if quick_row else "")
        prefix = f"bf16/quick/{key}" if quick_row else f"bf16/{key}"
        for v, words in VARIANTS.items():
            mixed.rows.append(Row(f"{prefix}/{v}", f"{label}, {words}, bf16", None, _swap(c, v),
                                  f"bf16; {MODELS[key][3]}", quick_row,
                                  {"swap_reduction": c[f"swap_reduction_{v}"], "speedup": c[f"speedup_{v}"]}))
        mixed.rows.append(Row(f"{prefix}/figures", f"{label}, bf16: what each moves", None, _figures(c),
                              f"bf16; {MODELS[key][3]}", quick_row))
    if compared:
        without = "without " + ", ".join(missing) if missing else ""
        for v, words in VARIANTS.items():
            best = [c[f"swap_reduction_{v}"] for c in compared]
            swap.rows.append(Row(f"swap/best/{v}", f"best of the models, {words}", PAPER_SWAP,
                                 "no swap left" if None in best else f"{max(best):.1f}x", without))
            speed.rows.append(Row(f"throughput/best/{v}", f"best of the models, {words}", PAPER_SPEEDUP,
                                  f"{max(c[f'speedup_{v}'] for c in compared):.2f}x", without))
    prof = get_profile(PROFILE)
    setup = (f"The paper: 4 x GTX 1080 Ti (11 GB), 11.5 GiB/s swap and 8.2 GiB/s GPU-to-GPU; BERT-96, GPT2-XL, "
             f"VGG416 and ResNet1026 at minibatch 64, against baselines that virtualize GPU memory. Ours: the "
             f"simulator's `{PROFILE}` profile x {DEVICES} ({prof.usable_bytes / 2**30:g} GiB usable each, as "
             f"Harmony's scheduler caps them; its links per direction), fp32, SGD momentum updated on the host; "
             f"Harmony = minidl's pipeline of layer packs, the baseline = `memory/swapper.py` (each micro-batch "
             f"swaps weights and activations through the host), both priced by the same roofline."
             + (f" Rows missing: {', '.join(missing)}." if missing and not quick else ""))
    meta = {**machine_meta(), "profile": PROFILE, "devices": DEVICES, "usable_bytes": prof.usable_bytes,
            "host_link_bytes_per_s": prof.link_bw, "peer_link_bytes_per_s": prof.peer_bw, "batch": BATCH,
            "grid": {"micro_batches": GRID[0], "packs": GRID[1]}, "missing_models": [] if quick else missing,
            "measured": {"check": check, "compared": compared,
                         **({"bf16": {"check": half[0], "compared": half[1]}} if half is not None else {})}}
    return Report("harmony", CITATION, setup, [swap, speed, figures] + ([mixed] if half is not None else []), quick,
                  meta)
