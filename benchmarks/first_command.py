"""README command 1 on this machine: how long its training run takes (the part after `pip install . &&`), once
with an empty kernel cache (numba compiles the CPU kernels and caches them) and then cached, with the machine it
ran on (CPU model, cores, load average before each run, BLAS kernel) and the date; and the held-out accuracy and
final loss it reaches under each OpenBLAS kernel in `KERNELS` this CPU can run (OPENBLAS_CORETYPE forces one).

    python benchmarks/first_command.py [--warm-runs 2]      # times and figures
    python benchmarks/first_command.py --figures-only       # the figures alone (after a change that moves them)

Writes benchmarks/results/first_command.json, from which README's sentence on the first run's times and its
table of figures by kernel are generated (docs/make_readme.py): the README never types a figure that this file
does not hold. tests/docs/test_readme_figures.py runs the command again under the kernel the suite finds and
requires that kernel's row, exactly.
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
# The kernels whose figures are recorded: those of the CI machines (AMD EPYC with AVX2: Haswell, with AVX-512 and
# Xeons: SkylakeX) and the second kernel of the bit tests (Sandybridge, AVX), by the names OpenBLAS reports.
KERNELS = ("Haswell", "SkylakeX", "Sandybridge")


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


def numpy_version() -> str:
    import numpy

    return numpy.__version__


def blas_kernel() -> str:
    import numpy  # noqa: F401 - threadpoolctl lists the libraries already loaded
    from threadpoolctl import threadpool_info

    for lib in threadpool_info():
        if lib.get("user_api") == "blas":
            return f"{lib.get('internal_api', 'BLAS')} {lib.get('version') or ''}, {lib.get('architecture')} kernel"
    return "BLAS unknown"


def command_env(kernel: str | None = None, cache: str | None = None) -> dict:
    """The environment README command 1 runs in: this one, with the kernel forced when `kernel` is given, the
    kernels cached in `cache` when given, and no variable that changes how minidl computes."""
    env = {k: v for k, v in os.environ.items() if k not in ("MINIDL_CPU_WINOGRAD", "MINIDL_CPU_THREADS")}
    env["MPLBACKEND"] = "Agg"
    if kernel is not None:
        env["OPENBLAS_CORETYPE"] = kernel
    if cache is not None:
        env["MINIDL_CACHE_DIR"] = cache
        env.pop("NUMBA_CACHE_DIR", None)
    return env


def run_command(command: str, env: dict) -> dict:
    """README command 1's training run in a new process: its --json output."""
    argv = [sys.executable, "-m", "minidl.cli", *shlex.split(command)[1:], "--json"]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{command} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def kernel_in(env: dict) -> str | None:
    """The OpenBLAS kernel numpy runs in a process with `env` (threadpoolctl's `architecture`)."""
    code = ("import json, numpy; from threadpoolctl import threadpool_info; print(json.dumps([l.get('architecture') "
            "for l in threadpool_info() if l.get('internal_api') == 'openblas']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    found = json.loads(r.stdout)
    return found[0] if found else None


def timed_run(command: str, cache: str) -> dict:
    load = os.getloadavg()[0]
    t = time.perf_counter()
    run_command(command, command_env(cache=cache))
    return {"wall_s": round(time.perf_counter() - t, 2), "load_average_before": round(load, 2)}


def figures(command: str) -> dict:
    """Held-out accuracy and final loss under each kernel of `KERNELS` this CPU runs, by the name OpenBLAS
    reports (a kernel that does not take effect, or that this CPU cannot run, is left out and said so)."""
    rows = {}
    for name in KERNELS:
        env = command_env(name)
        got = kernel_in(env)
        if got is None or got.lower() != name.lower():
            print(f"OPENBLAS_CORETYPE={name}: OpenBLAS runs {got!r}; no row for {name}", file=sys.stderr)
            continue
        out = run_command(command, env)
        rows[got] = {"accuracy": out["accuracy"], "final_loss": out["final_loss"]}
        print(f"{got}: held-out accuracy {out['accuracy']:.4%}, final loss {out['final_loss']:.4f}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm-runs", type=int, default=2)
    ap.add_argument("--figures-only", action="store_true",
                    help="record the figures by kernel, keep the recorded times")
    a = ap.parse_args(argv)
    command = readme_command_1()
    result = json.loads(OUT.read_text()) if a.figures_only else {}
    if not a.figures_only:
        with tempfile.TemporaryDirectory() as cache:
            cold = timed_run(command, cache)
            warm = [timed_run(command, cache) for _ in range(a.warm_runs)]
        result = {"command": command, "date": datetime.date.today().isoformat(),
                  "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "blas": blas_kernel(),
                              "python": platform.python_version()},
                  "cold": cold, "warm": warm}
    result["figures"] = {"command": command, "date": datetime.date.today().isoformat(),
                         "numpy": numpy_version(), "by_kernel": figures(command)}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
