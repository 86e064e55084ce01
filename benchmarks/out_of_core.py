"""Out-of-core training, the experiment of Hayakawa & Narihira (nnabla): batches 2x..10x beyond device memory.

    python benchmarks/out_of_core.py                          # CPU run + simulator tables (CPU: ~45 min on a
                                                              # 2-core machine under load, ~10 idle)
    python benchmarks/out_of_core.py --skip-cpu               # simulator tables only
    python benchmarks/out_of_core.py --cpu-budget 64MiB --cpu-image 32 --cpu-steps 3

The paper's headline: ResNet-50 trained at batch 1440, 7.5x the largest batch that fits in GPU memory, at 55% of
the in-memory speed. Here, under a fixed budget B:

1. N0 = the largest batch that trains in memory at full speed: its `liveness` plan, every convolution on its
   fastest algorithm, fits B (binary search on the planner's exact arena). (A batch that fits only with
   slower, smaller-workspace algorithms is not "in memory at full speed"; on the CPU such algorithms can be
   several times slower, which would flatter the out-of-core runs.);
2. for each factor f in 2, 4, 7.5, 10: batch round(f * N0) is planned under `window` (nnabla's scheduler) and
   under `auto` (minidl's global search) within the same B; a batch that does not plan is reported as such;
3. speed: images/s relative to N0 in memory (liveness), and relative to the same batch in memory (liveness
   without a budget: what the copies alone cost, apart from the batch size's own effect on speed).

Two ways of measuring speed:
- **CPU, measured.** The arena is the device memory, host RAM the host (copies by the transfer thread).
  ResNet-50 at a small image size (`--cpu-image`, 10 classes) keeps it to minutes; each configuration trains
  `--cpu-steps` steps and the median step time is reported. The machine is shared with other jobs: the figures
  are noisy, and the absolute images/s are not comparable with a GPU.
- **Simulator.** ResNet-50 at 224 px, 1000 classes, with B the device's memory (`v100`: 16 GB, `h100`: 80 GB):
  the estimated step time of each plan (roofline compute per step, plus whatever copy time the host link
  cannot hide behind compute, `memory.simulate`).
Parameters, gradients and optimizer state (SGD with momentum) stay on the device under every policy.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

from minidl.core.errors import BudgetError
from minidl.data import synthetic
from minidl.memory.policies import plan_network
from minidl.memory.pool import format_bytes, parse_size
from minidl.memory.simulate import get_profile, simulate
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import Session

FACTORS = (2, 4, 7.5, 10)
SIM_FACTORS = (2, 3, 4, 5, 6, 7, 7.5, 10)   # planning only: a finer curve costs seconds, not hours
POLICIES = ("window", "auto")
OUT = Path(__file__).resolve().parent / "results"


def opt() -> SGD:
    return SGD(lr=0.01, momentum=0.9)


def make(batch: int, image: int, classes: int):
    return build_model("resnet", depth=50, batch=batch, image_size=image, num_classes=classes)


def fits(batch: int, image: int, classes: int, budget: int, policy: str = "liveness", device: str = "cpu"):
    """The plan of `batch` under `policy` within `budget`, or None if it does not fit. Liveness is planned
    without a budget (fastest algorithms everywhere) and fits if its arena does."""
    try:
        plan = plan_network(make(batch, image, classes), opt(), policy,
                            None if policy == "liveness" else budget, device=device)
    except BudgetError:
        return None
    return plan if plan.min_budget_bytes <= budget else None


def largest_batch(image: int, classes: int, budget: int) -> int:
    """N0: the largest batch whose liveness plan fits `budget` (fitting is monotone in the batch)."""
    lo, hi = 0, 1
    while fits(hi, image, classes, budget):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid, image, classes, budget):
            lo = mid
        else:
            hi = mid
    return lo


def cpu_run(budget: int, image: int, steps: int) -> dict:
    classes = 10
    n0 = largest_batch(image, classes, budget)
    rows = []

    def measure(batch: int, policy: str) -> dict:
        r = {"batch": batch, "policy": policy, "factor": batch / n0}
        t = time.perf_counter()
        try:
            net = make(batch, image, classes)
            sess = Session(net, opt(), policy=policy, budget=None if policy == "liveness" else budget, seed=0)
        except BudgetError as e:
            r.update(fits=False, min_budget_bytes=e.min_budget_bytes)
            return r
        r["planning_s"] = time.perf_counter() - t
        data = synthetic(batch, net.input_nodes[0].shape[1:], classes, seed=0)
        res = sess.fit(data, steps)
        plan = sess.plan
        r.update(fits=True, step_s=res.median_step_time, images_per_s=batch / res.median_step_time,
                 pool_peak_bytes=sess.executor.pool.peak, plan_peak_bytes=plan.peak_bytes,
                 offloaded_bytes=plan.offloaded_bytes, prefetched_bytes=plan.prefetched_bytes)
        print(f"  cpu batch {batch:>4} {policy:<8} {r['images_per_s']:.1f} images/s "
              f"(step {r['step_s']:.2f} s, moved {format_bytes(plan.offloaded_bytes + plan.prefetched_bytes)})",
              flush=True)
        return r

    base = measure(n0, "liveness")
    rows.append(base)
    same: dict[int, dict] = {n0: base}
    for f in FACTORS:
        b = round(f * n0)
        same[b] = measure(b, "liveness")     # the same batch in memory, beyond the budget: what the copies cost
        rows.append(same[b])
        for pol in POLICIES:
            rows.append(measure(b, pol))
    for r in rows:
        if r.get("fits"):
            r["relative_speed"] = r["images_per_s"] / base["images_per_s"]
            r["relative_same_batch"] = r["images_per_s"] / same[r["batch"]]["images_per_s"]
    return {"budget_bytes": budget, "image": image, "classes": classes, "n0": n0, "steps": steps, "rows": rows}


def sim_run(device: str) -> dict:
    prof = get_profile(device)
    budget, image, classes = int(prof.memory_bytes), 224, 1000
    n0 = largest_batch(image, classes, budget)
    base = simulate(fits(n0, image, classes, budget, device=device), prof)
    rows = [{"batch": n0, "policy": "liveness", "factor": 1.0, "fits": True, "step_s": base.est_step_time_s,
             "images_per_s": n0 / base.est_step_time_s, "relative_speed": 1.0, "relative_same_batch": 1.0}]
    for f in SIM_FACTORS:
        for pol in POLICIES:
            batch = round(f * n0)
            t = time.perf_counter()
            plan = fits(batch, image, classes, budget, pol, device)
            r = {"batch": batch, "policy": pol, "factor": f, "fits": plan is not None,
                 "planning_s": time.perf_counter() - t}
            if plan is not None:
                s = simulate(plan, prof)
                free = simulate(plan_network(make(batch, image, classes), opt(), "liveness", device=device), prof)
                r["relative_same_batch"] = free.est_step_time_s / s.est_step_time_s
                r.update(step_s=s.est_step_time_s, images_per_s=batch / s.est_step_time_s,
                         relative_speed=(batch / s.est_step_time_s) / rows[0]["images_per_s"],
                         exposed_transfer_s=s.exposed_transfer_s, moved_bytes=plan.offloaded_bytes +
                         plan.prefetched_bytes)
            rows.append(r)
            print(f"  {device} batch {batch:>5} {pol:<8} "
                  + (f"{r['relative_speed']:.0%} of in-memory speed" if plan is not None else "does not fit"),
                  flush=True)
    largest = {pol: _largest_between(rows, pol, image, classes, budget, device) for pol in POLICIES}
    for pol, b in largest.items():
        print(f"  {device}: largest batch under {pol}: {b} ({b / n0:.2f} x N0)", flush=True)
    return {"device": device, "budget_bytes": budget, "image": image, "classes": classes, "n0": n0, "rows": rows,
            "largest": largest}


def _largest_between(rows: list[dict], pol: str, image: int, classes: int, budget: int, device: str) -> int:
    """The largest batch `pol` plans within `budget`, to 1%: bisection between the tested batches that bracket it."""
    ok = [r["batch"] for r in rows if r["policy"] in (pol, "liveness") and r["fits"]]
    bad = [r["batch"] for r in rows if r["policy"] == pol and not r["fits"]]
    lo, hi = max(ok), min(bad) if bad else None
    if hi is None:
        return lo
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        if fits(mid, image, classes, budget, pol, device) is not None:
            lo = mid
        else:
            hi = mid
    return lo


def table(run: dict) -> str:
    lines = ["| batch | x N0 | policy | images/s | relative to N0 in memory | relative to this batch in memory |",
             "|---:|---:|---|---:|---:|---:|"]
    for r in run["rows"]:
        policy = r["policy"] + (" (no budget)" if r["policy"] == "liveness" and r["factor"] > 1 else "")
        if r.get("fits"):
            lines.append(f"| {r['batch']} | {r['factor']:.1f} | {policy} | {r['images_per_s']:.2f} | "
                         f"{r['relative_speed']:.0%} | {r['relative_same_batch']:.0%} |")
        else:
            lines.append(f"| {r['batch']} | {r['factor']:.1f} | {policy} | does not fit | - | - |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-budget", type=parse_size, default=parse_size("24MiB"))
    ap.add_argument("--cpu-image", type=int, default=32)
    ap.add_argument("--cpu-steps", type=int, default=2)
    ap.add_argument("--devices", nargs="*", default=["v100", "h100"])
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--json", default=str(OUT / "out_of_core.json"))
    args = ap.parse_args(argv)
    out = {"date": str(datetime.date.today()), "machine": platform.machine(), "sim": []}
    md = []
    if not args.skip_cpu:
        print("CPU (measured):", flush=True)
        out["cpu"] = run = cpu_run(args.cpu_budget, args.cpu_image, args.cpu_steps)
        md.append(f"CPU, measured: ResNet-50 at {run['image']} px, {run['classes']} classes, budget "
                  f"{format_bytes(run['budget_bytes'])}, N0 = {run['n0']}, median of {run['steps']} steps "
                  f"({out['date']}, {out['machine']}, shared machine)\n\n" + table(run))
    for dev in args.devices:
        print(f"simulator ({dev}):", flush=True)
        run = sim_run(dev)
        out["sim"].append(run)
        md.append(f"Simulator `{dev}`: ResNet-50 at 224 px, budget {format_bytes(run['budget_bytes'])}, "
                  f"N0 = {run['n0']}\n\n" + table(run) + "\n\nLargest batch within the budget: " + ", ".join(
                      f"{pol} {b} ({b / run['n0']:.2f} x N0)" for pol, b in run["largest"].items()))
    text = "\n\n".join(md)
    print("\n" + text)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        Path(args.json).with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
