"""Where minidl's training step spends the GPU's time, per layer kind and phase, beside PyTorch's kernels for the
same network and batch: the rows the next GPU work starts from.

    python benchmarks/gpu_profile.py                          # ResNet-50, batch 64, 224 px, fp32, on the GPU
    python benchmarks/gpu_profile.py --batch 32 --math tf32
    python benchmarks/gpu_profile.py --fake --out /tmp/prof   # every part on the CPU, small (the tests' mode)

minidl runs its compiled eager loop traced (`RunConfig(trace=True)`: no CUDA graph, each call between two timing
events on the compute stream, `Backend.call_clock`); each row is the median over --steps steps of its calls'
device time (`minidl.runtime.profile`), beside the route's FLOPs and bytes and the simulator's estimate on the
GPU's profile; `other` is the rest of the step (batch copy-in, fork sums, host gaps). PyTorch runs the same
network with the same weights (`minidl.testing.torch_twin.TorchTwin`, SGD with momentum) under `torch.profiler`:
each op's self device time (the kernels it launched) goes to the layer kind its name maps to
(`torch_twin.ATEN_KINDS`, approximate), to the phase of the `record_function` range it ran in (forward, update) or
else backward (autograd's thread). The simulator is fitted to minidl's rows (`memory.calibrate.fit_profile`).

Results: benchmarks/results/gpu_profile_<device>_<model>_b<batch>_<math>.json and .md (device, date, commit,
versions); docs/performance.md includes the .md files (docs/make_results.py). Without a GPU it says what is
missing and exits with status 2; --fake runs the same code on the CPU backend and PyTorch's CPU (self CPU time),
and refuses to write into benchmarks/results/.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from minidl.testing.gpu import why_no_gpu

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EXIT_NO_GPU = 2
FORMAT = "minidl-gpu-profile/1"
FORWARD, UPDATE = "phase:forward", "phase:update"   # PyTorch's record_function ranges (no ATEN_KINDS fragment)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--depth", type=int, default=50)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--math", default="fp32", choices=("fp32", "tf32"))
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per side (each row: their median)")
    ap.add_argument("--warmup", type=int, default=2, help="steps first, not profiled")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder of the .json and .md (default: results/)")
    ap.add_argument("--fake", action="store_true", help="the CPU backend and PyTorch's CPU instead of the GPU")
    return ap.parse_args(argv)


def _net(args):
    from minidl.models import build_model

    return build_model(args.model, depth=args.depth, batch=args.batch, image_size=args.image_size)


def _batches(net, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = net.input_nodes[0].shape
    k = net.logits_node.shape[1]
    return [(rng.standard_normal(shape).astype(np.float32), rng.integers(0, k, shape[0])) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------------
# minidl
# ---------------------------------------------------------------------------------------------------------

def minidl_side(args, net, backend, device) -> dict:
    """minidl's rows (`runtime.profile.profile_steps`), its median step and its initial parameters (for the twin)."""
    from minidl.optim import SGD
    from minidl.runtime.profile import profile_steps
    from minidl.runtime.session import RunConfig, Session

    sess = Session(net, SGD(lr=1e-4, momentum=0.9), policy="liveness", seed=0, backend=backend, math=args.math,
                   device=device, config=RunConfig(trace=True))
    state = {k: np.array(v, copy=True) for k, v in sess.executor.state_dict().items()}
    batches = _batches(net, args.warmup + args.steps)
    for x, y in batches[:args.warmup]:
        sess.executor.train_step(x, y)
    rows, walls = profile_steps(sess.executor, batches[args.warmup:], device)
    return {"rows": [r.to_json() for r in rows], "step_s": statistics.median(walls), "state": state,
            "runner": f"{sess.executor.step_runner}, traced (every call between two events)"}


# ---------------------------------------------------------------------------------------------------------
# PyTorch
# ---------------------------------------------------------------------------------------------------------

def _phase(evt) -> str:
    p = evt
    while p is not None:
        if p.name == FORWARD:
            return "forward"
        if p.name == UPDATE:
            return "update"
        p = p.cpu_parent
    return "backward"


def _self_time_s(evt, on_gpu: bool) -> float:
    """An op's own kernels' time (GPU), or its own CPU time (the fake mode), in seconds."""
    if on_gpu:
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0.0)
    else:
        us = evt.self_cpu_time_total
    return float(us) / 1e6


def torch_side(args, net, state, on_gpu: bool) -> dict:
    """PyTorch's seconds per (kind, phase) per step under torch.profiler, and its median step (timed apart)."""
    import torch

    from minidl.testing.torch_twin import TorchTwin, aten_kind

    dev = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu:
        torch.backends.cudnn.benchmark = True
        tf32 = args.math == "tf32"
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
    twin = TorchTwin(net, state)
    for ps in twin.params.values():
        for k, t in ps.items():
            ps[k] = t.detach().to(dev).requires_grad_(t.requires_grad)
    params = [t for ps in twin.params.values() for t in ps.values() if t.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9)
    batches = [(torch.tensor(x, device=dev), torch.tensor(y, device=dev)) for x, y in _batches(net, 1)]

    def step():
        x, y = batches[0]
        with torch.profiler.record_function(FORWARD):
            loss, _ = twin.forward(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        with torch.profiler.record_function(UPDATE):
            opt.step()
        if on_gpu:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            step()
    cpu = getattr(torch.autograd, "DeviceType", None)
    sums: dict[tuple[str, str], float] = {}
    for evt in prof.events():
        if evt.name in (FORWARD, UPDATE):
            continue
        if cpu is not None and getattr(evt, "device_type", cpu.CPU) != cpu.CPU:
            continue   # a kernel's own event: counted through the op that launched it
        key = (aten_kind(evt.name), _phase(evt))
        sums[key] = sums.get(key, 0.0) + _self_time_s(evt, on_gpu) / args.steps
    return {"seconds": sums, "step_s": statistics.median(walls), "version": torch.__version__}


# ---------------------------------------------------------------------------------------------------------
# the record
# ---------------------------------------------------------------------------------------------------------

def merge(minidl_rows: list[dict], torch_seconds: dict[tuple[str, str], float]) -> list[dict]:
    """minidl's rows with PyTorch's seconds of the same (kind, phase) beside them (None where PyTorch has none);
    PyTorch's kinds minidl has no row for follow, minidl's `other` last."""
    out, seen = [], set()
    for r in minidl_rows:
        key = (r["kind"], r["phase"])
        seen.add(key)
        out.append({**r, "torch_s": torch_seconds.get(key)})
    extra = [{"kind": k, "phase": p, "calls": 0, "seconds": None, "flops": 0, "bytes": 0, "sim_s": 0.0,
              "torch_s": s} for (k, p), s in sorted(torch_seconds.items(), key=lambda kv: -kv[1]) if (k, p) not in seen]
    other = [r for r in out if r["kind"] == "other"]
    return [r for r in out if r["kind"] != "other"] + extra + other


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()


def file_stem(record: dict) -> str:
    w = record["workload"]
    return f"gpu_profile_{slug(record['device'])}_{w['model']}{w['depth']}_b{w['batch']}_{w['math']}"


def _ms(s) -> str:
    return "" if s is None else f"{s * 1e3:.2f}"


def markdown(record: dict) -> str:
    """The record as a table, minidl's largest rows first (what the next GPU work starts from)."""
    w = record["workload"]
    step = record["minidl_step_s"]
    lines = [f"# minidl's step per layer kind on {record['device']} ({record['date']})", "",
             f"{w['model']}-{w['depth']}, batch {w['batch']}, {w['image_size']} px, {w['math']}, policy "
             f"`{w['policy']}`; `{record['command']}` at {record['commit']} (torch {record['versions']['torch']}). "
             f"minidl: {record['minidl_runner']}, step {_ms(step)} ms; PyTorch: step {_ms(record['torch_step_s'])} "
             "ms, kernels per op from torch.profiler, mapped to layer kinds approximately. Simulated: the "
             f"`{record['sim_profile']}` profile; fitted efficiency {record['fit']['efficiency']:.3f}.", "",
             "| layer kind | phase | calls | minidl ms | PyTorch ms | minidl / PyTorch | share of minidl's step | "
             "simulated ms | simulated vs minidl |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in record["rows"]:
        s, t = r["seconds"], r["torch_s"]
        ratio = f"{s / t:.2f}x" if s and t else ""
        share = f"{s / step:.0%}" if s is not None and step else ""
        sim = _ms(r["sim_s"]) if r["sim_s"] else ""
        err = f"{(r['sim_s'] - s) / s:+.0%}" if r["sim_s"] and s else ""
        lines.append(f"| {r['kind']} | {r['phase']} | {r['calls'] or ''} | {_ms(s)} | {_ms(t)} | {ratio} | {share} | "
                     f"{sim} | {err} |")
    return "\n".join(lines) + "\n"


def record_of(args, device_name: str, versions: dict, minidl: dict, torch_: dict, sim_profile: str) -> dict:
    from minidl.memory.calibrate import fit_profile

    fits, fitted = fit_profile([r for r in minidl["rows"] if r["kind"] != "other"], sim_profile)
    command = "python benchmarks/gpu_profile.py " + " ".join(sys.argv[1:])
    return {"format": FORMAT, "device": device_name, "date": datetime.date.today().isoformat(), "commit": _commit(),
            "command": command.strip(), "versions": versions,
            "workload": {"model": args.model, "depth": args.depth, "batch": args.batch,
                         "image_size": args.image_size, "math": args.math, "policy": "liveness"},
            "steps": args.steps, "minidl_step_s": minidl["step_s"], "minidl_runner": minidl["runner"],
            "torch_step_s": torch_["step_s"], "sim_profile": sim_profile,
            "rows": merge(minidl["rows"], torch_["seconds"]),
            "fit": {"efficiency": fitted.efficiency,
                    "rows": [{"kind": f.kind, "phase": f.phase, "flops_efficiency": f.flops_efficiency,
                              "bandwidth_efficiency": f.bandwidth_efficiency, "bound": f.bound,
                              "sim_error": f.sim_error} for f in fits]}}


def main(argv=None) -> int:
    args = parse(argv)
    if args.fake and args.out.resolve() == RESULTS.resolve():
        print("gpu_profile: --fake measures the CPU, not a GPU: give --out a folder outside benchmarks/results/",
              file=sys.stderr)
        return 2
    if not args.fake:
        reason = why_no_gpu()
        if reason is not None:
            print(f"gpu_profile: needs a CUDA GPU with cupy, the cuDNN frontend and a CUDA build of PyTorch: {reason}. "
                  "See docs/gpu.md (--fake runs it on the CPU).", file=sys.stderr)
            return EXIT_NO_GPU
    from minidl.backend import get_backend

    backend = get_backend("cpu" if args.fake else "cuda", math=None if args.fake else args.math)
    device_name = "CPU (gpu_profile --fake)" if args.fake else backend.gpu_name
    sim_profile = "cpu" if args.fake else backend.profile
    net = _net(args)
    print(f"gpu_profile: {args.model}-{args.depth} b{args.batch} on {device_name} ...", file=sys.stderr, flush=True)
    minidl = minidl_side(args, net, backend, sim_profile)
    torch_ = torch_side(args, _net(args), minidl.pop("state"), on_gpu=not args.fake)
    versions = {"torch": torch_["version"]}
    if not args.fake:
        import cudnn
        import cupy

        versions.update(cupy=cupy.__version__, cudnn=str(cudnn.backend_version()), cudnn_frontend=cudnn.__version__)
    record = record_of(args, device_name, versions, minidl, torch_, sim_profile)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = file_stem(record)
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    (args.out / f"{stem}.md").write_text(markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
