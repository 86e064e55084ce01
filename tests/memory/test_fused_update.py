"""Fused update: each layer's optimizer update right after its backward. Same arithmetic as the one update step
at the end (bit-identical parameters and optimizer state: with Adam here, with SGD under every policy in
tests/runtime/test_policy_matrix.py, runner `fused`), and gradients live only between backward and update."""
import pytest

from minidl.cli import main
from minidl.core.tensors import Role
from minidl.graph.route import Phase
from minidl.memory.liveness import analyze
from minidl.memory.planner import live_at
from minidl.models import build_model
from minidl.optim import SGD, Adam
from tests import sessions
from tests.planning import planned
from tests.sessions import same_state

from .nets import vgg11_narrow

NETS = {
    "resnet20": lambda: build_model("resnet", depth=20, batch=2, image_size=16, num_classes=10),
    "vgg11": vgg11_narrow,
    "densenet_tiny": lambda: build_model("densenet", variant="tiny", batch=2, image_size=16, num_classes=10),
}


def train(net, policy, fused, opt=None, steps=3, budget=None, **kw):
    return sessions.train(net, policy, budget, steps, seed=0, optimizer=opt, fused_update=fused, **kw)


def test_fused_update_with_adam_is_bit_identical():
    ref = train(NETS["resnet20"](), "none", fused=False, opt=Adam(lr=1e-3))
    got = train(NETS["resnet20"](), "liveness", fused=True, opt=Adam(lr=1e-3), debug=True)
    same_state(got, ref)


def test_each_layer_is_updated_right_after_its_backward_and_its_gradients_die_there():
    net = NETS["resnet20"]()
    route = net.route(optimizer_slots=("momentum",), fused_update=True)
    updates = [s for s in route.steps if s.phase is Phase.UPDATE]
    trainable = [n for n in net.layer_nodes if any(p.trainable for p in n.params.values())]
    assert len(updates) == len(trainable)
    iv = analyze(route)
    for u in updates:
        bwd = route.steps[u.index - 1]
        assert bwd.phase is Phase.BACKWARD and bwd.node == u.node and u.label == f"update {u.name}"
        for tid in u.reads:
            if route.tensors[tid].role is Role.GRADIENT:
                assert (iv[tid].first, iv[tid].last) == (bwd.index, u.index)


@pytest.mark.parametrize("key", list(NETS))
def test_fused_update_lowers_the_liveness_peak(key):
    opt = SGD(lr=0.1, momentum=0.9)
    sep = planned(NETS[key](), opt, "liveness", fused_update=False)
    fused = planned(NETS[key](), opt, "liveness", fused_update=True)
    grads = sum(t.nbytes for t in sep.route.tensors.values() if t.role is Role.GRADIENT)
    assert fused.peak_bytes < sep.peak_bytes
    # Separate update: every gradient is live at the update step; fused: at most one layer's at any step.
    assert {t for t in live_at(sep, len(sep.steps) - 1) if t.startswith("grad:")} == set(
        t.id for t in sep.route.tensors.values() if t.role is Role.GRADIENT)
    most = max(sum(fused.route.tensors[t].nbytes for t in live_at(fused, k) if t.startswith("grad:"))
               for k in range(len(fused.steps)))
    per_layer = max(sum(t.nbytes for t in fused.route.tensors.values() if t.role is Role.GRADIENT and t.owner == n)
                    for n in {t.owner for t in fused.route.tensors.values()})
    assert most == per_layer < grads


def test_auto_chooses_fused_update_under_a_budget():
    net = NETS["densenet_tiny"]()
    budget = planned(net, SGD(lr=0.1, momentum=0.9), "liveness").min_budget_bytes
    assert planned(net, SGD(lr=0.1, momentum=0.9), "auto").route.fused_update is False
    assert planned(NETS["densenet_tiny"](), SGD(lr=0.1, momentum=0.9), "auto", budget).route.fused_update


def test_cli_fused_update_flag(capsys):
    import json

    args = ["plan", "resnet", "--depth", "20", "--batch", "2", "--image-size", "16", "--json"]
    assert main(args + ["--fused-update", "on"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert main(args + ["--fused-update", "off"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert on["fused_update"] and not off["fused_update"]
    assert on["peak_bytes"] < off["peak_bytes"]


@pytest.mark.slow
def test_real_vgg11_fused_update_is_bit_identical():
    def make():
        return build_model("vgg", depth=11, batch=1, image_size=224, num_classes=10)
    ref = train(make(), "none", fused=False, steps=2)
    got = train(make(), "liveness", fused=True, steps=2)
    same_state(got, ref)
