"""One training step of the same network (weights copied) in minidl and in PyTorch (CPU), in one process.

    python benchmarks/step_vs_torch.py --model resnet --depth 50 --batch 8 --image-size 224
    python benchmarks/step_vs_torch.py --model gpt2 --size small --seq 128 --batch 4     # a sequence model
    python benchmarks/step_vs_torch.py --model gpt2 --size small --seq 128 --batch 4 --out step_vs_torch_gpt2

With --out NAME the figures are also written to benchmarks/results/NAME.json (machine, date, command), from
which docs/performance.md's table is generated (docs/make_results.py).

Both run forward, backward and an SGD update after warm-up; the median of --steps timed steps is reported,
whole step and per layer type (minidl from its executor trace, PyTorch from torch.profiler's self CPU time
mapped from aten ops to layer types). Both use the same number of threads: torch's intra-op pool, minidl's
convolution lanes (the CPU menu's `threads`) and numpy's BLAS (threadpoolctl) are set to --threads. minidl runs its
compiled step (`minidl.runtime.program`) unless --interpreted. Steps alternate (minidl, torch, minidl, ...) so a machine
shared with other jobs slows both alike.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# Both frameworks' OpenMP with the short idle spin minidl uses for its own (`minidl.backend.cpu.gemm_jit`): with
# torch imported first, numba's OpenMP regions run on torch's GNU OpenMP runtime, which reads the setting once,
# when it loads. PyTorch's own step is not slower with it (measured, ResNet-56 b32 at 2 threads: 184 ms against
# 184-200 at the default); minidl's is (~300 -> ~240 ms).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
import torch  # noqa: E402 - after the OpenMP setting above
from threadpoolctl import threadpool_limits  # noqa: E402

from minidl.backend.cpu.backend import CPUBackend  # noqa: E402
from minidl.backend.cpu.menu import CPUMenu  # noqa: E402
from minidl.graph.route import Phase  # noqa: E402
from minidl.models import build_model, is_sequence_model  # noqa: E402
from minidl.optim import SGD  # noqa: E402
from minidl.runtime.session import RunConfig, Session  # noqa: E402
from minidl.testing.torch_twin import TorchTwin, aten_kind  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--depth", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--size", default=None, help="a sequence model's size (gpt2: small ... xl; bert: base ...)")
    ap.add_argument("--layers", type=int, default=None, help="a sequence model's blocks (default: the size's)")
    ap.add_argument("--seq", type=int, default=128, help="a sequence model's tokens per sequence")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--policy", default="liveness")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--interpreted", action="store_true", help="run minidl's interpreted executor")
    ap.add_argument("--out", default=None, help="also write benchmarks/results/OUT.json")
    ap.add_argument("--no-winograd", dest="winograd", action="store_false",
                    help="switch off the CPU backend's Winograd convolutions (on by default)")
    ap.add_argument("--winograd", dest="winograd", action="store_true", default=True,
                    help="Winograd on (the default; kept for the commands recorded before it was)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    threadpool_limits(args.threads)
    backend = CPUBackend(CPUMenu(winograd=args.winograd, threads=args.threads))   # minidl's lanes: --threads

    sequence = is_sequence_model(args.model)
    if sequence:  # dropout off: its masks differ between the frameworks, and it costs each about the same
        kw = {k: v for k, v in (("size", args.size), ("layers", args.layers)) if v is not None}
        net = build_model(args.model, batch=args.batch, seq=args.seq, dropout=0.0, **kw)
    else:
        net = build_model(args.model, depth=args.depth, batch=args.batch, image_size=args.image_size)
    sess = Session(net, SGD(lr=1e-4, momentum=0.9), policy=args.policy, seed=0, backend=backend,
                   config=RunConfig(trace=True, compiled=not args.interpreted))
    rng = np.random.default_rng(0)
    classes = net.logits_node.shape[-1]
    if sequence:  # tokens and their next tokens
        tokens = rng.integers(0, classes, (args.batch, args.seq + 1)).astype(np.int64)
        x, y = np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
    else:
        x = rng.standard_normal(net.input_nodes[0].shape).astype(np.float32)
        y = rng.integers(0, classes, args.batch).astype(np.int64)
    twin = TorchTwin(net, sess.executor.state_dict())
    topt = torch.optim.SGD(twin.parameters(), lr=1e-4, momentum=0.9)
    tx, ty = torch.tensor(x), torch.tensor(y)

    def torch_step():
        topt.zero_grad(set_to_none=True)
        loss, _ = twin.forward(tx, ty)
        loss.backward()
        topt.step()

    ours, theirs = [], []
    for _ in range(args.warmup):
        sess.executor.train_step(x, y)
        torch_step()
    sess.executor.trace.clear()
    for _ in range(args.steps):  # interleave so both see the same machine state
        t = time.perf_counter()
        sess.executor.train_step(x, y)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        torch_step()
        theirs.append(time.perf_counter() - t)

    per_ours: dict[str, float] = collections.defaultdict(float)
    labels = {s.label: s for s in sess.plan.route.steps}
    for ev in sess.executor.trace:
        if ev.track != "compute":
            continue
        step = labels[ev.name]
        kind = "update" if step.phase is Phase.UPDATE else net.nodes[step.node].type_name
        per_ours[kind] += ev.dur_s / args.steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            torch_step()
    per_theirs: dict[str, float] = collections.defaultdict(float)
    for evt in prof.key_averages():
        per_theirs[aten_kind(evt.key)] += evt.self_cpu_time_total / 1e6 / args.steps

    mo, mt = statistics.median(ours), statistics.median(theirs)
    shape = (f"{args.model}{'-' + args.size if args.size else ''} batch {args.batch} seq {args.seq}" if sequence
             else f"{args.model}-{args.depth} batch {args.batch} {args.image_size}px")
    print(f"{shape}, {args.threads} threads, "
          f"policy {args.policy}, {'interpreted' if args.interpreted else 'compiled'}"
          f"{', winograd' if args.winograd else ', no winograd'}; steps {ours=} {theirs=}")
    print(f"{'layer type':<14} {'minidl ms':>10} {'torch ms':>10} {'ratio':>7}")
    for kind in sorted(set(per_ours) | set(per_theirs), key=lambda k: -per_ours.get(k, 0)):
        a, b = per_ours.get(kind, 0.0) * 1e3, per_theirs.get(kind, 0.0) * 1e3
        print(f"{kind:<14} {a:>10.1f} {b:>10.1f} {a / b if b else float('nan'):>7.2f}")
    print(f"{'whole step':<14} {mo * 1e3:>10.1f} {mt * 1e3:>10.1f} {mo / mt:>7.2f}")
    print("(torch per-type times are profiler self-CPU times of the mapped aten ops; 'other' is unmapped)")
    if args.out:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        record = {
            "command": "python benchmarks/step_vs_torch.py " + shlex.join(sys.argv[1:]),
            "date": datetime.date.today().isoformat(),
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "load_average_after": load},
            "shape": shape, "threads": args.threads, "policy": args.policy,
            "runner": "interpreted" if args.interpreted else "compiled",
            "minidl_steps_s": ours, "torch_steps_s": theirs, "minidl_median_s": mo, "torch_median_s": mt,
            "per_type_ms": {k: {"minidl": per_ours.get(k, 0.0) * 1e3, "torch": per_theirs.get(k, 0.0) * 1e3}
                            for k in sorted(set(per_ours) | set(per_theirs))},
        }
        path = Path(__file__).resolve().parent / "results" / f"{args.out}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
