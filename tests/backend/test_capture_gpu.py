"""CUDA graphs on a real GPU (`python -m pytest -q -m gpu`; skipped, with the reason, without one).

Issue 19's correctness figures: after 5 steps, the parameters of graph replay are bit-identical to the compiled
eager loop's on the same GPU; and every exact policy (under graphs where it can be captured, else eagerly, saying
why) is bit-identical to policy `none`, within one math mode. The host tests (test_capture.py) check the same
logic against an emulated capture; this file checks cupy's and cuDNN's real one.
"""
from __future__ import annotations

import numpy as np
import pytest

import minidl as dl
from minidl.models import build_model
from tests.planning import planned

from .cuda_device import cuda_backend

pytestmark = pytest.mark.gpu


def _cuda(math="fp32"):
    return cuda_backend(math)


def _net(dropout=False):
    if not dropout:
        return build_model("resnet", depth=20, batch=8, image_size=16, in_channels=3, num_classes=10)
    from minidl.layers import Conv2d, Dropout, Linear, ReLU
    from models.common import finish, new_network

    net, x, y = new_network("drop", 8, 3, 16, 10, "float32")
    h = Dropout(0.5, name="drop")(ReLU(name="relu")(Conv2d(8, 3, padding=1, name="conv")(x)))
    return finish(net, Linear(10, name="fc")(h), y)


def _data(steps=5):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((8, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(steps)]


def _budget(policy):

    if policy in ("none", "liveness"):
        return None
    live = planned(_net(), dl.SGD(lr=0.05, momentum=0.9), "liveness").min_budget_bytes
    with pytest.raises(dl.BudgetError) as e:
        planned(_net(), dl.SGD(lr=0.05, momentum=0.9), policy, 1)
    return (live + e.value.min_budget_bytes) // 2


def _train(policy="liveness", graphs=True, math="fp32", adam=False, dropout=False):
    be = _cuda(math)
    opt = dl.Adam(lr=1e-3) if adam else dl.SGD(lr=0.05, momentum=0.9)
    sess = dl.Session(_net(dropout), opt, policy=policy, budget=_budget(policy), seed=0, backend=be,
                      config=dl.RunConfig(graphs=graphs))
    losses = []
    for k, (x, y) in enumerate(_data()):
        opt.lr *= 0.9 if k else 1.0        # a schedule: the learning rate comes from its device slot
        losses.append(sess.executor.train_step(x, y))
    return sess, losses, {k: v.copy() for k, v in sess.executor.state_dict().items()}


@pytest.mark.parametrize("math", ["fp32", "tf32"])
@pytest.mark.parametrize("case", [{}, {"adam": True}, {"dropout": True}])
def test_graph_replay_is_bit_identical_to_eager(math, case):
    g, lg, pg = _train(graphs=True, math=math, **case)
    e, le, pe = _train(graphs=False, math=math, **case)
    assert g.executor.step_runner == "cuda graph", g.executor.graph_fallback
    assert g.executor.graph_step.replays == 4
    print(g.executor.graph_step.describe())   # the dense layer's cuBLAS calls run eagerly between graphs
    assert lg == le
    for k in pe:
        assert np.array_equal(pg[k], pe[k]), k


# The exact policies that run on CUDA ('weights' updates on the host, which the executor refuses on a GPU).
@pytest.mark.parametrize("math", ["fp32", "tf32"])
@pytest.mark.parametrize("policy", ["liveness", "offload", "recompute", "packs", "auto", "window"])
def test_every_policy_is_bit_identical_to_none_on_cuda(policy, math):
    _, lr, pr = _train("none", math=math)
    sess, ls, ps = _train(policy, math=math)
    print(f"{policy}: {sess.executor.step_runner}; {sess.executor.graph_fallback}")
    assert ls == lr
    for k in pr:
        assert np.array_equal(ps[k], pr[k]), k


def test_the_device_guard_stops_a_diverging_step_like_the_host_guard():
    x, y = _data(1)[0]
    outcomes = []
    for graphs in (True, False):
        sess, _, _ = _train(graphs=graphs)
        with pytest.raises(dl.DivergenceError) as e:
            sess.executor.train_step(np.full_like(x, np.nan), y)
        outcomes.append((str(e.value), sess.executor.iteration,
                         {k: v.copy() for k, v in sess.executor.state_dict().items()}))
    (mg, ig, pg), (me, ie, pe) = outcomes
    assert (mg, ig) == (me, ie)
    for k in pe:
        assert np.array_equal(pg[k], pe[k]), k
