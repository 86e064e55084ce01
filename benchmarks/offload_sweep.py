"""Budget sweep of the tensor cache: step time, bytes moved and overlap, from the `liveness` minimum down.

    python benchmarks/offload_sweep.py                      # ResNet-50, batch 32, 112 px, on the CPU
    python benchmarks/offload_sweep.py --model resnet20 --batch 32 --image-size 32 --steps 3 --json out.json

For every budget the network is planned with policy `offload` and trained for --warmup + --steps steps on
one fixed random batch, *alternating step by step* with a `liveness` session (no offload, no budget) of the
same network, seed and batch. Alternating matters on a shared machine: a background load that slows one
step slows its partner too, so the per-pair ratio of step times is far steadier than two separate medians.
Which session goes first alternates too, so neither always inherits the other's cache state.

Reported per budget:
- budget and budget / liveness minimum;
- MiB offloaded and prefetched per step (from the plan; the transfer engine measures the same bytes);
- step time (median) and its ratio to the paired no-offload step (median of the per-pair ratios);
- achieved copy bandwidth and the share of transfer time hidden behind compute, both *measured* by the
  host store over the timed steps (`1 - time the executor waited / time the thread copied`);
- the simulator's estimate of the hidden share on the same device profile (--device, default cpu);
- whether the final parameters equal the no-offload session's bit for bit, and that the pool's measured peak
  equals the plan's.

The budgets are the liveness minimum times each --fractions value, plus the smallest budget the offload
policy can meet (found by asking the planner for an impossible budget: its BudgetError names that minimum).
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time

import numpy as np

from minidl.core.errors import BudgetError
from minidl.memory.host import transfer_json
from minidl.memory.policies import plan_network
from minidl.memory.pool import format_bytes, parse_size
from minidl.memory.request import PlanRequest, Target
from minidl.memory.simulate import get_profile, simulate
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import RunConfig, Session

MiB = 1 << 20


def make_net(args):
    return build_model(args.model, depth=args.depth or None, batch=args.batch, image_size=args.image_size,
                       num_classes=args.num_classes)


def optimizer():
    return SGD(lr=1e-3, momentum=0.9)


def smallest_offload_budget(args) -> int:
    try:
        plan_network(make_net(args), optimizer().slots, PlanRequest("offload", 1), Target(get_profile(args.device)))
    except BudgetError as e:
        return int(e.min_budget_bytes)
    raise RuntimeError("a 1-byte budget was accepted")


def run_budget(args, budget: int, ref: Session, x, y) -> dict:
    t = time.perf_counter()
    sess = Session(make_net(args), optimizer(), policy="offload", budget=budget, seed=0,
                   config=RunConfig(host_limit_bytes=args.host_limit))
    planning_s = time.perf_counter() - t
    sim = simulate(sess.plan, args.device)
    ref_times, times = [], []
    for k in range(args.warmup + args.steps):
        if k == args.warmup and sess.executor.host is not None:
            sess.executor.host.reset_stats()  # leave out the first step's page faults in fresh host buffers
        pair = {}
        for name in (("ref", "off") if k % 2 == 0 else ("off", "ref")):  # alternate who goes first
            s = ref if name == "ref" else sess
            t = time.perf_counter()
            s.executor.train_step(x, y)
            pair[name] = time.perf_counter() - t
        if k >= args.warmup:
            ref_times.append(pair["ref"])
            times.append(pair["off"])
    measured = transfer_json(sess.executor.host, args.steps)
    a, b = ref.executor.state_dict(), sess.executor.state_dict()
    row = {
        "budget_bytes": budget, "budget_fraction": budget / args.liveness_min,
        "offloaded_bytes": sess.plan.offloaded_bytes, "prefetched_bytes": sess.plan.prefetched_bytes,
        "measured_offloaded_bytes": measured["offloaded_bytes"],
        "step_time_s": statistics.median(times), "no_offload_step_time_s": statistics.median(ref_times),
        "ratio": statistics.median(t2 / t1 for t1, t2 in zip(ref_times, times)),
        "transfer_hidden_fraction": measured["transfer_hidden_fraction"],
        "copy_bandwidth_bytes_per_s": measured["copy_bandwidth_bytes_per_s"],
        "transfer_time_s": measured["transfer_time_s"], "stall_s": measured["transfer_stall_s"],
        "sim_hidden_fraction": sim.transfer_hidden_fraction, "sim_ratio": sim.est_step_time_s / sim.compute_time_s,
        "planning_s": planning_s, "identical": all(np.array_equal(a[k], b[k]) for k in a),
        "pool_peak_bytes": sess.executor.pool.peak, "plan_peak_bytes": sess.plan.peak_bytes,
    }
    if sess.executor.host is not None:
        sess.executor.host.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--depth", type=int, default=50)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=112)
    ap.add_argument("--num-classes", type=int, default=None)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per budget (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--fractions", default="1.0,0.9,0.8,0.7,0.6,0.5",
                    help="budgets as fractions of the liveness minimum (the smallest feasible one is added)")
    ap.add_argument("--device", default="cpu", help="device profile the planner and simulator assume")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--host-limit", type=parse_size, default=None, metavar="SIZE",
                    help="host RAM for offloaded tensors; the rest goes to the disk tier (0: all of it)")
    ap.add_argument("--blas-threads", type=int, default=None,
                    help="limit BLAS threads (threadpoolctl); on a shared machine 1 avoids OpenBLAS's collapse when "
                         "its threads outnumber the free cores")
    args = ap.parse_args()
    if args.blas_threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.blas_threads)

    net = make_net(args)
    lv = plan_network(net, optimizer().slots, PlanRequest("liveness"), Target(get_profile(args.device)))
    args.liveness_min = lv.min_budget_bytes
    floor = smallest_offload_budget(args)
    budgets = sorted({int(args.liveness_min * float(f)) for f in args.fractions.split(",")} | {floor},
                     reverse=True)
    budgets = [b for b in budgets if b >= floor]
    print(f"{args.model}{args.depth or ''} batch {args.batch} at {args.image_size} px on {platform.node()} "
          f"({platform.processor() or platform.machine()}), {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"BLAS threads: {args.blas_threads or 'default'}; {args.warmup} warm-up + {args.steps} timed steps per "
          f"budget; host limit {'none' if args.host_limit is None else format_bytes(args.host_limit)}")
    print(f"liveness minimum {format_bytes(args.liveness_min)}; smallest budget with offload "
          f"{format_bytes(floor)} ({floor / args.liveness_min:.2f}x)")

    rng = np.random.default_rng(0)
    x = rng.standard_normal(net.input_nodes[0].shape).astype(np.float32)
    y = rng.integers(0, net.logits_node.shape[1], net.input_nodes[0].shape[0])

    head = (f"{'budget':>11} {'x liv.':>6} {'moved/step':>11} {'step s':>7} {'vs none':>7} {'hidden':>7} "
            f"{'sim hid':>7} {'copy GB/s':>9} {'plan s':>6}  same")
    print(head)
    rows = []
    for b in budgets:
        # A fresh reference per budget keeps both sessions at the same iteration, so parameters compare.
        ref = Session(make_net(args), optimizer(), policy="liveness", seed=0)
        gc.collect()
        r = run_budget(args, b, ref, x, y)
        rows.append(r)
        assert r["pool_peak_bytes"] == r["plan_peak_bytes"], "pool peak differs from the plan's"
        moved = (r["offloaded_bytes"] + r["prefetched_bytes"]) / MiB
        print(f"{format_bytes(b):>11} {r['budget_fraction']:6.2f} {moved:8.1f} MiB {r['step_time_s']:7.2f} "
              f"{r['ratio']:6.3f}x {r['transfer_hidden_fraction']:7.1%} {r['sim_hidden_fraction']:7.1%} "
              f"{r['copy_bandwidth_bytes_per_s'] / 1e9:9.2f} {r['planning_s']:6.2f}  "
              f"{'yes' if r['identical'] else 'NO'}",
              flush=True)
        del ref
        gc.collect()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "floor_bytes": floor, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
