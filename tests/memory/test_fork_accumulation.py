"""A fork's gradients accumulated in place: a convolution that is not the first consumer of its input to run
backward adds its input's delta into the delta already written, in the one backend call that computes it for the
whole batch (graph/route.py), so no partial delta exists and the fork's backward step holds that delta once."""
import numpy as np
import pytest

from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.cpu.menu import CPU_MENU
from minidl.data import synthetic
from minidl.graph.route import Phase
from minidl.layers import Conv2d
from minidl.memory.report.explain import explain
from minidl.memory.request import Target
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import RunConfig, Session
from tests.planning import planned


def _resnet50(batch=2, size=64):
    return build_model("resnet", depth=50, batch=batch, image_size=size, variant="imagenet")


def test_a_forks_later_convolution_adds_into_the_delta_with_no_partial():
    net = _resnet50()
    route = net.route(optimizer_slots=("momentum",))
    step = next(s for s in route.steps if s.phase is Phase.BACKWARD and s.name == "layer2.0.conv1")
    (acc,) = step.accumulate
    assert acc.in_place and acc.partial is None and acc.into == "delta:layer1.2.relu"
    assert step.dinputs == [acc.into] and step.accumulates_into == {0}
    assert [t for t in route.tensors if t.startswith("dpart:")] == []   # every consumer at ResNet-50's forks
    # the step lists the accumulating menu: gemm_1x1 finishes each sample's product in a one-sample tile
    node = net.node("layer2.0.conv1")
    in_shapes, out_shape = route.shapes_of(node.index)
    plain = {o.algo: o.workspace_bytes for o in node.layer.workspace_options("bwd", in_shapes, out_shape, 4, CPU_MENU)}
    menu = {o.algo: o.workspace_bytes for o in step.workspace_options}
    assert menu["gemm_1x1"] == max(plain["gemm_1x1"], 256 * 16 * 16 * 4)
    assert menu["im2col"] == plain["im2col"] and menu["im2col_chunked"] == plain["im2col_chunked"]
    plan = planned(net, SGD(lr=0.1, momentum=0.9), "liveness")
    assert plan.sizes and not [t for t in plan.sizes if t.startswith("dpart:")]
    (line,) = [ln for ln in explain(plan, select="layer2.0.conv1").splitlines()
               if ln.startswith("step") and "bwd layer2.0.conv1 " in ln]
    assert line.endswith(f"algo {plan.steps[step.index].algo}  (adds its input delta into delta:layer1.2.relu in "
                         f"the same call)"), line


def test_each_convolution_backward_is_one_call_over_the_batch(monkeypatch):
    """One conv2d_backward per convolution backward step, on the whole batch, accumulating exactly at the
    route's in-place accumulations; nothing is added after a convolution's step."""
    calls = []
    plain = CPUBackend.conv2d_backward

    def spy(self, x, w, dy, dx, *rest, accumulate=False):
        calls.append((x.shape[0], None if dx is None else dx.shape[0], accumulate))
        plain(self, x, w, dy, dx, *rest, accumulate=accumulate)
    monkeypatch.setattr(CPUBackend, "conv2d_backward", spy)
    net = build_model("resnet", depth=20, batch=4, image_size=16, num_classes=10)
    sess = Session(net, SGD(lr=0.05, momentum=0.9), policy="liveness", seed=0)
    sess.fit(synthetic(4, net.input_nodes[0].shape[1:], 10, seed=0), 1)
    convs = [s for s in sess.plan.route.steps
             if s.phase is Phase.BACKWARD and isinstance(net.nodes[s.node].layer, Conv2d)]
    in_place = [s for s in convs if s.accumulates_into]
    assert len(in_place) == 9 and all(not [a for a in s.accumulate if not a.in_place] for s in convs)
    assert len(calls) == len(convs) and set(calls) == {(4, 4, False), (4, 4, True), (4, None, False)}  # the stem
    assert sum(acc for _, _, acc in calls) == len(in_place)


@pytest.mark.bits
@pytest.mark.parametrize("debug", [False, True], ids=["compiled", "debug"])
def test_in_place_sums_are_the_partial_sums_bit_for_bit(monkeypatch, debug):
    """The parameters after training with in-place accumulation are those of the partial-delta route (the
    textbook sum: accumulates_in_place switched off), bit for bit: the backends add exactly dx + (the dx a plain
    call writes), the addition a partial delta gets."""
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
        assert np.array_equal(got[name], ref[name]), name


def test_resnet50_at_7_5x_the_in_memory_batch_plans_on_a_v100():
    """Batch 1388 on the v100 profile under `window`: the step through layer2.0.conv1 held four activation-sized
    tensors (the block input, the conv's output delta, a partial delta and the accumulated delta) and no budget
    of 16 GB planned it."""
    plan = planned(_resnet50(batch=1388, size=224), SGD(lr=0.01, momentum=0.9), "window", "16GB",
                   device="v100", menu=Target.for_run("v100").menu)
    assert plan.min_budget_bytes <= 16 * 10**9
