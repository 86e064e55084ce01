"""Host time per route step: the compiled step against the interpreted executor, kernels' own time taken out.

    python benchmarks/dispatch.py --depth 1202 --batch 1 --steps 3

ResNet-1202 (CIFAR) at batch 1 has ~7,000 route steps of tiny kernels: what each step costs the executor itself
(event handling, pool bookkeeping, views, argument assembly: everything but the layer's forward/backward call)
decides how far the step is from its kernels' time. Both executors run with tracing on; per step,
dispatch = wall time of the whole step - the sum of the trace's compute events (each layer call, timed). The
two executors alternate step by step, so machine noise hits both alike; the median over --steps is reported.
The tracing wrapper's own cost (two clock reads and one record per route step) is measured separately and
reported, so a reader can take it out too.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

from minidl.core.vocab import TraceEvent
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.executor import Executor
from minidl.runtime.session import RunConfig, Session


def trace_overhead_s(n: int = 20000) -> float:
    """Seconds one traced no-op costs beyond the no-op: what tracing adds to each route step's dispatch."""
    trace: list = []
    clock = time.perf_counter

    def noop() -> None:
        pass
    t = clock()
    for _ in range(n):
        noop()
    bare = clock() - t
    t = clock()
    for i in range(n):
        s = clock()
        noop()
        trace.append(TraceEvent("x", "compute", s, clock() - s, i, 0))
    return (clock() - t - bare) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=1202)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--policy", default="liveness")
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads (kernels' time is taken out anyway)")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    threadpool_limits(args.threads)

    net = build_model("resnet", depth=args.depth, batch=args.batch, image_size=32, num_classes=10)
    opt = SGD(lr=1e-4, momentum=0.9)
    t = time.perf_counter()
    sess = Session(net, opt, policy=args.policy, seed=0, config=RunConfig(trace=True))
    plan_s = time.perf_counter() - t
    runners = {"compiled": sess.executor,
               "interpreted": Executor(net, sess.plan, opt, seed=0, trace=True, compiled=False)}
    rng = np.random.default_rng(0)
    x = rng.standard_normal(net.input_nodes[0].shape).astype(np.float32)
    y = rng.integers(0, 10, args.batch).astype(np.int64)
    t = time.perf_counter()
    runners["compiled"].train_step(x, y)  # the first step lowers the plan
    lower_s = time.perf_counter() - t
    runners["interpreted"].train_step(x, y)
    n_steps = len(sess.plan.steps)
    rows: dict[str, dict[str, list[float]]] = {k: {"wall": [], "kernels": []} for k in runners}
    for _ in range(args.steps):
        for name, ex in runners.items():
            ex.trace.clear()
            t = time.perf_counter()
            ex.train_step(x, y)
            wall = time.perf_counter() - t
            rows[name]["wall"].append(wall)
            rows[name]["kernels"].append(sum(e.dur_s for e in ex.trace if e.track == "compute"))
    a, b = runners["compiled"].state_dict(), runners["interpreted"].state_dict()
    identical = all(np.array_equal(a[k], b[k]) for k in a)
    tr = trace_overhead_s()
    out = {"model": f"resnet-{args.depth}", "batch": args.batch, "route_steps": n_steps, "policy": args.policy,
           "plan_s": plan_s, "first_compiled_step_s": lower_s, "trace_overhead_us": tr * 1e6,
           "bit_identical": identical, "program_calls": len(runners["compiled"].program or [])}
    print(f"resnet-{args.depth} batch {args.batch}, {n_steps} route steps, policy {args.policy}; "
          f"parameters bit-identical: {identical}")
    print(f"{'executor':<12} {'step ms':>9} {'kernels ms':>11} {'dispatch ms':>12} {'us/route step':>14}")
    for name, r in rows.items():
        disp = [w - k for w, k in zip(r["wall"], r["kernels"])]
        md, mw, mk = statistics.median(disp), statistics.median(r["wall"]), statistics.median(r["kernels"])
        per = md / n_steps * 1e6
        out[name] = {"step_s": mw, "kernels_s": mk, "dispatch_s": md, "dispatch_us_per_step": per}
        print(f"{name:<12} {mw * 1e3:>9.1f} {mk * 1e3:>11.1f} {md * 1e3:>12.1f} {per:>14.2f}")
    print(f"(tracing itself adds {tr * 1e6:.2f} us per route step to 'dispatch'; lowering the plan took "
          f"{lower_s:.2f} s including the first step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
