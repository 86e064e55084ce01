"""A fork's gradients accumulated in place: a convolution that is not the first consumer of its input to run
backward adds its input's delta into the delta already written, sample by sample, instead of writing a partial
delta of the whole batch beside it (graph/route.py). The fork's backward step then holds that delta once."""
import numpy as np
import pytest

from minidl.data import synthetic
from minidl.graph.route import Phase
from minidl.layers import Conv2d
from minidl.memory.request import Target
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import RunConfig, Session
from tests.planning import planned


def _resnet50(batch=2, size=64):
    return build_model("resnet", depth=50, batch=batch, image_size=size, variant="imagenet")


def test_a_forks_later_convolution_adds_in_place_through_one_sample():
    route = _resnet50().route(optimizer_slots=("momentum",))
    step = next(s for s in route.steps if s.phase is Phase.BACKWARD and s.name == "layer2.0.conv1")
    (acc,) = step.accumulate
    assert acc.in_place and acc.into == "delta:layer1.2.relu" and step.dinputs == [acc.into]
    into, scratch = route.tensors[acc.into], route.tensors[acc.partial]
    assert scratch.shape == (1, *into.shape[1:]) and into.shape[0] == 2
    for s in route.steps:     # no convolution at a fork writes a partial delta of the whole batch any more
        if s.phase is Phase.BACKWARD and isinstance(route.network.nodes[s.node].layer, Conv2d):
            assert all(a.in_place and route.tensors[a.partial].shape[0] == 1 for a in s.accumulate), s.label


@pytest.mark.parametrize("debug", [False, True], ids=["compiled", "debug"])
def test_in_place_sums_are_the_partial_sums(monkeypatch, debug):
    """The parameters after training with in-place accumulation equal (to rounding) those of the partial-delta
    route, the textbook sum (accumulates_in_place switched off)."""
    def trained():
        net = build_model("resnet", depth=20, batch=2, image_size=16, num_classes=10)
        sess = Session(net, SGD(lr=0.05, momentum=0.9), policy="liveness", seed=0,
                       config=RunConfig(debug=debug))
        sess.fit(synthetic(8, net.input_nodes[0].shape[1:], 10, seed=0), 2)
        assert sess.executor.pool.peak == sess.plan.peak_bytes
        return sess.executor.state_dict()

    got = trained()
    monkeypatch.setattr(Conv2d, "accumulates_in_place", False)
    ref = trained()
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_resnet50_at_7_5x_the_in_memory_batch_plans_on_a_v100():
    """Batch 1388 on the v100 profile under `window`: the step through layer2.0.conv1 held four activation-sized
    tensors (the block input, the conv's output delta, a partial delta and the accumulated delta) and no budget
    of 16 GB planned it."""
    plan = planned(_resnet50(batch=1388, size=224), SGD(lr=0.01, momentum=0.9), "window", "16GB",
                   device="v100", menu=Target.for_run("v100").menu)
    assert plan.min_budget_bytes <= 16 * 10**9
