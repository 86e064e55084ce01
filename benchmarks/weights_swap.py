"""Bytes moved per sample when the training state does not fit: activation-only offload, per-layer weight swapping
without packs, and Harmony's layer packs with the planner's micro-batch count (simulator, k40c profile).

    python benchmarks/weights_swap.py            # ResNet-152 and VGG-16, batch 16, 224 px; writes results/

For each model the budget is below its training state (parameters + gradients + SGD momentum):
- **activation-only offload** (policy `offload`, weights resident: today's tensor cache) cannot fit there at
  all; its row reports the smallest budget it needs and what it moves at that budget;
- **per-layer weight swapping, no packs** (policy `weights`: every conv/FC layer's weights and momentum homed on
  the host, brought in for its forward and again for its backward, updated on the host; activations offloaded
  by the tensor cache as the budget demands; one batch, no micro-batches);
- **packs** (policy `packs`: micro-batches run pack by pack; weights brought in once per pack and block, only
  pack inputs stashed, packs re-run forward in backward; the planner picks M and the packing).
Reported per sample: bytes moved between host and device per training step divided by the batch, split by role,
and the simulator's step time on the k40c profile (compute plus the copies it cannot hide).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from minidl.core.errors import BudgetError
from minidl.core.tensors import Role
from minidl.memory.decisions.weights import moved_by_role
from minidl.memory.policies import plan_network
from minidl.memory.pool import format_bytes, parse_size
from minidl.memory.request import PlanRequest, Target
from minidl.memory.simulate import get_profile, simulate
from minidl.models import build_model
from minidl.optim import SGD

OUT = Path(__file__).resolve().parent / "results"
BUDGETS = {"vgg16": "1.25GiB", "resnet152": "512MiB"}


def row(model: str, batch: int, policy: str, budget: int, device: str) -> dict:
    net = build_model(model, batch=batch)
    slots, target = SGD(lr=0.01, momentum=0.9).slots, Target(get_profile(device))   # the CPU's menu
    t = time.perf_counter()
    try:
        plan = plan_network(net, slots, PlanRequest(policy, budget), target)
        fits = True
    except BudgetError as e:
        fits = False
        plan = plan_network(net, slots, PlanRequest(policy, e.min_budget_bytes), target)
    moved = moved_by_role(plan)
    sim = simulate(plan, device)
    return {"policy": policy, "fits": fits, "min_budget_bytes": plan.min_budget_bytes,
            "planning_s": time.perf_counter() - t, "moved_bytes": moved,
            "moved_per_sample": sum(moved.values()) / batch,
            "micro_batches": plan.route.micro_batches,
            "packs": len(plan.route.packing.packs) if plan.route.packing is not None else None,
            "est_step_time_s": sim.est_step_time_s, "exposed_transfer_s": sim.exposed_transfer_s}


def markdown(res: dict) -> str:
    """The table (and each model's ratio of per-layer swapping to packs, stored into `res`)."""
    batch = res["batch"]
    lines = [f"Bytes moved per sample below the training state ({res['date']}, simulator profile {res['device']}, "
             f"batch {batch}, 224 px, SGD momentum; planning on a shared 2-core machine)", "",
             "| model | training state | budget | plan | fits | smallest budget | moved / sample (weights, "
             "gradients, optimizer, activations) | M, packs | est. step |", "|---|---:|---:|---|---|---:|---|---|---:|"]
    for m, d in res["models"].items():
        for r in d["rows"]:
            mv = r["moved_bytes"]
            parts = ", ".join(format_bytes(mv[k] / batch) for k in ("weights", "gradients", "optimizer_state",
                                                                    "activations"))
            lines.append(f"| {m} | {format_bytes(d['training_state_bytes'])} | {format_bytes(d['budget_bytes'])} | "
                         f"{r['policy']} | {r['fits']} | {format_bytes(r['min_budget_bytes'])} | "
                         f"**{format_bytes(r['moved_per_sample'])}** ({parts}) | {r['micro_batches']}, "
                         f"{r['packs'] or '-'} | {r['est_step_time_s']:.2f} s |")
        w, p = d["rows"][1], d["rows"][2]
        if w["fits"] and p["fits"] and p["moved_per_sample"]:
            d["ratio_weights_over_packs"] = w["moved_per_sample"] / p["moved_per_sample"]
            lines.append(f"| {m} | | | per-layer swapping / packs | | | **{d['ratio_weights_over_packs']:.2f}x** "
                         f"| | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["resnet152", "vgg16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device", default="k40c")
    args = ap.parse_args(argv)
    res = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "batch": args.batch, "device": args.device,
           "models": {}}
    for m in args.models:
        net = build_model(m, batch=args.batch)
        route = net.route(optimizer_slots=("momentum",))
        state = sum(t.nbytes for t in route.tensors.values()
                    if t.role in (Role.PARAMETER, Role.GRADIENT, Role.OPTIMIZER))
        budget = parse_size(BUDGETS.get(m, "1GiB"))
        rows = [row(m, args.batch, p, budget, args.device) for p in ("offload", "weights", "packs")]
        for r in rows:
            print(m, r["policy"], "fits" if r["fits"] else "does not fit", format_bytes(r["moved_per_sample"]),
                  f"M={r['micro_batches']}", flush=True)
        res["models"][m] = {"training_state_bytes": state, "budget_bytes": budget, "rows": rows}
    OUT.mkdir(parents=True, exist_ok=True)
    prev = OUT / "weights_swap.json"
    if prev.exists():  # keep the other models' rows (a run may measure a subset)
        old = json.loads(prev.read_text())
        if old.get("batch") == args.batch and old.get("device") == args.device:
            res["models"] = {**old.get("models", {}), **res["models"]}
    text = markdown(res)
    prev.write_text(json.dumps(res, indent=1))
    (OUT / "weights_swap.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
