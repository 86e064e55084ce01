"""The command line describes a run once (`PlanRequest`, `Target`): `plan` and `train` plan the same thing from the
same words, CPU settings reach the kernels as the CPU menu's fields, and building the parser loads no planner."""
import json
import os
import subprocess
import sys
from pathlib import Path

from minidl.cli import main

NET = ["resnet", "--depth", "8", "--batch", "4", "--image-size", "12", "--num-classes", "4"]


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_plan_without_a_device_plans_for_where_train_runs(capsys):
    """Without --device, `minidl plan` is for the CPU, as `minidl train` runs: the same plan, byte for byte, and
    `--budget` alone plans auto in both."""
    for extra in ([], ["--budget", "1MiB"]):
        plan = run_json(capsys, "plan", *NET, *extra)
        train = run_json(capsys, "train", *NET, "--steps", "1", *extra)
        assert plan["device"] == "cpu" and plan["device_context_bytes"] == 0
        assert plan["policy"] == train["policy"] == ("auto" if extra else "liveness")
        assert (plan["peak_bytes"], plan["min_budget_bytes"]) == (train["peak_bytes"], train["min_budget_bytes"])
        assert train["pool_peak_bytes"] == train["peak_bytes"]


def test_the_parser_loads_no_planner_runtime_or_data():
    code = ("import sys; from minidl.cli import build_parser; build_parser(); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('minidl', 'numpy')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONPATH": ""})
    loaded = out.stdout.split()
    for heavy in ("minidl.runtime", "minidl.memory.policies", "minidl.memory.planner", "minidl.graph", "minidl.data",
                  "minidl.backend.cpu", "minidl.layers", "minidl.reproduce.superneurons"):
        assert not any(m == heavy or m.startswith(heavy + ".") for m in loaded), heavy
    assert "minidl.memory.policy_table" in loaded and "minidl.reproduce.registry" in loaded


def test_the_package_names_load_when_used():
    code = ("import sys, minidl as dl; before = 'minidl.runtime.session' in sys.modules; s = dl.Session; "
            "from minidl import Network, parse_size; "
            "print(before, 'minidl.runtime.session' in sys.modules, s.__name__, parse_size('1KiB'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "Session", "1024"]
