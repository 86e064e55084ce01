"""Generate the figures of docs/policies/: for every policy of `minidl/memory/policies.py`, its row of the table
(what it does, when to pick it, its paper) and the `--explain` of one small example, run here with the command the
page shows; for the policies the memory tables measure, their column of `benchmarks/results/memory_table.json`.
The prose of each page is written by hand around these regions.

    python docs/make_policies.py [--check]

The example is ResNet-20 shaped for the 8x8 digits (the network of README command 1 and of docs/tour.md), planned
for the simulator's `cpu` profile; `--explain NAME` keeps the steps and events of one tensor. Plans are exact and
deterministic (shapes only), so the output is the same on every machine, except the planning time, which is
left out.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generated import ROOT, fill, main, table  # noqa: E402

SCRIPT = "docs/make_policies.py"
DIR = ROOT / "docs" / "policies"
NET = "resnet --depth 20 --batch 32 --image-size 8 --in-channels 1 --num-classes 10 --device cpu"
EXAMPLES = {  # policy -> (budget or None, the tensor or layer whose story --explain keeps)
    "none": (None, "act:layer1.0.conv1"),
    "liveness": (None, "act:layer1.0.conv1"),
    "offload": ("5MiB", "act:layer1.0.conv1"),
    "recompute": (None, "act:layer1.0.relu1"),
    "weights": ("5MiB", "param:layer3.2.conv2.weight"),
    "compress": (None, "act:layer1.0.conv1"),
    "packs": ("4MiB", "param:layer3.2.conv2.weight"),
    "auto": ("4MiB", "act:layer1.0.conv1"),
    "auto-lossy": ("4MiB", "act:layer1.0.conv1"),
    "window": ("4MiB", "act:layer1.0.conv1"),
}
MEMORY_TABLE_COLUMN = {"none": "none", "liveness": "liveness", "recompute": "recompute", "auto": "auto_min",
                       "window": "window_min"}


def command(policy: str) -> str:
    budget, follow = EXAMPLES[policy]
    return f"minidl plan {NET} --policy {policy}" + (f" --budget {budget}" if budget else "") + \
        f" --explain {follow}"


def run(cmd: str) -> str:
    """The text `cmd` prints, run in this process, without the planning time (the one figure that varies)."""
    from minidl.cli import main as cli_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = cli_main(shlex.split(cmd)[1:])
    if rc != 0:
        raise SystemExit(f"{cmd} failed ({rc}):\n{out.getvalue()[-2000:]}")
    return re.sub(r"planned in [\d.]+ s; ", "", out.getvalue())


def summary(policy: str) -> str:
    from minidl.memory.policies import POLICIES

    p = POLICIES[policy]
    rows = [["what the plan does", p.help], ["pick it when", p.when], ["from", p.paper],
            ["results", "not bit-identical to `none` (lossy, opt-in)" if p.lossy
             else "parameters bit-identical to `none` on the CPU"]]
    return table(["", f"`{policy}`"], rows)


def example(policy: str) -> str:
    cmd = command(policy)
    return f"```bash\n{cmd}\n```\n\nprints\n\n```text\n{run(cmd).rstrip()}\n```\n"


def _size(n: int) -> str:
    from minidl.memory.pool import format_bytes

    return format_bytes(n)


def _memory_table():
    """benchmarks/memory_table.py, loaded from its file (the benchmarks folder is not put on sys.path: its modules'
    names, such as `compression`, would shadow others)."""
    spec = importlib.util.spec_from_file_location("memory_table", ROOT / "benchmarks" / "memory_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def memory_column(policy: str) -> str:
    label = _memory_table().label  # the table's own model cell (a sequence model names its tokens)
    key = MEMORY_TABLE_COLUMN[policy]
    rows = json.loads((ROOT / "benchmarks" / "results" / "memory_table.json").read_text())
    what = "smallest budget it plans in" if key.endswith("_min") else "peak"
    body = table(["model", "batch", f"`{policy}`: {what}", "`none`: peak"],
                 [[label(r), r["batch"], _size(r[key]), _size(r["none"])] for r in rows], "lrrr")
    return ("From `benchmarks/results/memory_table.json` (`python benchmarks/memory_table.py`: image models at their "
            "image size, sequence models at the tokens shown, SGD with momentum, float32; planned, exact "
            "bytes):\n\n" + body)


def pages() -> dict[Path, str]:
    from make_readme import policy_table

    from minidl.memory.policies import POLICIES

    index = DIR / "index.md"
    out = {index: fill(index.read_text(), SCRIPT, {"table": policy_table(link_prefix="")}, "docs/policies/index.md")}
    for name in POLICIES:
        path = DIR / f"{name}.md"
        regions = {"summary": summary(name), "example": example(name)}
        if name in MEMORY_TABLE_COLUMN:
            regions["memory-table"] = memory_column(name)
        out[path] = fill(path.read_text(), SCRIPT, regions, str(path.relative_to(ROOT)))
    return out


if __name__ == "__main__":
    main(SCRIPT, pages)
