"""Weights and optimizer state homed on the host (decisions/weights.py): the bytes moved per role, a device update
and Adam's host update bit-identical to policy `none`, and `auto` reaching budgets below the training state (the
policy's bits and peaks under every runner: tests/runtime/test_policy_matrix.py)."""
import json

import numpy as np
import pytest

from minidl.cli import main
from minidl.core.tensors import Role
from minidl.data import BatchIterator, synthetic
from minidl.memory.decisions.weights import host_homed, layer_candidates, moved_by_role, visits, weights_schedule
from minidl.memory.planner import default_workspace, liveness_schedule, make_plan
from minidl.memory.report import explain
from minidl.optim import Adam
from minidl.runtime.executor import Executor
from tests.planning import planned
from tests.sessions import opt, same_state

from .test_fused_update import NETS, train


@pytest.mark.parametrize("key", list(NETS))
def test_weights_policy_moves_what_it_says(key):
    plan = planned(NETS[key](), opt(), "weights")
    homed = host_homed(plan)
    tensors = plan.route.tensors
    params = {t for t in homed if tensors[t].role is Role.PARAMETER}
    assert params and {t for t in homed if tensors[t].role is Role.OPTIMIZER}
    assert {tensors[t].owner for t in params} == set(layer_candidates(plan.route))
    # Host update: each weight comes in for forward and for backward, its gradient goes out, its slots never move.
    moved = moved_by_role(plan)
    assert moved["weights"] == 2 * sum(tensors[t].nbytes for t in params)
    assert moved["gradients"] == sum(tensors[t.replace("param:", "grad:")].nbytes for t in params)
    assert moved["optimizer_state"] == 0 and moved["activations"] == 0
    assert plan.peak_bytes < planned(NETS[key](), opt(), "liveness", fused_update=True).peak_bytes


@pytest.mark.parametrize("fused", [True, False])
def test_device_update_brings_the_optimizer_state_in_and_is_bit_identical(fused):
    """Without a host update the slots visit the device for the update, and the written weights go back."""
    net = NETS["resnet20"]()
    o = Adam(lr=1e-3)
    route = net.route(optimizer_slots=o.slots, fused_update=fused)
    ws = default_workspace(route)
    layers = layer_candidates(route)
    sched = weights_schedule(route, liveness_schedule(route, ws), layers, host_update=False, lead=0)
    plan = make_plan(route, "weights", None, ws, sched)
    ex = Executor(net, plan, o, seed=0, debug=True)
    ref = train(NETS["resnet20"](), "none", fused=False, opt=Adam(lr=1e-3))
    it = BatchIterator(synthetic(16, net.input_nodes[0].shape[1:], 10, seed=0), 2, seed=0, shuffle=True,
                       drop_last=True)
    for _ in range(3):
        ex.train_step(*it.next_batch())
    for name, val in ref.executor.state_dict().items():
        assert np.array_equal(ex.state_dict()[name], val), name
    for name, val in ref.executor.optimizer_state().items():
        assert np.array_equal(ex.optimizer_state()[name], val), name
    assert ex.pool.peak == plan.peak_bytes
    moved = moved_by_role(plan)
    slots = sum(t.nbytes for t in route.tensors.values() if t.role is Role.OPTIMIZER and t.owner in layers)
    assert moved["optimizer_state"] == 2 * slots and moved["gradients"] == 0


def test_visits_split_on_gaps_of_two_steps():
    v = visits([(3, False), (10, False), (11, True), (20, False)])
    assert [(x.first, x.last, x.dirty) for x in v] == [(3, 3, False), (10, 11, True), (20, 20, False)]


def test_host_update_needs_the_fused_route():
    route = NETS["resnet20"]().route(optimizer_slots=("momentum",))
    with pytest.raises(ValueError, match="fused"):
        weights_schedule(route, liveness_schedule(route, default_workspace(route)), layer_candidates(route))


def test_auto_homes_weights_below_the_training_state():
    net = NETS["resnet20"]()
    state = net.route(optimizer_slots=("momentum",)).persistent_bytes()
    budget = state // 2      # half of parameters + momentum alone
    plan = planned(NETS["resnet20"](), opt(), "auto", budget)
    assert plan.min_budget_bytes <= budget and host_homed(plan)


def test_weights_plan_evaluates_checkpoints_and_explains(tmp_path):
    sess = train(NETS["densenet_tiny"](), "weights", fused=None, steps=1)
    before, in_use = sess.executor.state_dict(), sess.executor.pool.in_use
    sess.evaluate(synthetic(4, sess.net.input_nodes[0].shape[1:], 10, seed=1))
    assert sess.executor.pool.in_use == in_use   # the weights evaluation brought in went home again
    path = sess.save(tmp_path / "w.npz")
    fresh = train(NETS["densenet_tiny"](), "weights", fused=None, steps=0)
    fresh.load(path)
    for name, val in before.items():
        assert np.array_equal(fresh.executor.state_dict()[name], val), name
    text = explain(sess.plan)
    assert "homed on the host" in text and "host update" in text and "bytes moved per step" in text


def test_cli_reports_bytes_moved_by_role(capsys):
    args = ["plan", "resnet", "--depth", "20", "--batch", "2", "--image-size", "16", "--json"]
    assert main(args + ["--policy", "weights"]) == 0
    out = json.loads(capsys.readouterr().out)
    moved = out["moved_bytes_by_role"]
    assert moved["weights"] > 0 and moved["gradients"] > 0 and out["fused_update"]
    assert main(args + ["--policy", "liveness"]) == 0
    assert set(json.loads(capsys.readouterr().out)["moved_bytes_by_role"].values()) == {0}


@pytest.mark.parametrize("debug", [True, False])  # interpreted (debug) and the compiled step
def test_host_update_with_adam_is_bit_identical(debug):
    ref = train(NETS["resnet20"](), "none", fused=False, opt=Adam(lr=1e-3))
    got = train(NETS["resnet20"](), "weights", fused=None, opt=Adam(lr=1e-3), debug=debug)
    assert (got.executor.program is None) == debug
    same_state(got, ref)


def test_weights_on_device_keeps_auto_from_homing_them():
    """host_weights=False (`minidl plan --weights-on-device`, the papers' setting): below the training state auto
    refuses instead of homing weights on the host, naming the budget."""
    from minidl.core.errors import BudgetError

    net = NETS["resnet20"]()
    budget = net.route(optimizer_slots=("momentum",)).persistent_bytes() // 2
    assert host_homed(planned(NETS["resnet20"](), opt(), "auto", budget))
    with pytest.raises(BudgetError, match="too small for policy 'auto'"):
        planned(NETS["resnet20"](), opt(), "auto", budget, host_weights=False)
