"""VGG-16, batch 16, 224 px, trained on the CPU under a 1 GiB budget: less than its training state alone.

    python benchmarks/weights_vgg16.py                 # 2 steps; writes benchmarks/results/weights_vgg16.{json,md}
    python benchmarks/weights_vgg16.py --steps 1 --budget 1GiB

VGG-16's parameters and SGD momentum take 1.03 GiB; with its gradients 1.55 GiB. Policy `auto` under the budget
fuses each layer's update into its backward, homes the weights and momentum of the largest layers on the host
(updated there), and offloads activations on top. The reference is policy `liveness` on the textbook route
(one update step at the end), trained on the same batches with the same seed; `liveness` equals `none` bit for
bit (an invariant the test suite holds on every network), and `none` itself would allocate 14.8 GiB up front.
Reported: whether parameters and optimizer state are bit-identical after the steps, the pool's measured peak
against the plan's, bytes moved per step by role, and step times (the machine is shared: other jobs run).
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from minidl.data import synthetic
from minidl.memory.decisions.weights import host_homed, moved_by_role
from minidl.memory.pool import format_bytes, parse_size
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import RunConfig, Session

RESULTS = Path(__file__).parent / "results"


def run(policy: str, budget, steps: int, batch: int, fused):
    net = build_model("vgg", depth=16, batch=batch, image_size=224, num_classes=1000)
    t = time.perf_counter()
    sess = Session(net, SGD(lr=0.01, momentum=0.9), policy=policy, budget=budget, seed=0,
                   config=RunConfig(fused_update=fused))
    plan_s = time.perf_counter() - t
    data = synthetic(batch * steps, (3, 224, 224), 1000, seed=0)
    res = sess.fit(data, steps)
    return sess, res, plan_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--out", default=str(RESULTS / "weights_vgg16"))
    args = ap.parse_args()
    budget = parse_size(args.budget)

    got, got_res, plan_s = run("auto", budget, args.steps, args.batch, None)
    state = got.plan.route.persistent_bytes()
    grads = sum(t.nbytes for t in got.plan.route.tensors.values() if t.role.value == "gradient")
    got_params, got_opt = got.executor.state_dict(), got.executor.optimizer_state()
    homed = host_homed(got.plan)
    row = {
        "model": "vgg16", "batch": args.batch, "image_size": 224, "steps": args.steps, "budget_bytes": budget,
        "training_state_bytes": state + grads, "params_and_momentum_bytes": state,
        "plan_min_budget_bytes": got.plan.min_budget_bytes, "plan_peak_bytes": got.plan.peak_bytes,
        "pool_peak_bytes": got.executor.pool.peak, "planning_s": plan_s,
        "homed_layers": sorted({got.plan.route.tensors[t].owner for t in homed}),
        "moved_bytes_by_role": moved_by_role(got.plan), "step_times_s": got_res.step_times,
        "losses": got_res.losses,
    }
    del got
    ref, ref_res, _ = run("liveness", None, args.steps, args.batch, False)
    ref_params, ref_opt = ref.executor.state_dict(), ref.executor.optimizer_state()
    row["bit_identical"] = (all(np.array_equal(got_params[k], ref_params[k]) for k in ref_params)
                            and all(np.array_equal(got_opt[k], ref_opt[k]) for k in ref_opt))
    row["reference_step_times_s"] = ref_res.step_times
    row["reference_pool_peak_bytes"] = ref.executor.pool.peak
    row["machine"] = f"{platform.node()} ({platform.processor() or platform.machine()}), shared with other jobs"
    row["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    Path(args.out + ".json").write_text(json.dumps(row, indent=1))
    m = row["moved_bytes_by_role"]
    md = [f"# VGG-16 batch {args.batch} at 224 px on the CPU under {format_bytes(budget)}", "",
          f"`python benchmarks/weights_vgg16.py --steps {args.steps} --budget {args.budget}`, {row['date']}, "
          f"{row['machine']}.", "",
          "| | policy auto, budget | reference: liveness, no budget |", "|---|---|---|",
          f"| training state (params + grads + momentum) | {format_bytes(state + grads)} | same |",
          f"| plan's smallest budget | {format_bytes(row['plan_min_budget_bytes'])} | - |",
          f"| pool peak measured (= plan's peak) | {format_bytes(row['pool_peak_bytes'])} "
          f"({row['pool_peak_bytes'] == row['plan_peak_bytes']}) | {format_bytes(row['reference_pool_peak_bytes'])} |",
          f"| layers whose weights live on the host | {len(row['homed_layers'])} ({', '.join(row['homed_layers'])})"
          f" | none |",
          f"| moved per step | weights {format_bytes(m['weights'])}, gradients {format_bytes(m['gradients'])}, "
          f"optimizer state {format_bytes(m['optimizer_state'])}, activations {format_bytes(m['activations'])} "
          f"| 0 |",
          f"| step times | {', '.join(f'{t:.1f} s' for t in row['step_times_s'])} "
          f"| {', '.join(f'{t:.1f} s' for t in row['reference_step_times_s'])} |",
          f"| parameters and momentum bit-identical after {args.steps} steps | {row['bit_identical']} | |", ""]
    Path(args.out + ".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
