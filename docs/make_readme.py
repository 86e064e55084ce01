"""Generate README.md's figures and tables (its prose is written by hand):

- `policies`: the table of every memory policy, from `minidl/memory/policies.py` (the table `--help` prints too);
- `first-run`: how long README command 1 took, from `benchmarks/results/first_command.json`
  (`python benchmarks/first_command.py` measures it on your machine).

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


def policy_table(link_prefix: str = "docs/policies/") -> str:
    from minidl.memory.policies import POLICIES

    rows = []
    for name, p in POLICIES.items():
        rows.append([f"[`{name}`]({link_prefix}{name}.md)", p.help, p.when, p.paper])
    return table(["policy", "what the plan does", "pick it when", "from"], rows)


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def first_run() -> str:
    r = json.loads(FIRST_COMMAND.read_text())
    m, cold, warm = r["machine"], r["cold"], r["warm"]
    loads = [cold["load_average_before"]] + [w["load_average_before"] for w in warm]
    warm_s = sorted(w["wall_s"] for w in warm)
    warm_text = _seconds(warm_s[0]) if len(warm_s) == 1 or _seconds(warm_s[0]) == _seconds(warm_s[-1]) \
        else f"{_seconds(warm_s[0])[:-2]} to {_seconds(warm_s[-1])}"
    kernel = m["blas"].split(", ")[-1]
    return (
        "What depends on your CPU: the time, and the last digits of the loss and accuracy (numpy's BLAS picks a\n"
        "kernel for your CPU, and the kernel changes how float32 sums round); the memory figures do not. The first\n"
        "run also compiles minidl's CPU kernels with numba and caches them, so it is slower than the next ones.\n"
        f"Measured on {r['date']}, {m['cpu']}, {m['cores']} cores shared with other jobs (load average "
        f"{min(loads):.1f} to {max(loads):.1f}),\n"
        f"OpenBLAS's {kernel}: the training took {_seconds(cold['wall_s'])} the first time and {warm_text} "
        f"cached (`pip install .` not counted);\n"
        f"held-out accuracy {100 * cold['accuracy']:.2f}%, final loss {cold['final_loss']:.4f}. "
        "`python benchmarks/first_command.py` measures your machine.\n")


def pages() -> dict[Path, str]:
    text = fill(README.read_text(), SCRIPT, {"policies": policy_table(), "first-run": first_run()}, "README.md")
    return {README: text}


if __name__ == "__main__":
    main(SCRIPT, pages)
