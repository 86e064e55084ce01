"""SuperNeurons (Wang et al., PPoPP 2018) reproduced on the simulator, plus one real CPU run that proves it.

    python benchmarks/superneurons.py                  # everything: depth, batch, CPU run; writes results/
    python benchmarks/superneurons.py --skip-cpu-run   # planner only (minutes)
    python benchmarks/superneurons.py --only cpu-run --cpu-steps 3

What is measured, and how:

1. **Depth.** ImageNet bottleneck ResNets at batch 16 (224 px, 1000 classes), blocks (3, 4, k, 3) (depth
   3 (10 + k) + 2), planned for the `k40c` profile (12 GB). For each policy (`none`, `liveness`, `auto`) the
   largest k whose plan fits 12 GB is found by exponential then binary search (fitting is monotone in depth).
   Printed next to the paper's claim: >= 3.24x deeper than the frameworks without memory planning. Then
   SuperNeurons' own ResNet-2500, blocks (6, 32, 788, 6), must plan within 12 GB under `auto`.
2. **Batch.** For alexnet, vgg16, resnet50/101/152, densenet121 and inception_v4, the largest batch whose plan
   fits 12 GB under `none` and under `auto` (binary search over the batch size).
3. **The simulator is right.** ResNet-50 at 112 px, batch 32, trained --cpu-steps steps on this CPU under
   `auto` at its minimum budget and under `none`: the executor's measured pool peak must equal the plan's peak
   (which is what the simulator reports), the parameters must be bit-identical, and the step time ratio
   auto / none is reported.

All plans use SGD with momentum 0.9 (one optimizer state per parameter, planned like every other tensor), float32,
and the planner's exact byte counts; "fits" means the plan's smallest arena (peak plus fragmentation) is at most
the device's memory, 12 * 10^9 bytes for the K40c.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from minidl.core.errors import BudgetError
from minidl.memory.cudnn_model import planning_backend
from minidl.memory.policies import plan_network
from minidl.memory.pool import format_bytes
from minidl.memory.schedulers.auto import auto_search
from minidl.memory.schedulers.packs import plan_packs
from minidl.memory.simulate import get_profile, simulate
from minidl.models import build_model
from minidl.optim import SGD

PAPER_DEPTH_CLAIM = 3.24
SUPERNEURONS_TABLE5 = {"alexnet": 1792, "vgg16": 224, "inception_v4": 240, "resnet50": 384, "resnet101": 256,
                       "resnet152": 176}  # largest batch in 12 GB (shared/PAPERS.md, Table 5)
BATCH_MODELS = ["alexnet", "vgg16", "resnet50", "resnet101", "resnet152", "densenet121", "inception_v4"]
OUT = Path(__file__).resolve().parent / "results"


def optimizer() -> SGD:
    return SGD(lr=0.01, momentum=0.9)


def fits(net, policy: str, device: str) -> tuple[bool, int]:
    """(does `net` plan within the device's memory under `policy`, the bytes that decided it). The memory is the
    device's less its CUDA context, and the workspaces are cuDNN's as modeled for it (memory/cudnn_model.py)."""
    mem = get_profile(device).usable_bytes
    if policy == "auto":
        route = net.route(optimizer_slots=tuple(optimizer().slots), backend=planning_backend(device))
        res = auto_search(route, mem, device, frugal=False)
        return res.plan is not None, (res.plan.min_budget_bytes if res.plan is not None else 0)
    plan = plan_network(net, optimizer(), policy, device=device, backend=planning_backend(device))
    return plan.min_budget_bytes <= mem, plan.min_budget_bytes


def largest(ok, lo: int, start: int) -> int:
    """The largest n >= lo with ok(n), given ok(lo) (exponential search up from `start`, then binary)."""
    hi = max(start, lo + 1)
    while ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def depth_of(k: int) -> int:
    return 3 * (10 + k) + 2


def depth_search(device: str, log) -> dict:
    out = {}
    starts = {"none": 6, "liveness": 40, "auto": 600}
    for pol in ("none", "liveness", "auto"):
        t = time.perf_counter()

        def ok(k, pol=pol):
            good, b = fits(build_model("resnet", depth=depth_of(k), batch=16), pol, device)
            log(f"  {pol:<8} ResNet-{depth_of(k):<5} (blocks 3,4,{k},3): {'fits' if good else 'does not fit'}"
                + (f" ({format_bytes(b)})" if b else ""))
            return good

        if not ok(1):
            out[pol] = {"k": 0, "depth": 0}
            continue
        k = largest(ok, 1, starts[pol])
        out[pol] = {"k": k, "depth": depth_of(k), "blocks": [3, 4, k, 3], "search_s": time.perf_counter() - t}
    t = time.perf_counter()
    net = build_model("resnet", depth=2500, batch=16)
    route = net.route(optimizer_slots=tuple(optimizer().slots), backend=planning_backend(device))
    res = auto_search(route, get_profile(device).usable_bytes, device, frugal=False)
    out["resnet2500"] = {"fits": res.plan is not None, "planning_s": time.perf_counter() - t,
                         "min_budget_bytes": res.plan.min_budget_bytes if res.plan else None,
                         "chosen": next((x.name for x in res.trials if x.plan is res.plan), None),
                         "est_step_time_s": simulate(res.plan, device).est_step_time_s if res.plan else None}
    out["ratio_auto_over_none"] = out["auto"]["depth"] / max(1, out["none"]["depth"])
    out["ratio_liveness_over_none"] = out["liveness"]["depth"] / max(1, out["none"]["depth"])
    return out


def batch_search(device: str, models, log) -> dict:
    out = {}
    for m in models:
        row = {}
        for pol in ("none", "auto"):
            t = time.perf_counter()

            def ok(b, pol=pol, m=m):
                good, nbytes = fits(build_model(m, batch=b), pol, device)
                log(f"  {m:<12} {pol:<5} batch {b:<5}: {'fits' if good else 'does not fit'}"
                    + (f" ({format_bytes(nbytes)})" if nbytes else ""))
                return good

            row[pol] = largest(ok, 1, 16 if pol == "none" else 64) if ok(1) else 0
            row[f"{pol}_search_s"] = time.perf_counter() - t
        row["ratio"] = row["auto"] / max(1, row["none"])
        out[m] = row
    return out


def packs_batch_search(device: str, models, log, cap: int = 1024) -> dict:
    """The largest batch within the device's memory under policy `packs` (Harmony's layer packs and micro-batches,
    weights homed on the host, micro-batch count chosen by the planner), for the rows `auto` leaves below 2x
    SuperNeurons (VGG16: bound by its first 224x224 convolutions' working set, which only micro-batching shrinks)."""
    out = {}
    mem = get_profile(device).usable_bytes
    for m in models:
        t = time.perf_counter()
        chosen = {}

        def ok(b, m=m, chosen=chosen):
            try:
                net = build_model(m, batch=b)
                plan = plan_packs(net.route(optimizer_slots=tuple(optimizer().slots)), mem, device)
            except BudgetError as e:
                log(f"  {m:<12} packs batch {b:<5}: does not fit (needs {format_bytes(e.min_budget_bytes)})")
                return False
            chosen[b] = {"micro_batches": plan.route.micro_batches, "n_packs": len(plan.route.packing.packs),
                         "min_budget_bytes": plan.min_budget_bytes, "moved_bytes": plan.offloaded_bytes
                         + plan.prefetched_bytes}
            log(f"  {m:<12} packs batch {b:<5}: fits, {chosen[b]['micro_batches']} micro-batches in "
                f"{chosen[b]['n_packs']} packs ({format_bytes(plan.min_budget_bytes)})")
            return True

        if ok(cap):  # micro-batching makes almost any batch fit: stop at `cap` (the table's target is far below)
            best = cap
        else:
            best = largest(lambda b: b < cap and ok(b), 1, 256) if ok(1) else 0
        out[m] = {"packs": best, "capped": best == cap, "search_s": time.perf_counter() - t, **chosen.get(best, {})}
    return out


def cpu_run(steps: int, log, warmup: int = 1) -> dict:
    """ResNet-50 at 112 px, batch 32: auto at its minimum budget vs none, trained on this CPU.

    The two sessions train the same batches *alternating step by step* (and alternating which goes first), so
    that load from other processes on a shared machine hits both alike; the reported ratio is the median of the
    per-pair ratios. `warmup` steps of each are run first and not timed.
    """
    from minidl.data import BatchIterator, synthetic
    from minidl.runtime.session import Session

    def make():
        return build_model("resnet50", batch=32, image_size=112)

    try:
        plan_network(make(), optimizer(), "auto", budget=1, device="cpu")
        raise RuntimeError("a 1-byte budget cannot fit")
    except BudgetError as e:
        budget = int(e.min_budget_bytes)
    data = synthetic(64, (3, 112, 112), 1000, seed=0)
    result = {"model": "resnet50", "image_size": 112, "batch": 32, "steps": steps, "warmup": warmup,
              "min_budget_bytes": budget}
    sessions = {}
    for pol, b in (("none", None), ("auto", budget)):
        t = time.perf_counter()
        sessions[pol] = Session(make(), optimizer(), policy=pol, budget=b, seed=0)
        result[pol] = {"planning_s": time.perf_counter() - t, "step_times_s": []}
    batches = BatchIterator(data, 32, seed=0, shuffle=True, drop_last=True)
    ratios = []
    for i in range(warmup + steps):
        x, y = batches.next_batch()
        order = ("none", "auto") if i % 2 == 0 else ("auto", "none")
        dt = {}
        for pol in order:
            t = time.perf_counter()
            sessions[pol].executor.train_step(x, y)
            dt[pol] = time.perf_counter() - t
        if i >= warmup:
            for pol in dt:
                result[pol]["step_times_s"].append(dt[pol])
            ratios.append(dt["auto"] / dt["none"])
            log(f"  step {i - warmup + 1}: none {dt['none']:.2f} s, auto {dt['auto']:.2f} s")
    for pol, sess in sessions.items():
        sim = simulate(sess.plan, "cpu")
        result[pol].update({
            "plan_peak_bytes": sess.plan.peak_bytes, "measured_peak_bytes": sess.executor.pool.peak,
            "arena_bytes": sess.plan.arena_bytes, "median_step_s": statistics.median(result[pol]["step_times_s"]),
            "recompute_flops_share": sim.recompute_flops_share, "offloaded_bytes": sess.plan.offloaded_bytes,
            "est_step_s_cpu_profile": sim.est_step_time_s,
            "algos": sorted({sp.algo for sp in sess.plan.steps if sp.algo}),
            "refused_steps": sum(1 for sp in sess.plan.steps if sp.refused)})
    a, n = sessions["auto"].executor.state_dict(), sessions["none"].executor.state_dict()
    result["peak_equal"] = result["auto"]["measured_peak_bytes"] == result["auto"]["plan_peak_bytes"]
    result["bit_identical"] = all(np.array_equal(n[k], a[k]) for k in n)
    result["step_time_ratio_auto_over_none"] = statistics.median(ratios)
    result["memory_ratio_none_over_auto"] = result["none"]["plan_peak_bytes"] / budget
    return result


def chart(depth: dict | None, batch: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (depth, batch) if p]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), dpi=110, squeeze=False)
    i = 0
    if depth:
        ax = axes[0][i]
        i += 1
        pols = ["none", "liveness", "auto"]
        vals = [depth[p]["depth"] for p in pols]
        bars = ax.bar(pols, vals, color=["#999999", "#5b9bd5", "#ed7d31"])
        ax.bar_label(bars, [f"ResNet-{v}" for v in vals], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("deepest ResNet within 12 GB (batch 16)")
        ax.set_title(f"depth: auto / none = {depth['ratio_auto_over_none']:.2f}x (paper: >= {PAPER_DEPTH_CLAIM}x)")
    if batch:
        ax = axes[0][i]
        models = list(batch)
        x = np.arange(len(models))
        ax.bar(x - 0.2, [batch[m]["none"] for m in models], 0.4, label="none", color="#999999")
        ax.bar(x + 0.2, [batch[m]["auto"] for m in models], 0.4, label="auto", color="#ed7d31")
        ax.set_xticks(x, models, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("largest batch within 12 GB")
        ax.set_title("batch size on a 12 GB K40c (simulated)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def markdown(res: dict) -> str:
    lines = [f"SuperNeurons reproduction ({res['date']}, {res['machine']}; simulator profile k40c, 12 GB; SGD "
             f"momentum 0.9, float32)", ""]
    d = res.get("depth")
    if d:
        lines += ["| policy | deepest ResNet in 12 GB (batch 16) | blocks |", "|---|---:|---|"]
        for p in ("none", "liveness", "auto"):
            lines.append(f"| {p} | ResNet-{d[p]['depth']} | {tuple(d[p].get('blocks', ()))} |")
        lines += ["", f"depth ratio auto / none: **{d['ratio_auto_over_none']:.2f}x** "
                      f"(paper: >= {PAPER_DEPTH_CLAIM}x); "
                      f"liveness / none: {d['ratio_liveness_over_none']:.2f}x; auto / liveness: "
                      f"{d['auto']['depth'] / max(1, d['liveness']['depth']):.2f}x (against a baseline that already "
                      f"frees dead tensors, as the frameworks the paper compares with partly do)",
                  f"ResNet-2500 (blocks (6, 32, 788, 6)) under auto: "
                  f"{'plans within 12 GB' if d['resnet2500']['fits'] else 'DOES NOT FIT'}"
                  + (f", smallest arena {format_bytes(d['resnet2500']['min_budget_bytes'])}, "
                     f"plan '{d['resnet2500']['chosen']}', planned in {d['resnet2500']['planning_s']:.0f} s"
                     if d['resnet2500']['fits'] else ""), ""]
    b = res.get("batch")
    pk = res.get("packs_batch") or {}
    if b:
        lines += ["| model | largest batch, none | largest batch, auto | auto / none | packs (M, packs) "
                  "| SuperNeurons | best / SuperNeurons |", "|---|---:|---:|---:|---:|---:|---:|"]
        for m, r in b.items():
            p = pk.get(m)
            best = max(r["auto"], p["packs"] if p else 0)
            paper = SUPERNEURONS_TABLE5.get(m)
            lines.append(f"| {m} | {r['none']} | {r['auto']} | {r['ratio']:.1f}x | "
                         + (f"{'>= ' if p.get('capped') else ''}{p['packs']} ({p.get('micro_batches')}, "
                            f"{p.get('n_packs')})" if p else "-")
                         + f" | {paper or '-'} | " + (f"{best / paper:.2f}x" if paper else "-") + " |")
        lines.append("")
    c = res.get("cpu_run")
    if c:
        a, n = c["auto"], c["none"]
        lines += [f"Real CPU run: ResNet-50, 112 px, batch 32, {c['steps']} timed steps (after {c.get('warmup', 0)} "
                  f"warm-up), auto at its minimum budget {format_bytes(c['min_budget_bytes'])}, alternating step by "
                  f"step with none:", "",
                  "| policy | plan peak | measured peak | equal | median step | recompute FLOPs | offloaded/step |",
                  "|---|---:|---:|---|---:|---:|---:|"]
        for p, r in (("none", n), ("auto", a)):
            lines.append(f"| {p} | {format_bytes(r['plan_peak_bytes'])} | {format_bytes(r['measured_peak_bytes'])} | "
                         f"{r['plan_peak_bytes'] == r['measured_peak_bytes']} | {r['median_step_s']:.2f} s | "
                         f"{r['recompute_flops_share']:.2%} | {format_bytes(r['offloaded_bytes'])} |")
        lines += ["", "step time auto / none (median of per-pair ratios): "
                      f"**{c['step_time_ratio_auto_over_none']:.2f}x** with "
                      f"{c['memory_ratio_none_over_auto']:.1f}x less memory; parameters bit-identical: "
                      f"{c['bit_identical']}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("depth", "batch", "packs", "cpu-run"), default=None)
    ap.add_argument("--packs-models", nargs="*", default=["vgg16"],
                    help="models whose largest batch is also searched under policy packs (Harmony)")
    ap.add_argument("--packs-cap", type=int, default=1024,
                    help="stop the packs batch search here (micro-batching makes almost any batch fit)")
    ap.add_argument("--skip-cpu-run", action="store_true")
    ap.add_argument("--models", nargs="*", default=BATCH_MODELS)
    ap.add_argument("--cpu-steps", type=int, default=3)
    ap.add_argument("--device", default="k40c")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        if not args.quiet:
            print(msg, flush=True)

    res = {"date": str(datetime.date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}
    prev = out / "superneurons.json"
    if args.only and prev.exists():
        res.update({k: v for k, v in json.loads(prev.read_text()).items()
                    if k in ("depth", "batch", "packs_batch", "cpu_run")})
    if args.only in (None, "depth"):
        log("depth search (ResNet, batch 16, 12 GB)")
        res["depth"] = depth_search(args.device, log)
    if args.only in (None, "batch"):
        log("batch search (12 GB)")
        res["batch"] = batch_search(args.device, args.models, log)
    if args.only in (None, "packs"):
        log("batch search under policy packs (12 GB)")
        res["packs_batch"] = packs_batch_search(args.device, args.packs_models, log, args.packs_cap)
    if args.only == "cpu-run" or (args.only is None and not args.skip_cpu_run):
        log("CPU run: ResNet-50, 112 px, batch 32")
        res["cpu_run"] = cpu_run(args.cpu_steps, log)
    (out / "superneurons.json").write_text(json.dumps(res, indent=1))
    chart(res.get("depth"), res.get("batch"), out / "superneurons.png")
    text = markdown(res)
    (out / "superneurons.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
