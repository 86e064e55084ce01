"""Training in bf16 and fp16 (`--math`, `backend/precision.py`): what the route stores in half, the weight copies the
products read, the staging the plan gives the CPU's half kernels, fp16's loss scale (a step whose gradients overflow
is skipped, not a divergence; a non-finite loss or a scale that keeps falling is one) and an exact resume, the scale
included. The policy matrix within each mode is tests/runtime/test_runner_matrix.py's."""
from __future__ import annotations

import json

import numpy as np
import pytest

import minidl as dl
from minidl.backend.precision import HALF_DTYPES
from minidl.cli import main
from minidl.core.errors import DivergenceError, OptionError
from minidl.core.tensors import Role
from minidl.layers import ReLU
from minidl.memory.decisions.weights import moved_by_role
from minidl.memory.request import PlanRequest
from minidl.optim.loss_scale import LossScaler
from tests.memory import nets
from tests.memory.nets import NETS
from tests.planning import planned


def _session(math, policy="liveness", budget=None, key="resnet20", debug=False, scaler=None):
    net = NETS[key]()
    sess = dl.Session(net, nets.opt(), policy=policy, budget=budget, seed=3, math=math,
                      config=dl.RunConfig(debug=debug))
    if scaler is not None:
        sess.executor.scaler = scaler
    return sess, nets.data_for(net)


@pytest.mark.parametrize("math", ["bf16", "fp16"])
def test_the_route_stores_each_role_as_the_mode_says(math):
    half = HALF_DTYPES[math]
    route = NETS["resnet20"]().route(optimizer_slots=("momentum",), math=math)
    dtypes = {}
    for t in route.tensors.values():
        dtypes.setdefault(t.role, set()).add(np.dtype(t.dtype))
    assert dtypes[Role.ACTIVATION] == {half, np.dtype(np.float32)}   # float32: the loss's output alone
    assert [t.id for t in route.tensors.values() if t.role is Role.ACTIVATION and t.dtype == np.float32] == \
        ["act:loss"]
    assert dtypes[Role.DATA] == dtypes[Role.WEIGHT_COPY] == {half}
    for role in (Role.PARAMETER, Role.BUFFER, Role.GRADIENT, Role.OPTIMIZER, Role.AUX):
        assert dtypes[role] == {np.dtype(np.float32)}, role
    # one copy per conv and linear weight, read by its forward and backward, rewritten by the update
    assert sorted(route.copies) == sorted(f"param:{n.name}.{p}" for n in route.network.layer_nodes
                                          for p in n.params if p in n.layer.half_params)
    conv = route.network.node("conv1")
    for st in route.steps:
        if st.node == conv.index and st.phase.value != "update":
            assert "copy:conv1.weight" in st.reads and "param:conv1.weight" not in st.reads
    update = route.steps[-1]
    assert set(route.copies.values()) <= set(update.writes)
    assert all(st.staging in st.writes for st in route.steps if st.staging)
    assert route.steps[0].staging == "stage:conv1.fwd"


def test_a_tied_weight_is_read_through_its_owners_copy():
    from minidl.models import build_model

    net = build_model("gpt2", layers=1, heads=2, width=32, seq=8, batch=2, num_classes=64, tied=True)
    route = net.route(optimizer_slots=("m", "v"), math="bf16")
    head = net.logits_node
    owner, pname = head.tied["weight"]
    assert route.kernel_params(head)["weight"] == f"copy:{owner}.{pname}"
    # the owner (the embedding) reads its master in float32: its table is not a product's operand
    assert route.kernel_params(net.node(owner))[pname] == f"param:{owner}.{pname}"


def test_resnet50_b64_activations_take_half_the_bytes_in_bf16(capsys):
    """The goal's figure: `minidl plan` at batch 64 on the v100 profile, activations at the peak, exactly."""
    got = {}
    for math in ("fp32", "bf16"):
        assert main(["plan", "resnet", "--depth", "50", "--batch", "64", "--device", "v100", "--math", math,
                     "--json"]) == 0
        got[math] = json.loads(capsys.readouterr().out)["by_role"]["activation"]
    assert got == {"fp32": 5_292_163_072, "bf16": 2_646_081_536}


def test_a_layer_without_a_half_kernel_is_named_when_the_route_is_built():
    class Odd(ReLU):
        type_name = "odd"

        def kernels(self):
            return ("relu_forward", "odd_backward")

    net = dl.Network("odd")
    x = net.input((2, 4), name="x")
    y = net.input((2,), dtype="int64", name="y")
    net.set_loss(dl.layers.SoftmaxCrossEntropy(name="loss")(Odd(name="strange")(dl.layers.Linear(3)(x)), y))
    net.route(math="fp32")
    with pytest.raises(OptionError, match=r"--math bf16: layer 'strange' \(odd\) has no bf16 kernel on backend "
                                          r"'cpu' \(odd_backward\)"):
        net.route(math="bf16")


def test_the_half_modes_train_float32_networks_only():
    net = dl.Network("f64", dtype="float64")
    x = net.input((2, 4), name="x")
    y = net.input((2,), dtype="int64", name="y")
    net.set_loss(dl.layers.SoftmaxCrossEntropy(name="loss")(dl.layers.Linear(3)(x), y))
    with pytest.raises(OptionError, match="--math fp16: network 'f64' is float64"):
        net.route(math="fp16")


@pytest.mark.parametrize("kw, asked", [(dict(fused_update=True), "--fused-update on"),
                                       (dict(micro_batches=2), "--micro-batches"),
                                       (dict(policy="packs"), "--policy packs")])
def test_fp16_refuses_what_updates_layers_during_backward(kw, asked):
    with pytest.raises(OptionError, match=f"--math fp16 skips a step.*{asked} updates layers during backward"):
        PlanRequest.from_options(**{"policy": "liveness", **kw}, math="fp16")
    PlanRequest.from_options(**{"policy": "liveness", **kw}, math="bf16")
    assert not PlanRequest.from_options("auto", "1MiB", math="fp16").fused_update
    assert PlanRequest.from_options("auto", "1MiB", math="bf16").fused_update


@pytest.mark.parametrize("math, policy", [("bf16", "liveness"), ("bf16", "weights"), ("fp16", "liveness")])
def test_the_weight_copies_are_their_masters_rounded_after_every_update(math, policy):
    budget = int(planned(NETS["resnet20"](), nets.opt(), "liveness", math=math).min_budget_bytes * 0.6) \
        if policy == "weights" else None
    sess, data = _session(math, policy, budget)
    sess.fit(data, 3)
    ex = sess.executor
    homed = [c for c in ex.route.copies.values() if c not in ex.views]
    if policy == "weights":   # updated on the host, the copies homed there with their masters, visiting for reads
        assert any(sp.on_host for sp in sess.plan.steps) and homed
        assert moved_by_role(sess.plan)["weights"] == sum(ex.route.tensors[c].nbytes * 2 for c in homed)
    else:
        assert not homed
    state = ex.state_dict()
    for master, copy in ex.route.copies.items():
        name = master.partition(":")[2]
        want = state[name].astype(HALF_DTYPES[math])   # ml_dtypes and numpy round to nearest even
        got = ex.views[copy] if copy in ex.views else ex.host.host_copy(copy)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), copy


@pytest.mark.parametrize("math", ["bf16", "fp16"])
def test_the_cpus_half_kernels_stage_in_the_plans_tensors_only(math):
    """Every staged call ran on its step's planned staging: the backend never grew a buffer of its own."""
    sess, data = _session(math, "recompute", key="dropnet")
    sess.fit(data, 2)
    sess.evaluate(data)
    staging = sess.executor.be.staging
    assert staging.high_water > 0 and staging._own.nbytes == 0
    assert any(st.staging for st in sess.plan.route.steps)


def test_evaluation_gives_float32_logits():
    sess, data = _session("bf16")
    _, logits = sess.executor.evaluate(data.x[:2], data.y[:2])
    assert logits.dtype == np.float32 and logits.shape == (2, 10)


def _scaled(scale, **kw):
    return LossScaler(scale=scale, **kw)


@pytest.mark.parametrize("debug", [False, True])
def test_an_fp16_step_whose_gradients_overflow_is_skipped_and_the_scale_backs_off(debug):
    """At a scale of 2^28 the loss's gradient overflows fp16: nothing is updated, the scale halves, no error; the
    compiled step and the interpreter alike."""
    sess, data = _session("fp16", debug=debug, scaler=_scaled(2.0 ** 28))
    before = sess.executor.state_dict()
    opt_before = sess.executor.optimizer_state()
    sess.fit(data, 1)
    ex = sess.executor
    assert ex.step_runner == ("interpreted" if debug else "compiled")
    assert ex.iteration == 1 and ex.scaler.scale == 2.0 ** 27 and ex.scaler.skipped_in_a_row == 1
    for name, arr in ex.state_dict().items():
        if not name.endswith(("running_mean", "running_var")):   # the forward ran: BN's statistics moved
            assert np.array_equal(arr, before[name]), name
    for name, arr in ex.optimizer_state().items():
        assert np.array_equal(arr, opt_before[name]), name
    sess.fit(data, 30)   # backs off until the gradients fit, then trains
    assert ex.scaler.skipped_in_a_row == 0 and ex.scaler.scale < 2.0 ** 20
    assert any(not np.array_equal(arr, before[k]) for k, arr in ex.state_dict().items())


def test_fp16_steps_skipped_max_skips_in_a_row_are_a_divergence():
    sess, data = _session("fp16", scaler=_scaled(2.0 ** 100, max_skips=3))
    with pytest.raises(DivergenceError, match=r"step 2: the fp16 gradients overflowed 3 steps in a row, down to a "
                                              r"loss scale of 1.58\d+e\+29"):
        sess.fit(data, 5)
    assert sess.executor.iteration == 2


def test_a_nonfinite_loss_in_fp16_is_a_divergence_with_the_last_good_state():
    def run(steps):
        net = NETS["dropnet"]()
        sess = dl.Session(net, dl.SGD(lr=1e6, momentum=0.9), seed=3, math="fp16")
        return sess, sess.fit(nets.data_for(net), steps) if steps else None

    sess, _ = run(0)
    with pytest.raises(DivergenceError, match="the loss is") as e:
        sess.fit(nets.data_for(sess.net), 50)
    k = e.value.iteration
    ref, _ = run(k)
    for name, arr in ref.executor.state_dict().items():
        assert np.array_equal(sess.executor.state_dict()[name], arr), name
    assert sess.executor.scaler == ref.executor.scaler


@pytest.mark.parametrize("math", ["bf16", "fp16"])
def test_k_plus_m_steps_are_k_steps_saved_and_m_resumed(math, tmp_path):
    """In fp16 the scale starts where the gradients overflow and grows every 2 clean steps, so skipped steps come
    and go: the resumed run must continue the checkpoint's scale and counters."""
    scaler = (lambda: _scaled(2.0 ** 22, growth_interval=2)) if math == "fp16" else (lambda: None)
    whole, data = _session(math, scaler=scaler())
    losses = whole.fit(data, 8).losses
    first, _ = _session(math, scaler=scaler())
    part = first.fit(data, 4).losses
    first.save(tmp_path / "k.npz")
    resumed, _ = _session(math, scaler=scaler())
    resumed.load(tmp_path / "k.npz")
    assert part + resumed.fit(data, 4).losses == losses
    for name, arr in whole.executor.state_dict().items():
        assert np.array_equal(resumed.executor.state_dict()[name], arr), name
    for name, arr in whole.executor.optimizer_state().items():
        assert np.array_equal(resumed.executor.optimizer_state()[name], arr), name
    assert resumed.executor.scaler == whole.executor.scaler
    if math == "fp16":
        assert first.executor.scaler.skipped_in_a_row or whole.executor.scaler.scale != 2.0 ** 22

