"""Measured convolution algorithm ranking (`--autotune`) against the fixed estimates, on a real CPU run.

    python benchmarks/autotune.py --model resnet --depth 50 --batch 8 --image-size 112 --steps 3

Plans the same network twice under `--policy` (default liveness: every convolution on its fastest algorithm):
once ranked by the algorithms' fixed cost estimates, once by measuring each algorithm once per distinct shape on
this machine (`CostTable(autotune=True)`, like cudnnFind). Reports, for each: the algorithms chosen, the planned
peak (workspaces change it), and the median of --steps timed training steps (the two sessions alternate, so
machine noise hits both alike). Also the time autotuning took. Parameters must come out bit-identical: the CPU
algorithms differ only in memory and speed.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import numpy as np

from minidl.memory.pool import format_bytes
from minidl.memory.workspace import CostTable
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import RunConfig, Session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--depth", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=112)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--policy", default="liveness")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()

    def build():
        return build_model(args.model, depth=args.depth, batch=args.batch, image_size=args.image_size)

    table = CostTable(autotune=True, repeats=2)
    t = time.perf_counter()
    tuned = Session(build(), SGD(lr=1e-4, momentum=0.9), policy=args.policy, seed=0, config=RunConfig(costs=table))
    tune_s = time.perf_counter() - t
    est = Session(build(), SGD(lr=1e-4, momentum=0.9), policy=args.policy, seed=0)
    sessions = {"estimates": est, "autotune": tuned}

    rng = np.random.default_rng(0)
    shape = est.net.input_nodes[0].shape
    x = rng.standard_normal(shape).astype(np.float32)
    y = rng.integers(0, est.net.logits_node.shape[1], shape[0])
    times = collections.defaultdict(list)
    for s in sessions.values():  # warm-up (page faults in fresh arenas)
        s.executor.train_step(x, y)
    for _ in range(args.steps):
        for name, s in sessions.items():
            t = time.perf_counter()
            s.executor.train_step(x, y)
            times[name].append(time.perf_counter() - t)
    a, b = est.executor.state_dict(), tuned.executor.state_dict()
    identical = all(np.array_equal(a[k], b[k]) for k in a)

    out = {"model": f"{args.model}{args.depth}", "batch": args.batch, "image_size": args.image_size,
           "policy": args.policy, "autotune_s": tune_s, "measurements": table.measured,
           "distinct_shapes": len(table.seconds), "bit_identical": identical, "plans": {}}
    print(f"{args.model}-{args.depth}, batch {args.batch}, {args.image_size} px, policy {args.policy}; "
          f"autotuning measured {table.measured} (shape, algorithm) pairs over {len(table.seconds)} distinct "
          f"shapes in {tune_s:.1f} s; parameters bit-identical: {identical}")
    for name, s in sessions.items():
        algos = collections.Counter(sp.algo for sp in s.plan.steps if sp.algo is not None)
        med = statistics.median(times[name])
        out["plans"][name] = {"algorithms": dict(algos), "peak_bytes": s.plan.peak_bytes, "step_s": med,
                              "step_times_s": times[name]}
        print(f"  {name:10s} step {med:6.3f} s  peak {format_bytes(s.plan.peak_bytes):>11s}  "
              f"algorithms {dict(sorted(algos.items()))}")
    ratio = out["plans"]["autotune"]["step_s"] / out["plans"]["estimates"]["step_s"]
    print(f"  autotune / estimates step time: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
