"""How long README command 1 takes on this machine: its training run (the part after `pip install . &&`) once
with an empty kernel cache (numba compiles the CPU kernels and caches them) and then cached, with the machine it
ran on (CPU model, cores, load average before each run, BLAS kernel) and the date.

    python benchmarks/first_command.py [--warm-runs 2]

Writes benchmarks/results/first_command.json, from which README's sentence on the first run's times is generated
(docs/make_readme.py): the README never types a time that this file does not hold.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "first_command.json"


def readme_command_1() -> str:
    """README command 1's training part: the first bash block's line, after `pip install . &&`."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[1]
    return block.strip().split("&&", 1)[1].strip()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_kernel() -> str:
    import numpy  # noqa: F401 - threadpoolctl lists the libraries already loaded
    from threadpoolctl import threadpool_info

    for lib in threadpool_info():
        if lib.get("user_api") == "blas":
            return f"{lib.get('internal_api', 'BLAS')} {lib.get('version') or ''}, {lib.get('architecture')} kernel"
    return "BLAS unknown"


def timed_run(command: str, cache: str) -> dict:
    env = dict(os.environ, MINIDL_CACHE_DIR=cache, MPLBACKEND="Agg")
    env.pop("NUMBA_CACHE_DIR", None)
    argv = [sys.executable, "-m", "minidl.cli", *shlex.split(command)[1:], "--json"]
    load = os.getloadavg()[0]
    t = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{command} failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {"wall_s": round(wall, 2), "load_average_before": round(load, 2), "accuracy": out["accuracy"],
            "final_loss": out["final_loss"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm-runs", type=int, default=2)
    a = ap.parse_args(argv)
    command = readme_command_1()
    with tempfile.TemporaryDirectory() as cache:
        cold = timed_run(command, cache)
        warm = [timed_run(command, cache) for _ in range(a.warm_runs)]
    result = {"command": command, "date": datetime.date.today().isoformat(),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "blas": blas_kernel(),
                          "python": platform.python_version()},
              "cold": cold, "warm": warm}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
