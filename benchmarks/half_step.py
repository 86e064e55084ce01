"""What a half-precision step costs on the CPU against float32: the same network's compiled training step in fp32
and in bf16 (or fp16), in one process.

    python benchmarks/half_step.py --model resnet --depth 56 --batch 32 --image-size 32 --steps 12
    python benchmarks/half_step.py --model gpt2 --size small --seq 128 --batch 4 --steps 6
    python benchmarks/half_step.py --model resnet --depth 56 --batch 32 --image-size 32 --steps 12 --out half_step

Two sessions of one network and seed (policy `liveness`, the compiled step, tracing on), one per mode; after a
warm-up the steps alternate, the first mode swapping every step, so a machine shared with other jobs slows both
alike. Reported: each mode's min and median step, the ratio per pair of neighbouring steps (min, median, max), and
per layer type the median step's share from the traces. With --out NAME, also benchmarks/results/NAME.json and
NAME.md (machine, date, load average, command), which docs/performance.md includes (docs/make_results.py).
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

from minidl.graph.route import Phase
from minidl.models import build_model, is_sequence_model
from minidl.optim import SGD
from minidl.runtime.session import RunConfig, Session


def _net(args):
    if is_sequence_model(args.model):
        kw = {k: v for k, v in (("size", args.size), ("layers", args.layers)) if v is not None}
        return build_model(args.model, batch=args.batch, seq=args.seq, dropout=0.0, **kw)
    return build_model(args.model, depth=args.depth, batch=args.batch, image_size=args.image_size)


def _batch(net, args, rng):
    classes = net.logits_node.shape[-1]
    if is_sequence_model(args.model):
        tokens = rng.integers(0, classes, (args.batch, args.seq + 1)).astype(np.int64)
        return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
    return (rng.standard_normal(net.input_nodes[0].shape).astype(np.float32),
            rng.integers(0, classes, args.batch).astype(np.int64))


def _per_type(sess, steps: int) -> dict[str, float]:
    """Milliseconds a step per layer type, from the trace of `steps` steps."""
    labels = {s.label: s for s in sess.plan.route.steps}
    out: dict[str, float] = collections.defaultdict(float)
    for ev in sess.executor.trace:
        if ev.track == "compute" and ev.name in labels:
            st = labels[ev.name]
            kind = "update" if st.phase is Phase.UPDATE else sess.net.nodes[st.node].type_name
            out[kind] += ev.dur_s * 1e3 / steps
    return dict(out)


def markdown(r: dict) -> str:
    m, half = r["machine"], r["math"]
    lines = [f"{r['shape']}, policy `{r['policy']}`, compiled step, {r['steps']} steps a mode alternating "
             f"({r['date']}; {m['cpu']}, {m['cores']} cores, Python {m['python']}; load average "
             f"{m['load_average_before']:.2f} before, {m['load_average_after']:.2f} after): `{r['command']}`. "
             "Per layer type, the traces' mean a step (types under 1 ms left out).", "",
             f"| | fp32 | {half} | {half} / fp32 |", "|---|---:|---:|---:|"]
    for what in ("min", "median"):
        a, b = r["fp32_ms"][what], r[f"{half}_ms"][what]
        lines.append(f"| step, {what} | {a:.1f} ms | {b:.1f} ms | {b / a:.3f} |")
    p = r["paired_ratio"]
    lines.append(f"| ratio of neighbouring steps (min / median / max) | | | {p['min']:.3f} / {p['median']:.3f} / "
                 f"{p['max']:.3f} |")
    for kind, (a, b) in sorted(r["per_type_ms"].items(), key=lambda kv: -kv[1][0]):
        if a >= 1.0:
            lines.append(f"| {kind} | {a:.1f} ms | {b:.1f} ms | {b / a:.2f} |")
    return "\n".join(lines) + "\n"


RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None, results: Path = RESULTS) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--depth", type=int, default=56)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--size", default=None, help="a sequence model's size (gpt2: small ...)")
    ap.add_argument("--layers", type=int, default=None, help="a sequence model's blocks (default: the size's)")
    ap.add_argument("--seq", type=int, default=128, help="a sequence model's tokens per sequence")
    ap.add_argument("--math", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--steps", type=int, default=12, help="timed steps a mode")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--policy", default="liveness")
    ap.add_argument("--out", default=None, help="also write benchmarks/results/OUT.json and OUT.md")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    modes = ("fp32", args.math)
    sessions = {}
    for m in modes:
        net = _net(args)
        sessions[m] = Session(net, SGD(lr=1e-4, momentum=0.9), policy=args.policy, seed=0, math=m,
                              config=RunConfig(trace=True))
    x, y = _batch(sessions["fp32"].net, args, np.random.default_rng(0))
    for _ in range(args.warmup):
        for s in sessions.values():
            s.executor.train_step(x, y)
    for s in sessions.values():
        s.executor.trace.clear()
    times: dict[str, list[float]] = {m: [] for m in modes}
    for k in range(args.steps):
        for m in (modes if k % 2 == 0 else modes[::-1]):
            t = time.perf_counter()
            sessions[m].executor.train_step(x, y)
            times[m].append(time.perf_counter() - t)
    ratios = [b / a for a, b in zip(times["fp32"], times[args.math])]
    per = {m: _per_type(s, args.steps) for m, s in sessions.items()}
    shape = (f"{args.model}-{args.size or ''} batch {args.batch} seq {args.seq}" if is_sequence_model(args.model)
             else f"{args.model}-{args.depth} batch {args.batch} {args.image_size}px")
    record = {
        "name": args.out,
        "command": "python benchmarks/half_step.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "load_average_before": load_before,
                    "load_average_after": os.getloadavg()[0]},
        "shape": shape, "policy": args.policy, "math": args.math, "steps": args.steps,
        **{f"{m}_ms": {"min": min(times[m]) * 1e3, "median": statistics.median(times[m]) * 1e3,
                       "steps": [t * 1e3 for t in times[m]]} for m in modes},
        "paired_ratio": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)},
        "per_type_ms": {k: [per["fp32"].get(k, 0.0), per[args.math].get(k, 0.0)]
                        for k in sorted(set(per["fp32"]) | set(per[args.math]))},
    }
    print(markdown({**record, "name": args.out or "-"}))
    if args.out:
        (results / f"{args.out}.json").write_text(json.dumps(record, indent=1) + "\n")
        (results / f"{args.out}.md").write_text(markdown(record))
        print(f"wrote {results / args.out}.json and .md")
    return record


if __name__ == "__main__":
    main()
