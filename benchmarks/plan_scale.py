"""Harmony's transformers planned at Harmony's scale: GPT2-XL (1,024 tokens) and BERT-96 (512 tokens) at its
minibatch of 64, under policy `auto`, on an 11 GiB and a 12 GB device profile.

    python benchmarks/plan_scale.py                     # the four cases; writes results/plan_scale.{json,md}
    python benchmarks/plan_scale.py --resolution 256MiB # a coarser search for the smallest budget (fewer plannings)

Per case:
- **at the profile**: the plan `minidl plan MODEL --budget USABLE --device D` makes (`search.plan_on_device`: the same
  entry point, route and workspaces as the command line, the budget the memory the profile leaves once its CUDA
  context is loaded), how long planning took, which plan `auto` chose (its decision) and its micro-batch count;
- **the smallest budget**: `auto`'s fit check bisected over the budget below the profile's (`search.largest`, the
  bisection the reproductions use for the largest batch, here over how many `--resolution` steps below the profile
  the budget can go), to within one step. `auto` makes other choices under other budgets, so whether it fits need
  not be monotone in the budget: the figure is the edge the bisection found, each probe a real planning. A search
  past `--search-limit` stops; a planning past `--probe-limit` (a few GiB split the batch into dozens of
  micro-batches, each count a longer route to place) is stopped and left undecided, the bisection going on above
  it. The row gives the smallest budget that fitted, and says whether the search was complete (every budget it
  tried below that one planned and did not fit).

The sequence lengths are those of Harmony's own scripts (GPT-2's tokenizer's 1,024-token blocks; BERT's
`SEQ_LEN=512`), the minibatch that of its Figure 10 runs (D64). Planning times are wall clock on the machine the
results file names, shared with other jobs: compare them between rows of one file, not across machines.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

from minidl.memory.decisions.weights import moved_by_role
from minidl.memory.pool import format_bytes, parse_size
from minidl.memory.simulate import get_profile, simulate
from minidl.models import build_model
from minidl.reproduce.search import largest, plan_on_device

OUT = Path(__file__).resolve().parent / "results"
BATCH = 64
MODELS = {"GPT2-XL": ("gpt2", {"size": "xl", "seq": 1024}), "BERT-96": ("bert", {"size": "96", "seq": 512})}
DEVICES = ("gtx1080ti", "titanx")   # Harmony's GTX 1080 Ti (11 GiB, 10 GiB usable as its scheduler caps it); 12 GB


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def plan_case(label: str, device: str, resolution: int, search_limit: float, probe_limit: float,
              log) -> dict:
    model, kw = MODELS[label]
    net = build_model(model, batch=BATCH, **kw)   # one network: its routes are cached across the probes
    prof = get_profile(device)
    usable = prof.usable_bytes
    t = time.perf_counter()
    plan = plan_on_device(net, "auto", device)
    planning_s = time.perf_counter() - t
    row = {"model": label, "seq": kw["seq"], "batch": BATCH, "device": device, "memory_bytes": prof.memory_bytes,
           "usable_bytes": usable, "fits": plan is not None, "planning_s": planning_s}
    log(f"{label} on {device}: {'fits' if plan is not None else 'does not fit'} {format_bytes(usable)} "
        f"({planning_s:.1f} s)")
    if plan is not None:
        row.update(decision=plan.decision, chosen=plan.decision.split(":", 1)[0],
                   micro_batches=plan.route.micro_batches, arena_bytes=plan.min_budget_bytes,
                   est_step_time_s=simulate(plan, device).est_step_time_s,
                   moved_bytes=sum(moved_by_role(plan).values()))
    probes: list[dict] = []
    t_search = time.perf_counter()

    def ok(n: int) -> bool:
        budget = usable - n * resolution
        if n == 0:
            return plan is not None     # planned above
        if budget <= 0:
            return False
        if time.perf_counter() - t_search > search_limit:
            raise SearchStopped
        t0 = time.perf_counter()
        signal.signal(signal.SIGALRM, _probe_timeout)
        signal.alarm(int(probe_limit))
        try:
            fit = plan_on_device(net, "auto", device, budget) is not None
        except SearchStopped:   # undecided: searched below as if it did not fit, never reported as either
            probes.append({"budget_bytes": budget, "fits": None, "s": time.perf_counter() - t0})
            log(f"    {format_bytes(budget)}: undecided, stopped after {probes[-1]['s']:.0f} s")
            return False
        finally:
            signal.alarm(0)
        probes.append({"budget_bytes": budget, "fits": fit, "s": time.perf_counter() - t0})
        log(f"    {format_bytes(budget)}: {'fits' if fit else 'no'} ({probes[-1]['s']:.1f} s)")
        return fit

    complete = True
    try:
        # first guess: the arena the profile's plan needs (a budget that small often fits too)
        if plan is not None:
            largest(ok, max(1, (usable - plan.min_budget_bytes) // resolution), lo=0)
    except SearchStopped:
        complete = False
    fitting = [p["budget_bytes"] for p in probes if p["fits"]] + ([usable] if plan is not None else [])
    failing = [p["budget_bytes"] for p in probes if p["fits"] is False and p["budget_bytes"] < min(fitting)] \
        if fitting else []
    undecided = [p["budget_bytes"] for p in probes if p["fits"] is None and p["budget_bytes"] < min(fitting)] \
        if fitting else []
    row.update(smallest_budget_bytes=min(fitting) if fitting else None,
               largest_failing_below_bytes=max(failing) if failing else None,
               undecided_below_bytes=sorted(undecided), search_complete=complete and not undecided,
               resolution_bytes=resolution, search_s=time.perf_counter() - t_search, probes=probes)
    return row


class SearchStopped(Exception):
    """The smallest-budget search ran past `--search-limit`, or one planning past `--probe-limit`."""


def _probe_timeout(signum, frame):
    raise SearchStopped


def markdown(res: dict) -> str:
    lines = [f"`auto` at Harmony's minibatch ({res['batch']}) on {res['date']}, {res['machine']} "
             f"(`python benchmarks/plan_scale.py`)", "",
             "| model (tokens) | profile (usable) | fits | planning | plan chosen | micro-batches "
             "| smallest budget (search) |",
             "|---|---|---|---:|---|---:|---:|"]
    for r in res["cases"]:
        small = (f"{format_bytes(r['smallest_budget_bytes'])} ({r['search_s']:.0f} s, {len(r['probes'])} plannings"
                 + ("" if r["search_complete"] else ", incomplete") + ")"
                 if r["smallest_budget_bytes"] is not None else "-")
        lines.append(f"| {r['model']} ({r['seq']}) | {r['device']} ({format_bytes(r['usable_bytes'])}) | "
                     f"{'yes' if r['fits'] else 'no'} | {r['planning_s']:.1f} s | {r.get('chosen', '-')} | "
                     f"{r.get('micro_batches', '-')} | {small} |")
    lines += ["", f"Smallest budget: bisected to within {format_bytes(res['resolution_bytes'])} below the profile's "
                  "usable memory, each probe a planning (`auto` is not strictly monotone in the budget); incomplete: "
                  "a planning below it was stopped undecided, or the search was."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--resolution", default="64MiB", help="step of the smallest-budget search (default 64MiB)")
    ap.add_argument("--search-limit", type=float, default=1200.0,
                    help="seconds the smallest-budget search may take per case; past them it stops and the row says "
                         "so (default 1200)")
    ap.add_argument("--probe-limit", type=float, default=300.0,
                    help="seconds one planning of the search may take; past them the search stops there (default 300)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--devices", default=",".join(DEVICES), help="comma-separated device profiles")
    ap.add_argument("--out", default=str(OUT), help="directory for plan_scale.json and plan_scale.md")
    args = ap.parse_args(argv)
    resolution = parse_size(args.resolution)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    cases = [plan_case(m, d, resolution, args.search_limit, args.probe_limit, log)
             for m in args.models.split(",") for d in args.devices.split(",")]
    res = {"date": str(datetime.date.today()), "machine": machine(), "batch": BATCH, "resolution_bytes": resolution,
           "command": "python benchmarks/plan_scale.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "cases": cases}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_scale.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "plan_scale.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
