"""Mutation testing of the files whose bugs are silent: how many planted bugs (mutants) the tests catch.

    pip install -e ".[test,mutation]"
    nice -n 19 python benchmarks/mutation.py                       # every file [tool.mutmut] mutates
    nice -n 19 python benchmarks/mutation.py minidl/core/guards.py ...  # only these files (a sample; said so below)

mutmut (configured in pyproject.toml, `[tool.mutmut]`) copies the package into mutants/, makes every small
change it knows to the mutated files (a `<` for a `<=`, a constant off by one, a dropped argument, ...) and runs,
for each mutant, the tests of the focused selection that call the mutated function, fastest first, stopping at
the first failure. A mutant is *killed* when a test fails, *survives* when they all pass (a bug the suite cannot
see), *timeout* when the tests ran far past their time without it, *no tests* when no selected test calls the
function at all. Kill rate = killed / all mutants of the file; timeouts are listed apart, not counted as killed.

Not part of CI (an hour or more on two cores). The figures are written, never typed, to
results/mutation.json and results/mutation.md: date, machine, the files covered, the counts per file and overall,
the wall time, and every surviving mutant's name (`mutmut show NAME` in this directory prints its diff).
mutants/ keeps mutmut's cache: a second run re-tests only what changed; `--fresh` starts over.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "results" / "mutation"
STATUSES = ("killed", "survived", "timeout", "suspicious", "no tests", "segfault", "skipped", "not checked")


def mutmut_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]


def mutated_files(cfg: dict) -> list[str]:
    """The .py files [tool.mutmut] mutates (its source_paths filtered by only_mutate), as mutmut walks them."""
    files = []
    for src in cfg["source_paths"]:
        for path in sorted((ROOT / src).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if any(fnmatch.fnmatch(rel, p) for p in cfg.get("only_mutate", ["*"])):
                files.append(rel)
    return files


def module_pattern(rel: str) -> str:
    """mutmut names a mutant `package.module.function__mutmut_N`: the pattern of one file's mutants."""
    return rel.removesuffix(".py").replace("/", ".") + ".*"


def per_thread_call_stack() -> None:
    """Replace mutmut's call-context variable (a ContextVar, which only its dependency tracking reads) with a
    per-thread stack. mutmut 3.8.1's records lose it part-way through this suite's stats run (`LookupError:
    <ContextVar name='_mutmut_call_context'>` in the planner's pool calls, which fails the run before any mutant
    is tested). minidl has no async code, the one place where the two would differ; which tests call which
    function, what selects the tests per mutant, is recorded apart from it."""
    import threading

    from mutmut.core import MutmutCallStack

    local = threading.local()

    def get(cls):
        return getattr(local, "value", (None, 0))

    def set_(cls, value):
        token = getattr(local, "value", (None, 0))
        local.value = value
        return token

    def reset(cls, token):
        local.value = token

    MutmutCallStack.get, MutmutCallStack.set, MutmutCallStack.reset = map(classmethod, (get, set_, reset))


def run_mutmut(argv: list[str]) -> None:
    """`mutmut ARGV` in this process, with the call stack above."""
    per_thread_call_stack()
    from mutmut.__main__ import cli

    cli(argv, prog_name="mutmut")


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def read_results(files: list[str]) -> dict[str, dict]:
    """Per file: the count of each status and the surviving mutants, from mutmut's meta files in mutants/."""
    from mutmut.stats import status_by_exit_code

    per_file = {}
    for rel in files:
        meta = ROOT / "mutants" / (rel + ".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        statuses = {name: status_by_exit_code[code] for name, code in codes.items()}
        counts = Counter(statuses.values())
        total = len(statuses)
        per_file[rel] = {
            "total": total,
            **{s: counts.get(s, 0) for s in STATUSES},
            "kill_rate": round(counts.get("killed", 0) / total, 4) if total else None,
            "survivors": sorted(n for n, s in statuses.items() if s == "survived"),
        }
    return per_file


def overall(per_file: dict[str, dict]) -> dict:
    tot = {s: sum(f[s] for f in per_file.values()) for s in ("total",) + STATUSES}
    tot["kill_rate"] = round(tot["killed"] / tot["total"], 4) if tot["total"] else None
    return tot


def write_md(res: dict, path: Path) -> None:
    def pct(r):
        return "-" if r is None else f"{100 * r:.1f}%"

    cols = ("total", "killed", "survived", "timeout", "suspicious", "no tests")
    lines = [f"# Mutation testing (mutmut {res['mutmut']}): kill rate {pct(res['overall']['kill_rate'])} "
             f"({res['overall']['killed']} of {res['overall']['total']} mutants)", "",
             f"`{res['command']}` ({res['date']}; {res['machine']}; commit {res['commit'][:10]}; "
             f"{res['wall_s'] / 60:.0f} min wall). Covered: {res['covered']}.", "",
             f"Tests per mutant: those of `{' '.join(res['test_selection'])}` (with "
             f"`{' '.join(res['pytest_args'])}`) that call the mutated function. Kill rate = killed / total.", "",
             "| file | " + " | ".join(cols) + " | kill rate |", "|---|" + "---:|" * (len(cols) + 1)]
    for rel, f in res["files"].items():
        lines.append(f"| {rel} | " + " | ".join(str(f[c]) for c in cols) + f" | {pct(f['kill_rate'])} |")
    o = res["overall"]
    lines.append("| **all covered** | " + " | ".join(f"**{o[c]}**" for c in cols) + f" | **{pct(o['kill_rate'])}** |")
    lines += ["", "Surviving mutants (`mutmut show NAME` prints the change): results/mutation.json, "
              "`files.*.survivors`."]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="mutate only these files (default: every file [tool.mutmut] names)")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 2, help="mutants tested at once")
    ap.add_argument("--fresh", action="store_true", help="delete mutants/ (mutmut's cache) first")
    ap.add_argument("--out", default=str(OUT), help="writes OUT.json and OUT.md")
    ap.add_argument("--deselect", action="append", default=[], metavar="NODEID",
                    help="leave out a test that fails on the unmutated code (recorded in the results)")
    if sys.argv[1:2] == ["--mutmut"]:   # the child process main() starts below
        return run_mutmut(sys.argv[2:])
    args = ap.parse_args()

    import mutmut

    cfg = mutmut_config()
    every = mutated_files(cfg)
    files = [Path(f).as_posix() for f in args.files] or every
    unknown = sorted(set(files) - set(every))
    if unknown:
        sys.exit(f"mutation.py: {', '.join(unknown)} not among the files [tool.mutmut] mutates: {', '.join(every)}")
    if args.fresh:
        shutil.rmtree(ROOT / "mutants", ignore_errors=True)
    patterns = [] if files == every else [module_pattern(f) for f in files]
    cmd = [sys.executable, __file__, "--mutmut", "run", "--max-children", str(args.max_children), *patterns]
    env = dict(os.environ)
    if args.deselect:   # mutmut runs pytest.main() in its own processes, which reads PYTEST_ADDOPTS
        env["PYTEST_ADDOPTS"] = " ".join([env.get("PYTEST_ADDOPTS", "")] + [f"--deselect={d}" for d in args.deselect])
    t0 = time.monotonic()
    started = datetime.now(timezone.utc)
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    wall = time.monotonic() - t0
    if rc != 0:
        sys.exit(f"mutation.py: mutmut exited with status {rc}; no results written")

    per_file = read_results(files)
    shown = " ".join(["python benchmarks/mutation.py", *args.files])
    res = {
        "command": shown,
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(),
        "mutmut": mutmut.__version__,
        "covered": ("every file [tool.mutmut] mutates (" + ", ".join(files) + ")" if files == every
                    else "only " + ", ".join(files) + " (a sample of " + ", ".join(cfg["only_mutate"]) + ")"),
        "complete": files == every,
        "test_selection": cfg["pytest_add_cli_args_test_selection"],
        "pytest_args": cfg.get("pytest_add_cli_args", []) + [f"--deselect={d}" for d in args.deselect],
        "max_children": args.max_children,
        "load_average_after": round(os.getloadavg()[0], 1),
        "wall_s": round(wall, 1),
        "files": per_file,
        "overall": overall(per_file),
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    write_md(res, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
