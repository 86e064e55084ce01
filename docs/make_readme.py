"""Generate README.md's figures and tables (its prose is written by hand):

- `policies`: the table of every memory policy, from `minidl/memory/policies.py` (the table `--help` prints too);
- `first-run`: how long README command 1 took, from `benchmarks/results/first_command.json`
  (`python benchmarks/first_command.py` measures it on your machine);
- `plan-scale`: GPT2-XL and BERT-96 planned under `auto` at Harmony's minibatch, from
  `benchmarks/results/plan_scale.json` (`python benchmarks/plan_scale.py`);
- `suite-time`: how long the test suite took, from `benchmarks/results/suite_time.json`
  (`python benchmarks/suite_time.py`).

    python docs/make_readme.py [--check]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generated import ROOT, fill, main, table  # noqa: E402

SCRIPT = "docs/make_readme.py"
README = ROOT / "README.md"
FIRST_COMMAND = ROOT / "benchmarks" / "results" / "first_command.json"
PLAN_SCALE = ROOT / "benchmarks" / "results" / "plan_scale.json"
SUITE_TIME = ROOT / "benchmarks" / "results" / "suite_time.json"


def policy_table(link_prefix: str = "docs/policies/") -> str:
    from minidl.memory.policies import POLICIES

    rows = []
    for name, p in POLICIES.items():
        rows.append([f"[`{name}`]({link_prefix}{name}.md)", p.help, p.when, p.paper])
    return table(["policy", "what the plan does", "pick it when", "from"], rows)


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


# What each recorded kernel needs: the names OpenBLAS reports, with the instruction set a reader can look up.
KERNEL_ISA = {"Haswell": "AVX2", "SkylakeX": "AVX-512", "Sandybridge": "AVX"}


def kernel_figures() -> str:
    """README command 1's held-out accuracy and final loss under each recorded OpenBLAS kernel."""
    f = json.loads(FIRST_COMMAND.read_text())["figures"]
    rows = [[f"{k} ({KERNEL_ISA.get(k, '?')})", f"{100 * r['accuracy']:.2f}%", f"{r['final_loss']:.4f}"]
            for k, r in f["by_kernel"].items()]
    return table(["OpenBLAS kernel", "held-out accuracy", "final loss"], rows, "lrr")


def first_run() -> str:
    r = json.loads(FIRST_COMMAND.read_text())
    m, cold, warm = r["machine"], r["cold"], r["warm"]
    loads = [cold["load_average_before"]] + [w["load_average_before"] for w in warm]
    warm_s = sorted(w["wall_s"] for w in warm)
    warm_text = _seconds(warm_s[0]) if len(warm_s) == 1 or _seconds(warm_s[0]) == _seconds(warm_s[-1]) \
        else f"{_seconds(warm_s[0])[:-2]} to {_seconds(warm_s[-1])}"
    kernel = m["blas"].split(", ")[-1]
    return (
        "What depends on your CPU: the time, and the loss and accuracy (numpy's BLAS picks a kernel for your CPU,\n"
        "and the kernel changes how float32 sums round, which 150 steps carry on); the memory figures do not. The\n"
        "first run also compiles minidl's CPU kernels with numba and caches them, so it is slower than the next ones.\n"
        f"Measured on {r['date']}, {m['cpu']}, {m['cores']} cores shared with other jobs (load average "
        f"{min(loads):.1f} to {max(loads):.1f}), OpenBLAS's\n"
        f"{kernel}: the training took {_seconds(cold['wall_s'])} the first time and {warm_text} cached\n"
        "(`pip install .` not counted). What it reaches, by kernel (the test suite runs the command again and "
        "requires\nthe row of the kernel it finds; `python benchmarks/first_command.py` measures your machine):\n\n"
        + kernel_figures())


def suite_time() -> str:
    if not SUITE_TIME.exists():
        return "No run of the suite is timed yet: `python benchmarks/suite_time.py` measures it.\n"
    r = json.loads(SUITE_TIME.read_text())
    lines = []
    for key in ("not_slow", "all"):
        if key not in r:
            continue
        t, m = r[key], r[key]["machine"]
        n = t["counts"]
        shared = ": shared with other jobs" if t["load_average_before"] > 1.5 else ""   # 2 cores: over 1.5, others ran
        lines.append(f"`{t['command']}` took {t['wall_s'] / 60:.0f} min on {m['cores']} cores ({m['cpu']}, "
                     f"{t['date']}, load average {t['load_average_before']:.1f} before and\n"
                     f"{t['load_average_after']:.1f} after{shared}), "
                     f"{n.get('passed', 0):,} tests "
                     f"passed, {n.get('skipped', 0)} skipped"
                     + (f", {n['failed']} FAILED" if n.get("failed") else "")
                     + (f", the {n['deselected']} slow ones deselected" if n.get("deselected") else "") + ".")
    return ("\n".join(lines) + "\n`python benchmarks/suite_time.py` measures it (`--all`: the slow tests too).\n")


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_scale() -> str:
    r = json.loads(PLAN_SCALE.read_text())
    rows, partial = [], False
    for c in r["cases"]:
        small = "-"
        if c["smallest_budget_bytes"] is not None:
            small = _gb(c["smallest_budget_bytes"]) + ("" if c["search_complete"] else " *")
            partial |= not c["search_complete"]
        chosen = c.get("chosen", "-").split(f", {c.get('micro_batches')} micro-batches")[0]
        rows.append([f"{c['model']} ({c['seq']} tokens)", f"`{c['device']}` ({_gb(c['usable_bytes'])})",
                     f"{c['planning_s']:.0f} s" if c["fits"] else f"does not fit ({c['planning_s']:.0f} s)",
                     chosen, str(c.get("micro_batches", "-")), small])
    note = ("\n\\* the smallest budget that fitted: a planning below it ran past the search's time limit and was "
            "stopped\nundecided, so the edge may be lower.\n") if partial else ""
    return (f"Harmony's transformers at its minibatch of {r['batch']}, planned by `auto` on two device profiles\n"
            f"(`python benchmarks/plan_scale.py`, {r['date']}, {r['machine']}, shared;\nthe smallest budget "
            f"is bisected to {r['resolution_bytes'] >> 20} MiB, each probe a planning):\n\n"
            + table(["model", "profile (usable)", "planning", "plan chosen", "micro-batches", "smallest budget"],
                    rows, "llrlrr") + note)


def pages() -> dict[Path, str]:
    text = fill(README.read_text(), SCRIPT, {"policies": policy_table(), "first-run": first_run(),
                                             "plan-scale": plan_scale(), "suite-time": suite_time()}, "README.md")
    return {README: text}


if __name__ == "__main__":
    main(SCRIPT, pages)
