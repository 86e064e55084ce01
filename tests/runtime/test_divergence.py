"""Divergence loses nothing: a non-finite loss or gradient is caught after backward and before the update, the
step is not applied (parameters, optimizer state and BN running statistics stay those of the last good step),
and the error names the step and the first layer, in backward order, whose gradient is not finite."""
from __future__ import annotations

import json

import numpy as np
import pytest

import minidl as dl
from minidl.cli import main
from minidl.core.errors import DivergenceError
from minidl.data import synthetic
from minidl.layers import BatchNorm2d, Conv2d, Flatten, Linear, ReLU, SoftmaxCrossEntropy
from minidl.optim import SGD
from minidl.runtime.checkpoint import load_checkpoint


def _net():
    net = dl.Network("div")
    x = net.input((4, 3, 8, 8), name="data")
    y = net.input((4,), dtype="int64", name="label")
    h = ReLU(name="relu")(BatchNorm2d(name="bn")(Conv2d(4, 3, padding=1, name="conv")(x)))
    h = Linear(8, name="fc1")(Flatten(name="flat")(h))
    net.set_loss(SoftmaxCrossEntropy(name="loss")(Linear(3, name="fc2")(h), y))
    return net


def _data():
    return synthetic(64, (3, 8, 8), 3, seed=0)


@pytest.mark.parametrize("policy, debug", [("none", False), ("recompute", False), ("none", True),
                                           ("recompute", True), ("weights", False), ("weights", True)])
def test_a_diverging_run_stops_before_the_update_with_the_last_good_state(policy, debug):
    """On the compiled step and on the interpreter (debug mode), with the update on the device and on the host
    (`weights`: parameters and optimizer state homed on the host, updated there)."""
    lr = 1e8  # diverges within a few steps
    sess = dl.Session(_net(), SGD(lr, momentum=0.9), policy=policy, config=dl.RunConfig(debug=debug))
    with pytest.raises(DivergenceError) as e:
        sess.fit(_data(), 50)
    assert sess.executor.step_runner == ("interpreted" if debug else "compiled")
    if policy == "weights":
        assert any(sp.on_host for sp in sess.plan.steps)
    k = e.value.iteration
    assert f"step {k}" in str(e.value) and e.value.layer in str(e.value)
    assert sess.executor.iteration == k and sess.batches_consumed == k
    # an identical run stopped just before step k has exactly these parameters, buffers and optimizer state
    ref = dl.Session(_net(), SGD(lr, momentum=0.9), policy=policy, config=dl.RunConfig(debug=debug))
    ref.fit(_data(), k)
    for name, arr in ref.executor.state_dict().items():
        np.testing.assert_array_equal(sess.executor.state_dict()[name], arr, err_msg=name)
    for name, arr in ref.executor.optimizer_state().items():
        np.testing.assert_array_equal(sess.executor.optimizer_state()[name], arr, err_msg=name)
    # the executor is left usable: its pool holds only the persistent tensors, evaluation runs
    assert sess.executor.pool.in_use == ref.executor.pool.in_use
    sess.evaluate(_data())


def test_the_first_layer_in_backward_order_is_named():
    sess = dl.Session(_net(), SGD(0.1))
    ex = sess.executor
    w = ex.views["param:fc1.weight"] if "param:fc1.weight" in ex.views else None
    if w is None:
        from minidl.core.tensors import param_id
        w = ex.views[param_id("fc1", "weight")]
    w[0, 0] = np.inf  # fc1's output and everything downstream is inf/nan; fc2 is backward's first layer
    x, y = _data().x[:4], _data().y[:4]
    with pytest.raises(DivergenceError) as e:
        ex.train_step(x, y)
    assert e.value.layer == "fc2" and e.value.iteration == 0
    assert "fc2." in str(e.value)


def test_cli_diverging_run_exits_3_with_one_line_and_saves_the_last_good_state(capsys, tmp_path):
    ckpt = tmp_path / "last.npz"
    argv = ["train", "lenet", "--data", "digits", "--batch", "8", "--steps", "20", "--lr", "1e6", "--no-progress"]
    assert main([*argv, "--save", str(ckpt)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minidl: error: step ") and str(ckpt) in err[0]
    params, _, meta = load_checkpoint(ckpt)
    k = meta["iteration"]
    assert all(np.isfinite(v).all() for v in params.values())
    # the saved state is the state after k good steps: a run of exactly k steps saves the same arrays
    ref = tmp_path / "ref.npz"
    assert main([*argv[:-5], "--steps", str(k), "--lr", "1e6", "--no-progress", "--save", str(ref), "--json"]) == 0
    json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rparams, _, rmeta = load_checkpoint(ref)
    assert rmeta["batches_consumed"] == meta["batches_consumed"] == k
    for name, arr in rparams.items():
        np.testing.assert_array_equal(params[name], arr, err_msg=name)


@pytest.mark.parametrize("policy, compiled, fused", [("none", True, False), ("none", False, False),
                                                     ("none", True, True), ("recompute", True, False),
                                                     ("compress", True, False), ("compress", False, False)])
def test_a_huge_finite_input_that_overflows_a_running_statistic_stops_the_step(policy, compiled, fused):
    """1e30 is finite, and so are the convolution's outputs, the loss and the gradients (BN's inverse deviation
    is 0), but the running variance overflows to inf: the step is stopped before its update, naming the
    statistic, and the last good step's statistics remain (the compiled step and the interpreted one alike)."""
    data = _data()
    sess = dl.Session(_net(), SGD(0.01, momentum=0.9), policy=policy,
                      config=dl.RunConfig(compiled=compiled, fused_update=fused))
    ex = sess.executor
    ex.train_step(data.x[:4], data.y[:4])
    before, opt_before = ex.state_dict(), ex.optimizer_state()
    huge = np.full_like(data.x[4:8], 1e30)
    with pytest.raises(DivergenceError) as e:
        ex.train_step(huge, data.y[4:8])
    assert e.value.layer == "bn" and e.value.iteration == 1
    assert "step 1: the running statistic bn.running_var is not finite" in str(e.value)
    assert ex.iteration == 1
    for name, arr in ex.state_dict().items():
        np.testing.assert_array_equal(arr, before[name], err_msg=name)
    if not fused:
        for name, arr in ex.optimizer_state().items():
            np.testing.assert_array_equal(arr, opt_before[name], err_msg=name)
    ex.train_step(data.x[8:12], data.y[8:12])  # and training goes on from the last good state
    assert ex.iteration == 2 and all(np.isfinite(v).all() for v in ex.state_dict().values())
