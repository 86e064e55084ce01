"""How long the test suite takes on this machine: `python -m pytest -q` (the suite CI runs on every change,
the slow tests deselected by pyproject's addopts; `--all` adds them), with its counts, the machine (CPU model, the
cores this process may use, load average before and after) and the date.

    python benchmarks/suite_time.py [--all]

Writes benchmarks/results/suite_time.json, from which README's sentence on the suite's time is generated
(docs/make_readme.py: suite-time). The suite must stay under `BUDGET_S` on two cores; a slow test gets the `slow`
marker.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from first_command import cpu_model  # benchmarks/, this script's folder, is on sys.path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "suite_time.json"
BUDGET_S = 15 * 60  # the not-slow suite's limit on two cores (the project's rule)


def counts(summary: str) -> dict[str, int]:
    """pytest's last line ("1234 passed, 56 skipped, 7 deselected in 600.00s") as {"passed": 1234, ...}."""
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)",
                                             summary)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="the whole suite, slow tests included")
    a = ap.parse_args(argv)
    selection = ["-m", "slow or not slow"] if a.all else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection]
    load = os.getloadavg()[0]
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if not counts(last):
        raise SystemExit(f"the suite did not finish ({last}):\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}")
    result = json.loads(OUT.read_text()) if OUT.exists() else {}
    result["all" if a.all else "not_slow"] = {
        "command": "python -m pytest -q" + (' -m "slow or not slow"' if a.all else ""), "wall_s": round(wall, 1),
        "counts": counts(last), "date": datetime.date.today().isoformat(),
        "machine": {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "python": platform.python_version()},
        "load_average_before": round(load, 2), "load_average_after": round(os.getloadavg()[0], 2)}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    if r.returncode != 0:   # recorded all the same (the README says how many failed), and said here
        raise SystemExit(f"the suite failed ({last}):\n{r.stdout[-6000:]}")


if __name__ == "__main__":
    main()
