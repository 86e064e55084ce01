"""Harmony (Li et al., VLDB 2022) on its own setup, in the simulator: swap volume and throughput of Harmony's
schedule against training under virtualized memory that re-swaps every micro-batch.

Setup: 4 x `gtx1080ti` (10 GiB usable each, Harmony's simulator's links), fp32, momentum SGD updated on the host,
minibatch 64, the models as Harmony's library builds them. Harmony is `memory/schedulers/pipeline.py` (the fastest
of a small grid of micro-batch and pack counts); the baseline is `memory/swapper.py`, `dp` or `pp`, each at its
fastest micro-batch size. Both are priced by one roofline and link model (`memory/simulate.py`); ratios are against
the stronger baseline. The `--quick` rows (VGG-416 at minibatch 8, one packing) are rows of the full run.
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


def harmony(key: str, batch: int, grid) -> dict[str, dict]:
    """The fastest pipeline of `grid` that fits, weights resident where they fit ("fit"), and the same packing
    with all weights on the host ("host", Harmony's runtime)."""
    net = _build(key, batch)
    budget = get_profile(PROFILE).usable_bytes
    best, t = None, time.perf_counter()
    for m in grid[0]:
        for p in grid[1]:
            try:
                r = plan_pipeline_fixed(net, DEVICES, m, p, budget, PROFILE, SLOTS, cut="compute")
            except BudgetError:
                continue
            if best is None or (r.step_time_s, r.host_bytes) < (best.step_time_s, best.host_bytes):
                best = r
    if best is None:
        raise BudgetError(f"Harmony on {key}: no pipeline of the grid {grid} fits {PROFILE}")
    fit = _summary(best, t)
    t = time.perf_counter()
    host = plan_pipeline_fixed(net, DEVICES, best.micro_batches, len(best.packs), budget, PROFILE, SLOTS,
                               cut="compute", weights="host")
    return {"fit": fit, "host": _summary(host, t), "parameters": net.num_params()}


def baseline(key: str, batch: int, mode: str) -> dict:
    r = simulate_swapper(lambda b: _build(key, b), batch, DEVICES, PROFILE, mode, SLOTS)
    return {"mode": mode, "micro_batch": r.micro_batch, "micro_batches": r.micro_batches, "host_bytes": r.host_bytes,
            "host_by_role": r.host_by_role, "device_bytes": r.p2p_bytes, "step_time_s": r.step_time_s,
            "compute_time_s": r.compute_time_s}


def compare(key: str, batch: int, grid, log) -> dict:
    """Harmony (both variants) and both baselines on one model, with the ratios (`ratios`)."""
    h = harmony(key, batch, grid)
    base = {mode: baseline(key, batch, mode) for mode in MODES}
    log(f"  {key} at minibatch {batch}: " + "; ".join(
        f"Harmony ({v}) {_gb(x['host_bytes'])} through the host, {x['step_time_s']:.2f} s"
        for v, x in h.items() if v in VARIANTS)
        + "; " + ", ".join(f"baseline {m} {_gb(b['host_bytes'])}, {b['step_time_s']:.2f} s"
                           for m, b in base.items()))
    return ratios({"model": key, "batch": batch, "parameters": h.pop("parameters"), "harmony": h,
                   "baselines": base})


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


def measure(quick: bool, log) -> tuple[dict, list[dict]]:
    """The --quick check and (unless `quick`) every model the zoo has, compared (`compare`)."""
    qkey, qbatch, qgrid = QUICK
    check = compare(qkey, qbatch, qgrid, log)
    return check, [] if quick else [compare(key, BATCH, GRID, log) for key in available()]


def run(quick: bool, log) -> Report:
    return build_report(*measure(quick, log), quick)


def build_report(check: dict, compared: list[dict], quick: bool) -> Report:
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
            "measured": {"check": check, "compared": compared}}
    return Report("harmony", CITATION, setup, [swap, speed, figures], quick, meta)
