"""The minimum a BudgetError states is a budget at which that policy plans (`schedulers/minimum.py`)."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minidl as dl
from minidl.errors import BudgetError
from minidl.layers import BatchNorm2d, Conv2d, Flatten, Linear, ReLU, SoftmaxCrossEntropy
from minidl.memory.policies import plan_network
from minidl.memory.schedulers import minimum
from minidl.optim import make_optimizer

from .nets import NETS


def _plain(batch: int, widths: list[int], size: int, bn: bool) -> dl.Network:
    net = dl.Network("plain")
    x = net.input((batch, 3, size, size), name="data")
    y = net.input((batch,), dtype="int64", name="label")
    h = x
    for i, c in enumerate(widths):
        h = Conv2d(c, 3, padding=1, name=f"conv{i}")(h)
        if bn:
            h = BatchNorm2d(name=f"bn{i}")(h)
        h = ReLU(name=f"relu{i}")(h)
    net.set_loss(SoftmaxCrossEntropy(name="loss")(Linear(4, name="fc")(Flatten(name="flat")(h)), y))
    return net


def _stated_minimum_plans(net, policy: str, budget: int, device: str) -> None:
    opt = make_optimizer("sgd", 0.01)
    try:
        plan_network(net, opt, policy, budget, device=device)
        return
    except BudgetError as e:
        stated = e.min_budget_bytes
        assert stated is not None and stated > budget
        assert f"{stated:,} B" in str(e)
    plan = plan_network(net, opt, policy, stated, device=device)   # must not raise
    assert plan.min_budget_bytes <= stated


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 4), widths=st.lists(st.integers(2, 12), min_size=2, max_size=5),
       size=st.sampled_from([6, 8, 12]), bn=st.booleans(),
       policy=st.sampled_from(["liveness", "recompute", "offload", "auto"]),
       share=st.floats(0.3, 0.95), device=st.sampled_from(["cpu", "k40c"]))
def test_stated_minimum_plans_on_random_nets(batch, widths, size, bn, policy, share, device):
    net = _plain(batch, widths, size, bn)
    live = plan_network(net, make_optimizer("sgd", 0.01), "liveness")
    _stated_minimum_plans(net, policy, int(live.min_budget_bytes * share), device)


@pytest.mark.parametrize("key", ["resnet20", "densenet_tiny"])
@pytest.mark.parametrize("policy", ["offload", "auto"])
def test_stated_minimum_plans_on_zoo_nets(key, policy):
    net = NETS[key]()
    live = plan_network(net, make_optimizer("sgd", 0.01), "liveness")
    for share in (0.3, 0.6):
        _stated_minimum_plans(net, policy, int(live.min_budget_bytes * share), "cpu")


def test_verification_replaces_a_minimum_that_does_not_plan():
    """A policy whose first answer is wrong (plans only from 1,000,000 B on, but says 900,000 B): the stated
    number is raised until it plans, then bisected down."""
    calls = []

    def plan_at(b):
        calls.append(b)
        if b < 1_000_000:
            raise BudgetError(f"too small: the smallest budget that works is {b + 100_000:,}", b + 100_000)
        return object()

    err = BudgetError("budget too small: the smallest budget that works is 878.91 KiB (900,000 B), bound at x",
                      900_000, "x")
    out = minimum.verified_minimum(plan_at, "auto", 500_000, err)
    assert 1_000_000 <= out.min_budget_bytes <= 1_000_000 * (1 + minimum.RESOLUTION) + 512
    assert f"({out.min_budget_bytes:,} B)" in str(out) and "verified" in str(out)
    plan_at(out.min_budget_bytes)
    assert len(calls) <= 2 + minimum.VERIFY_ROUNDS + minimum.SEARCH_PROBES


def test_stated_minimum_is_searched_down():
    """A policy whose first answer is too cautious (says 900,000 B, plans from 800,000 B on): the stated minimum
    is bisected down towards the failing budget and still plans."""
    def plan_at(b):
        if b < 800_000:
            raise BudgetError(f"too small: the smallest budget that works is {900_000:,}", 900_000)
        return object()

    err = BudgetError("budget too small: the smallest budget that works is 878.91 KiB (900,000 B), bound at x",
                      900_000, "x")
    out = minimum.verified_minimum(plan_at, "offload", 500_000, err)
    assert 800_000 <= out.min_budget_bytes < 900_000 and "bisection" in str(out)
    plan_at(out.min_budget_bytes)
    # exact policies are not searched
    assert minimum.verified_minimum(plan_at, "none", 500_000, err) is err
