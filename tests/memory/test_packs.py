"""Layer packs and micro-batches (Harmony): bit-identical to the same micro-batching under `none`, the full batch to
float tolerance, a pack's weights brought in once per block, only pack inputs stashed, and the packs policy."""
import json

import numpy as np
import pytest

import minidl as dl
from minidl.cli import main
from minidl.core.tensors import Role
from minidl.data import synthetic
from minidl.graph.packs import PackError, even_packs
from minidl.layers import Conv2d, Linear, MaxPool2d, ReLU, SoftmaxCrossEntropy
from minidl.memory.decisions.weights import moved_by_role
from minidl.memory.liveness import analyze
from minidl.models import build_model
from minidl.optim import SGD
from tests import sessions
from tests.planning import planned
from tests.sessions import same_state

from .nets import vgg11_narrow

NETS = {
    "resnet20": lambda: build_model("resnet", depth=20, batch=4, image_size=16, num_classes=10),
    "vgg11": lambda: vgg11_narrow(batch=4),
    "densenet_tiny": lambda: build_model("densenet", variant="tiny", batch=4, image_size=16, num_classes=10),
}


def plain_net(batch=4):
    """No BN, no dropout: micro-batching then changes only the order of sums, so it matches the full batch."""
    net = dl.Network("plain")
    h = net.input((batch, 3, 8, 8), name="data")
    y = net.input((batch,), dtype="int64", name="label")
    for i, c in enumerate((4, 8)):
        h = MaxPool2d(2, name=f"pool{i}")(ReLU(name=f"relu{i}")(Conv2d(c, 3, padding=1, name=f"conv{i}")(h)))
    net.set_loss(SoftmaxCrossEntropy(name="loss")(Linear(5, name="fc")(ReLU(name="r")(Linear(16, name="fc0")(h))), y))
    return net


def train(net, policy, M, budget=None, steps=2, **kw):
    return sessions.train(net, policy, budget, steps, seed=0, micro_batches=M, **kw)


@pytest.mark.parametrize("key", list(NETS))
@pytest.mark.parametrize("M", [1, 2, 4])
def test_packs_are_bit_identical_to_none_with_the_same_micro_batches(key, M):
    ref = train(NETS[key](), "none", M)
    budget = planned(NETS[key](), SGD(lr=0.1, momentum=0.9), "liveness").min_budget_bytes // 2
    got = train(NETS[key](), "packs", M, budget=budget, debug=True)
    assert got.plan.route.micro_batches == M and got.plan.min_budget_bytes <= budget
    assert got.executor.pool.peak == got.plan.peak_bytes
    same_state(got, ref)


def test_micro_batches_match_the_full_batch_to_float_tolerance():
    full = train(plain_net(), "liveness", None)
    for M in (2, 4):
        got = train(plain_net(), "packs", M)
        for name, val in full.executor.state_dict().items():
            np.testing.assert_allclose(got.executor.state_dict()[name], val, rtol=1e-5, atol=1e-6, err_msg=name)
        assert got.executor.last_loss == pytest.approx(full.executor.last_loss, rel=1e-5)


def test_a_packs_weights_come_in_once_per_block_whatever_M():
    net = NETS["vgg11"]()
    weights = sum(t.nbytes for t in net.route(optimizer_slots=("momentum",)).tensors.values()
                  if t.role is Role.PARAMETER and net.node(t.owner).layer.checkpoint)
    for M in (1, 2, 4):
        route = net.route(optimizer_slots=("momentum",), micro_batches=M, packs=even_packs(net, 3))
        from minidl.memory.decisions.weights import plan_weights

        plan = plan_weights(route, None)
        assert moved_by_role(plan)["weights"] == 2 * weights   # in for forward, in for backward: once each


def test_only_pack_inputs_live_from_forward_into_backward():
    net = NETS["vgg11"]()
    packs = even_packs(net, 3)
    route = net.route(optimizer_slots=("momentum",), micro_batches=2, packs=packs)
    iv = analyze(route)
    turn = route.turn
    crossing = {t for t, i in iv.items() if route.tensors[t].role is Role.ACTIVATION and i.first < turn <= i.last}
    inputs = {f"act:{p[0]}" for p in packs[1:]}  # a pack's input is the previous pack's last output
    outputs = {f"act:{p[-1]}" for p in packs[:-1]}
    assert {t.rsplit("@", 1)[0] for t in crossing} <= outputs and len(inputs) == len(outputs)
    assert len(crossing) == 2 * len(outputs)     # one stash per micro-batch per pack boundary


def test_bad_micro_batches_fail_at_plan_time():
    with pytest.raises(PackError, match="3 does not divide the batch of 4"):
        planned(NETS["resnet20"](), SGD(lr=0.1), "liveness", micro_batches=3)


def test_cli_micro_batches_and_packs(capsys):
    args = ["plan", "resnet", "--depth", "20", "--batch", "4", "--image-size", "16", "--json", "--device", "cpu"]
    assert main(args + ["--policy", "packs", "--micro-batches", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["micro_batches"] == 2 and out["packs"] and out["moved_bytes_by_role"]["weights"] > 0
    assert main(args + ["--policy", "packs", "--micro-batches", "1"]) == 0   # one micro-batch, still in packs
    out = json.loads(capsys.readouterr().out)
    assert out["micro_batches"] == 1 and out["packs"]
    assert main(args + ["--micro-batches", "2"]) == 0    # accumulated: no packs to list
    out = json.loads(capsys.readouterr().out)
    assert out["micro_batches"] == 2 and out["packs"] is None


def act_net(batch=8):
    """Small weights, large activations: what micro-batching shrinks."""
    net = dl.Network("acts")
    h = net.input((batch, 3, 32, 32), name="data")
    y = net.input((batch,), dtype="int64", name="label")
    for i, c in enumerate((8, 8)):
        h = MaxPool2d(2, name=f"pool{i}")(ReLU(name=f"relu{i}")(Conv2d(c, 3, padding=1, name=f"conv{i}")(h)))
    net.set_loss(SoftmaxCrossEntropy(name="loss")(Linear(5, name="fc")(h), y))
    return net


def test_packs_choose_micro_batches_when_one_batch_step_cannot_fit():
    from minidl.memory.schedulers.packs import step_floor

    net = act_net()
    per_layer = [[n.name] for n in net.layer_nodes]
    floor = step_floor(net.route(optimizer_slots=("momentum",), micro_batches=1, packs=per_layer))
    with pytest.raises(dl.BudgetError):   # micro-batching switched off: no single-batch plan fits
        planned(act_net(), SGD(lr=0.1, momentum=0.9), "auto", budget=floor - 1, max_micro_batches=1)
    for policy in ("packs", "auto", "auto-lossy"):   # auto micro-batches by itself when no single-batch plan fits
        got = train(act_net(), policy, None, budget=floor - 1, debug=True)  # below one full-batch step's tensors
        assert got.plan.route.micro_batches > 1 and got.plan.min_budget_bytes < floor
        assert got.executor.pool.peak == got.plan.peak_bytes
        same_state(got, train(act_net(), "none", got.plan.route.micro_batches))
    assert "micro-batches" in got.plan.decision and "no single-batch plan fits" in got.plan.decision


def test_evaluate_on_a_packed_route_matches_the_plain_route():
    data = synthetic(16, (3, 8, 8), 5, seed=3)
    plain = train(plain_net(), "liveness", None, steps=0)
    packed = train(plain_net(), "packs", 2, steps=0)
    loss_a, acc_a = plain.evaluate(data)
    loss_b, acc_b = packed.evaluate(data)
    assert acc_a == acc_b and loss_b == pytest.approx(loss_a, rel=1e-6)


def _bn_on_the_data(batch=4):
    """BatchNorm without affine parameters on the data: nothing trainable before it, so it has no backward, but
    its training forward still writes its batch statistics."""
    from minidl.layers import BatchNorm2d, Flatten

    net = dl.Network("bn_on_data")
    x = net.input((batch, 3, 8, 8), name="data")
    y = net.input((batch,), dtype="int64", name="label")
    h = ReLU(name="relu")(Conv2d(4, 3, padding=1, name="conv")(BatchNorm2d(affine=False, name="bn0")(x)))
    net.set_loss(SoftmaxCrossEntropy(name="loss")(Linear(5, name="fc")(Flatten(name="flat")(h)), y))
    return net


@pytest.mark.parametrize("make", [plain_net, _bn_on_the_data, NETS["resnet20"], NETS["densenet_tiny"]])
def test_the_plain_route_is_the_packed_route_of_one_micro_batch(make):
    """One builder: the packed route of one micro-batch and one layer per pack, without its re-forward steps and
    with its ids read back to the canonical ones, has the plain fused route's steps, step for step, and the same
    tensors."""
    from minidl.core.tensors import micro_id
    from minidl.graph.packs import build_packed
    from minidl.graph.route import Route

    net = make()
    plain = Route.build(net, True, ("momentum",), fused_update=True)
    packed = build_packed(net, 1, [[n.name] for n in net.layer_nodes], ("momentum",))
    back = {micro_id(t, 0, again): t for t in plain.tensors for again in (False, True)}
    ids = lambda ts: [back.get(t, t) for t in ts]  # noqa: E731
    steps = [s for s in packed.steps if not s.recompute]
    assert [s.label for s in plain.steps] == [s.label.removesuffix(" [0]") for s in steps]
    for a, b in zip(plain.steps, steps):
        assert (a.reads, a.writes, a.dinputs) == (ids(b.reads), ids(b.writes), ids(b.dinputs)), a.label
        assert [(x.partial, x.into) for x in a.accumulate] == [(back.get(x.partial), back[x.into])
                                                               for x in b.accumulate]
        assert a.workspace == (b.workspace and back.get(b.workspace))
        assert a.rename == {} and set(b.rename.values()) <= set(packed.tensors)
    copies = {micro_id(t, 0, again=True) for t in plain.tensors}  # the re-forward's outputs and workspaces
    copies |= {s.workspace for s in packed.steps if s.recompute}
    assert set(plain.tensors) == {back.get(t, t) for t in packed.tensors if t not in copies}


# -- micro-batches without packs: gradient accumulation ------------------------------------------------------

def test_micro_batches_without_packs_accumulate_with_one_micro_batch_alive_at_a_time():
    """Each micro-batch's forward, then its backward, nothing run twice; the updates follow the last micro-batch's
    backward. At the peak every activation belongs to one micro-batch, so the peak falls as M grows (it did not
    when micro-batches meant one pack per layer: every layer's input was stashed for every micro-batch)."""
    peaks = {}
    for M in (1, 2, 4):
        plan = planned(act_net(), SGD(lr=0.1, momentum=0.9), "liveness", micro_batches=M)
        route = plan.route
        assert not any(s.recompute for s in route.steps)
        order = [(s.micro, s.phase.value) for s in route.steps if s.phase.value != "update"]
        assert order == sorted(order, key=lambda mp: (mp[0], mp[1] != "forward"))   # F(0) B(0) F(1) B(1) ...
        updates = [s.index for s in route.steps if s.phase.value == "update"]
        last_backward = [s.index for s in route.steps if s.phase.value == "backward" and s.micro == M - 1]
        assert updates and min(updates) > min(last_backward)
        micro_of = {t: s.micro for s in route.steps if s.phase.value == "forward" for t in s.writes}
        acts = {micro_of[t] for t in plan.peak_live if route.tensors[t].role is Role.ACTIVATION}
        assert len(acts) <= 1, plan.peak_live
        peaks[M] = plan.peak_bytes
    assert peaks[1] > peaks[2] > peaks[4]


def test_evaluate_on_accumulated_micro_batches_matches_the_packed_route_bit_for_bit():
    data = synthetic(16, (3, 8, 8), 5, seed=3)
    acc = train(plain_net(), "liveness", 2, steps=1)
    packed = train(plain_net(), "packs", 2, steps=1)
    assert acc.plan.route.packing.schedule == "accumulate" and packed.plan.route.packing.schedule == "packs"
    assert acc.evaluate(data) == packed.evaluate(data)


def tiny_gpt(batch=4):
    return build_model("gpt2", layers=2, heads=2, width=16, seq=16, batch=batch, num_classes=40)


@pytest.mark.parametrize("M", [1, 2, 4])
def test_grad_spans_from_one_pass_are_the_per_gradient_scan(M):
    """The weights decision's gradient spans, from one pass over the route, are what the scan per gradient gave
    (on a tied GPT: the head's contribution is added into the embedding's gradient)."""
    from minidl.graph.route import Phase
    from minidl.memory.decisions.weights import grad_spans

    net = tiny_gpt()
    route = net.route(optimizer_slots=("momentum",), fused_update=True, micro_batches=M,
                      packs=None if M == 1 else [[n.name] for n in net.layer_nodes])
    grads = [t for t, s in route.tensors.items() if s.role is Role.GRADIENT]
    for tid in grads:
        ks = [s.index for s in route.steps if s.phase is Phase.BACKWARD
              and (tid in s.writes or any(a.into == tid for a in s.accumulate))]
        assert grad_spans(route)[tid] == (ks[0], ks[-1]), tid


def plan_events(plan):
    return [[(e.kind, e.tensor, e.offset, e.nbytes, e.reason) for e in sp.before + sp.after] for sp in plan.steps]


@pytest.mark.parametrize("make", [tiny_gpt, NETS["resnet20"]], ids=["gpt2", "resnet20"])
def test_the_weights_floor_is_below_every_packings_plan(make):
    """`weights_floor` (no placement) never exceeds the arena `plan_weights` needs for a packing, fitting or not:
    `plan_packs` skips a packing on it without changing which packing fits first."""
    from minidl.memory.decisions.weights import plan_weights, weights_floor
    from minidl.memory.workspace import workspace_choices

    net = make()
    for M in (1, 2):
        for n in (1, 2, 4):
            route = net.route(optimizer_slots=("momentum",), micro_batches=M, packs=even_packs(net, n))
            ws = workspace_choices(route)
            floor = weights_floor(route, ws)
            assert floor <= plan_weights(route, None, workspace=ws).min_budget_bytes
            with pytest.raises(dl.BudgetError) as e:
                plan_weights(route, floor - 512, workspace=ws)
            assert e.value.min_budget_bytes >= floor


@pytest.mark.parametrize("frac", [0.7, 0.5, 0.4])   # fits with 1 and 3 packings skipped; fails, 3 skipped
def test_packs_skipping_packings_below_their_floor_plans_as_placing_them_all(frac, monkeypatch):
    """The same plan, event for event, or the same error, as the search that places every packing."""
    from minidl.memory.schedulers import packs as packs_scheduler

    live = planned(tiny_gpt(), SGD(lr=0.1, momentum=0.9), "liveness").peak_bytes
    budget = int(live * frac)

    def plan():
        try:
            return plan_events(planned(tiny_gpt(), SGD(lr=0.1, momentum=0.9), "packs", budget))
        except dl.BudgetError as e:
            return str(e)

    fast = plan()
    monkeypatch.setattr(packs_scheduler, "weights_floor", lambda route, ws: 0)   # every packing placed
    assert plan() == fast
