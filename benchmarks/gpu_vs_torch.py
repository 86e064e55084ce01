"""minidl against PyTorch on one GPU, in one run, alternating: issue 19's figures (needs a CUDA GPU).

    python benchmarks/gpu_vs_torch.py                        # every row below (ResNet-2500 rows take minutes)
    python benchmarks/gpu_vs_torch.py --only resnet50        # the ResNet-50 rows only
    python benchmarks/gpu_vs_torch.py --only resnet2500 --math tf32 --steps 3

Rows in fp32 and in tf32 (`--math`):
  resnet50   224 px, batch 1 / 32 / 64, minidl `liveness`          vs PyTorch plain
  resnet50   224 px, batch 32, minidl `--budget 700MiB` (auto)     vs PyTorch plain (and its own liveness row)
  resnet2500 224 px, batch 16, minidl `liveness` (in memory)       vs PyTorch plain
  resnet2500 224 px, batch 16, minidl `--budget 12GB` (auto)       vs PyTorch checkpoint_sequential
Rows in bf16 and in fp16 (`--math bf16 fp16`), against PyTorch AMP (`torch.autocast` in the mode, float32
parameters, channels_last for the convolution nets, `torch.amp.GradScaler` in fp16):
  resnet50   224 px, batch 32 / 64, minidl `liveness`              vs PyTorch AMP
  gpt2       small, batch 8, 512 tokens, minidl `liveness`         vs PyTorch AMP (scores not kept: cuDNN's SDPA;
             the row's `extra.attention` says which attention ran)
  gpt2_kept  the same with the scores kept (minidl's attention kernels): the other side of the layer's choice
PyTorch runs the same network (`minidl.testing.torch_twin.TorchTwin`: one functional call per layer, the same initial
weights) with SGD (momentum 0.9) and `cudnn.benchmark`; minidl runs its compiled step, as CUDA graphs where the
plan can be captured (`minidl.runtime.capture`; the row's `minidl_runner` says how it ran), with convolution algorithms
autotuned on the GPU (cache: results/gpu_autotune.json). Math modes match: fp32 turns TF32 off on both sides
(`torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False`), tf32 on on both; in bf16 and
fp16 minidl trains with `--math` the mode and PyTorch under autocast (`amp`).

Alternating: where both fit on the device together the steps alternate (minidl, PyTorch, minidl, ...); where they
do not (ResNet-2500) each side runs a round of steps, is freed, and the other runs, `--rounds` times; the row's
`alternation` says which. Step time is the median of the timed steps (after `--warmup` steps), host clock around
a step that ends with the loss on the host (minidl) or `torch.cuda.synchronize()` (PyTorch).

minidl plans on a profile measured on the GPU first (`memory/calibrate.py`); the row's `extra.sim_s` is the
simulator's estimate of its step on that profile and `extra.sim_vs_measured` its error (the issue asks for 20%).

Peak bytes: minidl's arena peak plus its device memory outside the arena (cuDNN side buffers); PyTorch's
`torch.cuda.max_memory_allocated()` for the row. `hidden_fraction`: minidl's share of copy time hidden behind
compute (host store; null where nothing moves); copies replayed inside a CUDA graph are not timed, so for those
rows it comes from 3 compiled eager steps of the same plan run after the timed ones. Results:
results/gpu_vs_torch.json (a list of rows) and .md.

torch is imported by this script only (and by minidl's tests); without a GPU, cupy, the cuDNN frontend or torch
it prints why and exits with status 2.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from minidl.testing.gpu import why_no_gpu

OUT = Path(__file__).resolve().parent / "results"
EXIT_NO_GPU = 2
MATHS = ("fp32", "tf32", "bf16", "fp16")
HALF_MATHS = ("bf16", "fp16")            # the modes PyTorch runs under autocast
WORKLOADS = ("resnet50", "resnet2500", "gpt2", "gpt2_kept")
GPT2_BATCH, GPT2_SEQ = 8, 512            # GPT-2 small's row: 4,096 tokens a step


@dataclass(slots=True)
class RowSpec:
    workload: str          # resnet50 | resnet2500 | gpt2 | gpt2_kept
    batch: int
    math: str              # fp32 | tf32 | bf16 | fp16
    minidl: str            # "liveness" or the budget ("700MiB", "12GB")
    peer: str              # plain | checkpoint_sequential | amp


@dataclass(slots=True)
class Row:
    workload: str
    batch: int
    math: str
    minidl: str
    peer: str
    minidl_s: float
    torch_s: float
    ratio: float
    minidl_peak_bytes: int
    torch_peak_bytes: int
    hidden_fraction: float | None
    device: str
    date: str
    minidl_runner: str = ""
    alternation: str = ""
    steps: int = 0
    extra: dict = field(default_factory=dict)


def row_specs(only: list[str] | None, maths: list[str]) -> list[RowSpec]:
    """The issue's rows, in the order they run (cheapest first)."""
    rows = []
    for m in maths:
        if m in HALF_MATHS:
            rows += [RowSpec("resnet50", b, m, "liveness", "amp") for b in (32, 64)]
            rows += [RowSpec(w, GPT2_BATCH, m, "liveness", "amp") for w in ("gpt2", "gpt2_kept")]
            continue
        rows += [RowSpec("resnet50", b, m, "liveness", "plain") for b in (1, 32, 64)]
        rows.append(RowSpec("resnet50", 32, m, "700MiB", "plain"))
        rows.append(RowSpec("resnet2500", 16, m, "liveness", "plain"))
        rows.append(RowSpec("resnet2500", 16, m, "12GB", "checkpoint_sequential"))
    return [r for r in rows if not only or r.workload in only]


# ---------------------------------------------------------------------------------------------------------
# PyTorch: the twin on the GPU, a forward that frees what it no longer needs, checkpoint_sequential's segments
# ---------------------------------------------------------------------------------------------------------

def torch_twin(net, state: dict, device, channels_last: bool = False):
    """`TorchTwin` of `net` with its parameters (and BN statistics) on `device`; 4-D ones channels_last if asked."""
    import torch

    from minidl.testing.torch_twin import TorchTwin

    twin = TorchTwin(net, state)
    for ps in twin.params.values():
        for k, t in ps.items():
            t = t.detach().to(device)
            if channels_last and t.dim() == 4:
                t = t.contiguous(memory_format=torch.channels_last)
            ps[k] = t.requires_grad_(t.requires_grad or ps[k].requires_grad)
    twin.tied = {n.name: {p: twin.params[o][op] for p, (o, op) in n.tied.items()} for n in net.layer_nodes}
    return twin


def _consumers(net) -> dict[int, int]:
    count = {n.index: 0 for n in net.nodes}
    for n in net.layer_nodes:
        for i in n.inputs:
            count[i] += 1
    return count


def _run_nodes(twin, nodes, vals: dict, remaining: dict) -> None:
    """Run `nodes` in order into `vals`, dropping each value once its last consumer ran (what an nn.Module's
    forward does), so PyTorch's peak is autograd's saved tensors, not every output."""
    for n in nodes:
        xs = [vals[i] for i in n.inputs]
        fn = twin.fns[n.index]
        params = twin.params[n.name] | twin.tied[n.name]   # a tied parameter is its owner's tensor
        vals[n.index] = fn(xs, params, True) if n.layer.type_name == "batchnorm" else fn(xs, params)
        for i in n.inputs:
            remaining[i] -= 1
            if remaining[i] == 0 and i != n.index:
                vals.pop(i, None)


def plain_loss(twin, x, y):
    """The loss of `twin` on (x, y), values freed after their last use."""
    net = twin.net
    inputs = net.input_nodes
    vals = {inputs[0].index: x, inputs[1].index: y}
    remaining = _consumers(net)
    remaining[inputs[1].index] += 1   # labels are kept to the end
    _run_nodes(twin, net.layer_nodes, vals, remaining)
    return vals[net.loss_index]


def sequential_cuts(net) -> list[int]:
    """Positions in `net.layer_nodes` after which exactly one value (that node's output) is live: the points
    where a DAG (ResNet: between blocks) is a chain of single-tensor functions, as checkpoint_sequential needs.
    The labels and the loss layer are left out (the loss is applied after the last segment)."""
    nodes = [n for n in net.layer_nodes if n.index != net.loss_index]
    labels = net.input_nodes[1].index
    pos = {n.index: k for k, n in enumerate(nodes)}
    last_use = {}
    for k, n in enumerate(nodes):
        for i in n.inputs:
            if i != labels:
                last_use[i] = k
    logits = net.logits_node.index
    last_use[logits] = len(nodes)
    cuts = []
    for k, n in enumerate(nodes):
        live = [i for i, last in last_use.items() if last > k and (i not in pos or pos[i] <= k)]
        if live == [n.index]:
            cuts.append(k)
    return cuts


def segment_functions(twin) -> list:
    """The network (without its loss) as a list of one-tensor-in, one-tensor-out functions, one per stretch
    between `sequential_cuts`: `checkpoint_sequential(fns, segments, x)` is then PyTorch's usual recipe."""
    net = twin.net
    nodes = [n for n in net.layer_nodes if n.index != net.loss_index]
    cuts = sequential_cuts(net)
    if not cuts or cuts[-1] != len(nodes) - 1:
        cuts.append(len(nodes) - 1)
    fns, start, src = [], 0, net.input_nodes[0].index
    for end in cuts:
        part = nodes[start:end + 1]
        out = part[-1].index

        def fn(x, part=part, src=src, out=out):
            vals = {src: x}
            remaining = _consumers(net)
            remaining[out] += 1
            _run_nodes(twin, part, vals, remaining)
            return vals[out]
        fns.append(fn)
        start, src = end + 1, out
    return fns


class TorchStep:
    """One PyTorch training step on `device`: plain, checkpoint_sequential, or AMP (`mode` bf16/fp16: autocast,
    channels_last for 4-D inputs, a GradScaler in fp16), as PyTorch's users run mixed precision."""

    def __init__(self, net, state, x, y, peer: str, segments: int | None, mode: str = "fp32",
                 device: str = "cuda"):
        import torch

        self.torch = torch
        dev = torch.device(device)
        self.amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode) if peer == "amp" else None
        if peer == "amp" and self.amp is None:
            raise ValueError(f"peer 'amp' runs in bf16 or fp16, not {mode!r}")
        channels_last = self.amp is not None and np.ndim(x) == 4
        self.twin = torch_twin(net, state, dev, channels_last)
        self.x = torch.as_tensor(x, device=dev)
        if channels_last:
            self.x = self.x.contiguous(memory_format=torch.channels_last)
        self.y = torch.as_tensor(y, device=dev)
        self.opt = torch.optim.SGD(self.twin.parameters(), lr=1e-4, momentum=0.9)
        self.scaler = torch.amp.GradScaler(device) if self.amp is torch.float16 else None
        self.peer = peer
        self.device = dev
        if peer == "checkpoint_sequential":
            self.fns = segment_functions(self.twin)
            self.segments = segments or max(1, round(math.sqrt(len(self.fns))))

    def __call__(self) -> float:
        torch = self.torch
        self.opt.zero_grad(set_to_none=True)
        if self.peer == "checkpoint_sequential":
            from torch.utils.checkpoint import checkpoint_sequential

            logits = checkpoint_sequential(self.fns, self.segments, self.x, use_reentrant=False)
            loss = torch.nn.functional.cross_entropy(logits, self.y)
        else:
            with torch.autocast(self.device.type, dtype=self.amp or torch.bfloat16, enabled=self.amp is not None):
                loss = plain_loss(self.twin, self.x, self.y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return float(loss.detach())


# ---------------------------------------------------------------------------------------------------------
# minidl
# ---------------------------------------------------------------------------------------------------------

class MinidlStep:
    """minidl's side of a row: planned on a profile measured on this GPU (`memory/calibrate.py`: the link with
    both directions busy, the efficiency fitted to the autotuned convolutions), so `sim_s`, the simulator's
    estimate of the step, can be compared with the measured one (the issue asks for 20%)."""

    def __init__(self, spec: RowSpec, net, x, y, autotune_path: Path | None, graphs: bool = True):
        from minidl.backend import get_backend
        from minidl.memory.calibrate import measured_profile
        from minidl.memory.simulate import simulate
        from minidl.memory.workspace import CostTable, workspace_choices
        from minidl.optim import SGD
        from minidl.runtime.session import RunConfig, Session

        self.be = get_backend("cuda", math=spec.math)
        budget = None if spec.minidl == "liveness" else spec.minidl
        costs = CostTable(autotune=True, backend=self.be, path=autotune_path) if autotune_path else None
        opt = SGD(lr=1e-4, momentum=0.9)
        route = None
        if costs is not None:   # the convolutions measured first: the efficiency is fitted to them
            route = net.route(True, tuple(opt.slots), menu=self.be)
            workspace_choices(route, costs)
        self.device = measured_profile(self.be, costs=costs, route=route)
        self.sess = Session(net, opt, policy="liveness" if budget is None else "auto", budget=budget, seed=0,
                            backend=self.be, math=spec.math, device=self.device,
                            config=RunConfig(costs=costs, graphs=graphs))
        self.sim_s = simulate(self.sess.plan, self.device).est_step_time_s
        self.x, self.y = x, y

    def __call__(self) -> float:
        return self.sess.executor.train_step(self.x, self.y)

    def peak_bytes(self) -> int:
        return int(self.sess.executor.pool.peak) + int(self.be.memory_report()["side_bytes"])

    def hidden_fraction(self, eager_steps: int = 3) -> float | None:
        """minidl's share of copy time hidden behind compute (None: nothing moves). Copies replayed inside a CUDA
        graph are not timed, so then the same plan runs `eager_steps` compiled eager steps (same copies, same
        streams, timed by events) and their overlap is reported."""
        from minidl.memory.host import transfer_json

        ex = self.sess.executor
        host = ex.host
        if host is None:
            return None
        if host.untimed_copies:
            host.reset_stats()
            host.untimed_copies = 0
            for _ in range(eager_steps):
                ex.program.run(self.x, self.y)
        return transfer_json(host).get("transfer_hidden_fraction")

    def runner(self) -> str:
        ex = self.sess.executor
        if ex.graph_step is not None:
            return ex.graph_step.describe()
        return f"{ex.step_runner} ({ex.graph_fallback})"

    def close(self) -> None:
        self.be.close()


def attention_ran(be) -> str:
    """Which attention a run's half steps used: 'cudnn_sdpa', or 'kernels' with cuDNN's reason where it refused."""
    from minidl.backend.cuda.cudnn_specs import SDPA_OPS

    refused = [f"{op}: {be.fallbacks[op]}" for op in SDPA_OPS if op in be.fallbacks]
    if refused:
        return "kernels (" + "; ".join(refused) + ")"
    return "cudnn_sdpa" if set(SDPA_OPS) <= be.graphs.ops() else "kernels"


def _timed(step) -> float:
    t = time.perf_counter()
    step()
    return time.perf_counter() - t


def _free_gpu() -> None:
    gc.collect()
    import cupy
    import torch

    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


def workload(spec: RowSpec, **sizes):
    """The row's network builder and one batch (x, y) from seed 0; `sizes` override the network's for tests."""
    from minidl.models import build_model

    rng = np.random.default_rng(0)
    if spec.workload.startswith("gpt2"):   # dropout off: its masks differ between the frameworks
        # scores not kept: attention runs cuDNN's SDPA, as PyTorch AMP's runs flash attention (no score matrix);
        # gpt2_kept keeps them (minidl's kernels), to measure what the layer's choice costs or saves
        keep = spec.workload == "gpt2_kept"
        kw = {"size": "small", "seq": GPT2_SEQ, "dropout": 0.0, "keep_scores": keep} | sizes

        def net():
            return build_model("gpt2", batch=spec.batch, **kw)
        vocab = net().logits_node.shape[-1]
        tokens = rng.integers(0, vocab, (spec.batch, kw["seq"] + 1)).astype(np.int64)
        return net, np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
    kw = {"depth": 50 if spec.workload == "resnet50" else 2500, "image_size": 224} | sizes

    def net():
        return build_model("resnet", batch=spec.batch, **kw)
    n0 = net()
    x = rng.standard_normal(n0.input_nodes[0].shape).astype(np.float32)
    return net, x, rng.integers(0, n0.logits_node.shape[1], spec.batch).astype(np.int64)


def _mine(m: MinidlStep, spec: RowSpec) -> tuple:
    """minidl's figures of a row, taken before its backend closes; the attention that ran for GPT-2."""
    return (m.peak_bytes(), m.hidden_fraction(), m.runner(), m.sim_s, m.device.note,
            attention_ran(m.be) if spec.workload.startswith("gpt2") else None)


def run_row(spec: RowSpec, steps: int, warmup: int, rounds: int, segments: int | None, autotune: Path | None,
            device_name: str, log, graphs: bool = True) -> Row:
    import torch

    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = spec.math == "tf32"
    torch.backends.cudnn.benchmark = True
    net, x, y = workload(spec)
    n0 = net()
    ours, theirs = [], []
    total = torch.cuda.get_device_properties(0).total_memory
    m = MinidlStep(spec, net(), x, y, autotune, graphs)
    state = m.sess.executor.state_dict()   # minidl's initial weights: PyTorch starts from the same
    together = spec.workload != "resnet2500" and m.sess.plan.peak_bytes * 2.5 < total
    if together:   # both resident: alternate step by step
        t = TorchStep(n0, state, x, y, spec.peer, segments, spec.math)
        torch.cuda.reset_peak_memory_stats()
        for k in range(warmup + steps):
            a, b = _timed(m), _timed(t)
            if k >= warmup:
                ours.append(a)
                theirs.append(b)
        torch_peak = torch.cuda.max_memory_allocated()
        del t
        alternation = "step"
    else:          # one at a time: rounds of steps, freeing each side before the other runs
        torch_peak = 0
        for r in range(rounds):
            if m is None:
                m = MinidlStep(spec, net(), x, y, autotune, graphs)
            ours += [_timed(m) for _ in range(warmup + steps)][warmup:]
            mine = _mine(m, spec)
            m.close()
            m = None
            _free_gpu()
            torch.cuda.reset_peak_memory_stats()
            t = TorchStep(n0, state, x, y, spec.peer, segments, spec.math)
            theirs += [_timed(t) for _ in range(warmup + steps)][warmup:]
            torch_peak = max(torch_peak, torch.cuda.max_memory_allocated())
            del t
            _free_gpu()
            log(f"    round {r + 1}/{rounds}: minidl {statistics.median(ours):.4f} s, torch "
                f"{statistics.median(theirs):.4f} s")
        alternation = f"rounds of {steps} steps x {rounds}"
    if m is not None:
        mine = _mine(m, spec)
        m.close()
    _free_gpu()
    ms, ts = statistics.median(ours), statistics.median(theirs)
    extra = {"sim_s": mine[3], "sim_vs_measured": mine[3] / ms - 1.0, "profile": mine[4], "graphs": graphs}
    if mine[5] is not None:
        extra["attention"] = mine[5]
    return Row(spec.workload, spec.batch, spec.math, spec.minidl, spec.peer, ms, ts, ms / ts, mine[0],
               int(torch_peak), mine[1], device_name, datetime.date.today().isoformat(), mine[2], alternation,
               len(ours), extra)


def markdown(rows: list[Row]) -> str:
    own = {(r.workload, r.batch, r.math): r.minidl_s for r in rows if r.minidl == "liveness"}
    plain = {(r.workload, r.batch, r.math): r.torch_s for r in rows if r.peer == "plain" and r.minidl == "liveness"}
    lines = [f"# minidl vs PyTorch on {rows[0].device if rows else '?'} ({rows[0].date if rows else ''})", "",
             "Generated by `python benchmarks/gpu_vs_torch.py`; medians of the timed steps, alternating "
             "(see the script's docstring).", "",
             "| workload | batch | math | minidl | peer | minidl s | PyTorch s | ratio | vs own liveness | "
             "vs PyTorch plain | minidl peak | PyTorch peak | hidden | simulated s (error) | minidl ran as |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        key = (r.workload, r.batch, r.math)
        vs_own = f"{r.minidl_s / own[key]:.2f}x" if r.minidl != "liveness" and key in own else ""
        vs_plain = f"{r.minidl_s / plain[key]:.2f}x" if r.peer != "plain" and key in plain else ""
        hidden = "" if r.hidden_fraction is None else f"{r.hidden_fraction:.0%}"
        sim = f"{r.extra['sim_s']:.4f} ({r.extra['sim_vs_measured']:+.0%})" if "sim_s" in r.extra else ""
        lines.append(f"| {r.workload} | {r.batch} | {r.math} | {r.minidl} | {r.peer} | {r.minidl_s:.4f} | "
                     f"{r.torch_s:.4f} | {r.ratio:.2f}x | {vs_own} | {vs_plain} | {r.minidl_peak_bytes / 1e9:.2f} GB"
                     f" | {r.torch_peak_bytes / 1e9:.2f} GB | {hidden} | {sim} | {r.minidl_runner}"
                     + (f"; attention: {r.extra['attention']}" if "attention" in r.extra else "") + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--only", nargs="*", choices=WORKLOADS, help="workloads to run (default all)")
    ap.add_argument("--math", nargs="*", default=["fp32", "tf32"], choices=MATHS,
                    help="math modes (bf16 and fp16 rows run against PyTorch AMP)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side and round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (the graph is captured in these)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds where the two sides cannot share the GPU")
    ap.add_argument("--segments", type=int, default=None,
                    help="checkpoint_sequential's segments (default: sqrt of the chain's length)")
    ap.add_argument("--no-autotune", action="store_true", help="minidl: cuDNN's heuristic order, no measuring")
    ap.add_argument("--no-graphs", action="store_true",
                    help="minidl: the compiled eager loop instead of CUDA graphs (what the graphs save)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    reason = why_no_gpu()
    if reason is not None:
        print(f"gpu_vs_torch: needs a CUDA GPU with cupy, the cuDNN frontend and a CUDA build of PyTorch: {reason}. "
              f"See ../shared/GPU.md for the setup on a GPU machine.", file=sys.stderr)
        return EXIT_NO_GPU
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(0)
    autotune = None if args.no_autotune else args.out / "gpu_autotune.json"
    rows: list[Row] = []

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    for spec in row_specs(args.only, args.math):
        log(f"{spec.workload} b{spec.batch} {spec.math} minidl {spec.minidl} vs {spec.peer} ...")
        row = run_row(spec, args.steps, args.warmup, args.rounds, args.segments, autotune, device_name, log,
                      graphs=not args.no_graphs)
        log(f"  minidl {row.minidl_s:.4f} s ({row.minidl_runner}), PyTorch {row.torch_s:.4f} s: {row.ratio:.2f}x")
        rows.append(row)
        (args.out / "gpu_vs_torch.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
        (args.out / "gpu_vs_torch.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
