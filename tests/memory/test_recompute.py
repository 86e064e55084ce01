"""Cost-aware recomputation: which outputs are dropped, that every recomputation finds its inputs resident, that
memory goes down, and that forced modes (plans made outside the registry) keep the bits of policy `none` (the
registry's plans: tests/runtime/test_policy_matrix.py)."""
import numpy as np
import pytest

import minidl as dl
from minidl.graph.route import Phase
from minidl.layers import BatchNorm2d, Conv2d, Flatten, Linear, MaxPool2d, ReLU, SoftmaxCrossEntropy
from minidl.memory.decisions.recompute import (
    MEMORY,
    SPEED,
    find_segments,
    recompute_flops,
    recompute_plan,
    recompute_schedule,
)
from minidl.memory.plan import EventKind
from minidl.memory.simulate import simulate
from minidl.memory.workspace import workspace_choices
from minidl.models import build_model
from minidl.optim import SGD
from tests import sessions
from tests.planning import planned

from .nets import NETS, dropnet


def route_of(net, opt=None):
    opt = opt or SGD(lr=0.05, momentum=0.9)
    return net.route(optimizer_slots=tuple(opt.slots))


def train(net, policy, plan=None, debug=True):
    return sessions.train(net, policy, steps=5, n=32, seed=7, data_seed=1, plan=plan, debug=debug)


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(key):
        if key not in cache:
            cache[key] = train(NETS[key](), "none", debug=False).executor.state_dict()
        return cache[key]
    return get


def assert_identical(ref, got):
    assert ref.keys() == got.keys()
    for k in ref:
        assert np.array_equal(ref[k], got[k]), f"{k} differs"


# -- which tensors are dropped ------------------------------------------------------------------------------------
def test_segments_of_a_resnet_block():
    net = NETS["resnet20"]()
    segs = {s.root: s for s in find_segments(route_of(net))}
    # conv1 -> bn1 -> relu1: relu1's output is read by conv2's backward; dropping it saves its bytes
    s = segs["act:layer1.0.conv1"]
    assert s.members == ["act:layer1.0.bn1", "act:layer1.0.relu1"]
    assert s.needed == ["act:layer1.0.relu1"] and s.root_bwd and s.dropped
    # add -> relu: dropping relu's output would only keep the add's output (same size) instead: not worth it
    s = segs["act:layer1.0.add"]
    assert s.members == ["act:layer1.0.relu"] and not s.root_bwd and s.saved_bytes == 0 and not s.dropped
    # conv2 -> bn2 (-> add): backward never reads bn2's output, nothing to drop
    assert not segs["act:layer1.0.conv2"].needed


def test_checkpoint_layers_are_never_dropped():
    for key, make in NETS.items():
        net = make()
        for seg in find_segments(route_of(net)):
            for m in seg.members:
                layer = net.node(m.split(":", 1)[1]).layer
                assert not layer.checkpoint, (key, m)
            root = net.node(seg.root.split(":", 1)[1])
            assert root.layer is None or root.layer.checkpoint or seg.root not in seg.parent


def replay(plan):
    """Yield (step, event, resident-set-before-the-event) over the whole plan."""
    live = {ev.tensor for ev in plan.setup}
    for k, sp in enumerate(plan.steps):
        for ev in sp.before:
            yield k, "before", ev, live
            _apply(live, ev)
        yield k, "compute", None, live
        for ev in sp.after:
            yield k, "after", ev, live
            _apply(live, ev)


def _apply(live, ev):
    if ev.kind in (EventKind.ALLOC, EventKind.PREFETCH, EventKind.RECOMPUTE):
        assert ev.tensor not in live, f"{ev.tensor} allocated twice"
        live.add(ev.tensor)
    elif ev.kind in (EventKind.FREE, EventKind.RELEASE):
        live.remove(ev.tensor)


@pytest.mark.parametrize("key", list(NETS))
@pytest.mark.parametrize("mode", [None, SPEED, MEMORY])
def test_every_recomputation_finds_its_input_and_every_step_its_tensors(key, mode):
    net = NETS[key]()
    route = route_of(net)
    plan = recompute_plan(route, mode=mode)
    n = 0
    for k, where, ev, live in replay(plan):
        if ev is not None and ev.kind is EventKind.RECOMPUTE:
            node = net.node(ev.tensor.split(":", 1)[1])
            for i in node.inputs:
                assert f"act:{net.nodes[i].name}" in live, (ev.tensor, k)
            n += 1
        if where == "compute":
            step = route.steps[k]
            for t in set(step.reads) | set(step.writes):
                assert t in live or route.tensors[t].role.persistent, (t, step.label)
    assert n > 0


@pytest.mark.parametrize("key", list(NETS))
def test_dropped_tensors_are_not_resident_across_the_turn(key):
    net = NETS[key]()
    route = route_of(net)
    plan = planned(net, SGD(lr=0.05, momentum=0.9), "recompute")
    n_fwd = sum(1 for s in route.steps if s.phase is Phase.FORWARD)
    dropped = {m for s in find_segments(route) if s.dropped for m in s.needed}
    assert dropped
    live = set()
    for k, where, _ev, now in replay(plan):
        if k == n_fwd and where == "before" and not live:
            live = set(now)
    assert not dropped & live


def test_memory_goes_down_and_modes_are_ordered():
    for key in ("resnet20", "densenet_tiny", "dropnet"):
        net = NETS[key]()
        route = route_of(net)
        opt = SGD(lr=0.05, momentum=0.9)
        live = planned(net, opt, "liveness")
        rec = planned(net, opt, "recompute")
        assert rec.peak_bytes <= live.peak_bytes, key
        turn = sum(1 for s in route.steps if s.phase is Phase.FORWARD)   # forward -> backward
        assert rec.steps[turn].in_use < live.steps[turn].in_use, key
        ws = workspace_choices(route)
        mem = recompute_schedule(route, ws, mode=MEMORY)
        spd = recompute_schedule(route, ws, mode=SPEED)
        dflt = recompute_schedule(route, ws)
        # the default never goes above the bottleneck, which is the all-memory-centric timeline's top
        assert dflt.bottleneck == mem.timeline_peak
        assert dflt.timeline_peak <= dflt.bottleneck
        assert mem.timeline_peak <= spd.timeline_peak
        # the timeline is exact for these plans: the placement's peak (sum of live rounded blocks) matches
        assert rec.peak_bytes == dflt.timeline_peak, key
        # memory-centric may recompute more, never less
        assert mem.recomputes >= dflt.recomputes >= spd.recomputes


def test_speed_centric_where_it_fits_memory_centric_otherwise():
    """conv-BN-ReLU-pool-conv: pool's output is read (by conv2's backward, whose workspace is large) one step
    before ReLU's, so speed-centric holds ReLU's output during conv2's backward. With a limit below that, the
    segment stays memory-centric and BN and ReLU run twice."""
    net = dl.Network("chain")
    x = net.input((2, 2, 8, 8), name="data")
    y = net.input((2,), dtype="int64", name="label")
    h = Conv2d(64, 3, padding=1, name="conv")(x)
    h = MaxPool2d(2, name="pool")(ReLU(name="relu")(BatchNorm2d(name="bn")(h)))
    h = Conv2d(64, 3, padding=1, name="conv2")(h)
    net.set_loss(SoftmaxCrossEntropy(name="loss")(Linear(3, name="fc")(Flatten(name="flat")(h)), y))
    route = route_of(net)
    ws = workspace_choices(route)
    mem = recompute_schedule(route, ws, mode=MEMORY)
    spd = recompute_schedule(route, ws, mode=SPEED)
    assert spd.timeline_peak > mem.timeline_peak
    assert spd.recomputes < mem.recomputes
    loose = recompute_schedule(route, ws, limit=spd.timeline_peak)
    tight = recompute_schedule(route, ws, limit=mem.timeline_peak)
    seg = lambda rs: next(s for s in rs.segments if s.root == "act:conv")  # noqa: E731
    assert seg(loose).mode == SPEED and seg(tight).mode == MEMORY


# -- results do not change --------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", list(NETS))
def test_the_executor_recomputes_the_planned_flops(key):
    sess = train(NETS[key](), "recompute", debug=False)
    assert sess.executor.recomputed_flops == 5 * recompute_flops(sess.plan) > 0


@pytest.mark.parametrize("mode", [SPEED, MEMORY])
def test_forced_modes_are_bit_identical(mode, reference):
    net = NETS["dropnet"]()
    plan = recompute_plan(route_of(net), mode=mode)
    sess = train(net, "liveness", plan=plan)
    assert_identical(reference("dropnet"), sess.executor.state_dict())
    assert sess.executor.pool.peak == plan.peak_bytes


def test_dropout_and_bn_are_recomputed_here():
    net = dropnet()
    plan = recompute_plan(route_of(net))
    rebuilt = {ev.tensor for sp in plan.steps for ev in sp.before if ev.kind is EventKind.RECOMPUTE}
    assert {"act:drop", "act:bn0", "act:relu0", "act:pool0"} <= rebuilt


def test_recompute_share_in_the_simulator():
    net = NETS["resnet20"]()
    plan = planned(net, SGD(lr=0.1, momentum=0.9), "recompute")
    sim = simulate(plan, "k40c")
    assert sim.recompute_flops == recompute_flops(plan)
    assert 0 < sim.recompute_flops_share < 0.05   # BN + ReLU are cheap next to convolutions
    base = simulate(planned(net, SGD(lr=0.1, momentum=0.9), "liveness"), "k40c")
    assert sim.compute_time_s > base.compute_time_s


def test_budget_is_checked():
    from minidl.core.errors import BudgetError

    net = NETS["resnet20"]()
    plan = planned(net, SGD(lr=0.1, momentum=0.9), "recompute")
    with pytest.raises(BudgetError) as e:
        planned(net, SGD(lr=0.1, momentum=0.9), "recompute", budget=plan.lower_bound_bytes // 2)
    assert e.value.min_budget_bytes is not None


@pytest.mark.slow
def test_resnet2500_recompute_plan_is_below_liveness():
    """Planning time at this scale is a benchmark figure (README, "Planning at ResNet-2500 scale"), not asserted."""
    net = build_model("resnet", depth=2500, batch=16)
    plan = planned(net, SGD(lr=0.1), "recompute", device="k40c")
    assert plan.peak_bytes < planned(net, SGD(lr=0.1), "liveness").peak_bytes


def test_compute_peak_lower_bound_never_exceeds_the_placed_peak():
    from minidl.memory.decisions.recompute import compute_peak_lower_bound
    from minidl.memory.planner import liveness_schedule, make_plan
    from minidl.memory.workspace import frugal_workspace

    for key, make in NETS.items():
        route = route_of(make())
        ws = workspace_choices(route)
        for sched in (liveness_schedule(route, ws), recompute_schedule(route, ws).schedule,
                      recompute_schedule(route, ws, mode=MEMORY).schedule):
            lb = compute_peak_lower_bound(route, sched, ws)
            assert lb <= make_plan(route, "x", None, ws, sched).peak_bytes, key
            assert lb <= make_plan(route, "x", None, frugal_workspace(route), sched).peak_bytes, key
