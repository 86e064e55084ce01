"""Every plan of the zoo's small networks, under every policy, is the one recorded in plan_digests.json, event for
event (`tests/memory/plan_digests.py` says what is planned and writes the file)."""
import json

import pytest

from tests.memory import plan_digests as d

RECORDED = json.loads(d.PATH.read_text())
FAST = ("lenet", "resnet20", "densenet_tiny", "gpt2_tiny")


def _check(net_key):
    got = d.all_digests([net_key])
    want = {k: v for k, v in RECORDED.items() if k.startswith(f"{net_key}/")}
    assert got.keys() == want.keys()
    assert [k for k in got if got[k] != want[k]] == []


@pytest.mark.parametrize("net_key", FAST)
def test_plans_are_the_recorded_ones(net_key):
    _check(net_key)


@pytest.mark.slow
@pytest.mark.parametrize("net_key", [k for k in d.NETS if k not in FAST])
def test_deep_plans_are_the_recorded_ones(net_key):
    _check(net_key)


@pytest.mark.parametrize("argv", d.CLI)
def test_plan_command_is_the_recorded_one(argv):
    assert d.cli_digest(argv) == RECORDED[f"cli/{argv}"]
