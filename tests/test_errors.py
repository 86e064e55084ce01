"""Every row of issue 14's table of user mistakes gives one clean `MinidlError` naming the layer, option, file or
values, raised as early as possible (or, where the input is valid, a correct result). Checkpoint rows are in
tests/runtime/test_checkpoint.py, divergence in tests/runtime/test_divergence.py, BN accuracy in
tests/layers/test_batchnorm_numerics.py."""
from __future__ import annotations

import numpy as np
import pytest

import minidl as dl
from minidl.cli import main
from minidl.core import guards
from minidl.core.errors import CheckpointError, DataError, GraphError, HostMemoryError, MinidlError, OptionError
from minidl.data import Dataset
from minidl.layers import LRN, AvgPool2d, BatchNorm2d, Conv2d, Dropout, Flatten, Linear, MaxPool2d, SoftmaxCrossEntropy
from minidl.optim import SGD, Adam
from tests.planning import planned
from tests.sessions import session_kw


def _net(body, shape=(4, 3, 8, 8), classes=5):
    net = dl.Network("t")
    x = net.input(shape, name="data")
    y = net.input((shape[0],), dtype="int64", name="label")
    h = body(x)
    net.set_loss(SoftmaxCrossEntropy(name="loss")(Linear(classes, name="fc")(Flatten(name="flat")(h)), y))
    return net


@pytest.mark.parametrize("make,words", [
    (lambda: Conv2d(3.9, 3), ["Conv2d", "out_channels", "3.9"]),
    (lambda: Linear(2.9), ["Linear", "out_features", "2.9"]),
    (lambda: Conv2d(4, 2.5), ["Conv2d", "kernel_size", "2.5"]),
    (lambda: Conv2d(4, None), ["Conv2d", "kernel_size", "None"]),
    (lambda: Conv2d(4, 3, stride=0, name="c7"), ["Conv2d 'c7'", "stride", "0"]),
    (lambda: Conv2d(4, 3, groups=True), ["groups", "True"]),
    (lambda: Conv2d(4, (3, 3, 3)), ["kernel_size", "(3, 3, 3)"]),
    (lambda: Dropout(1.0), ["Dropout", "p", "1.0"]),
    (lambda: Dropout(float("nan")), ["Dropout", "p", "nan"]),
    (lambda: BatchNorm2d(momentum=1.5), ["BatchNorm2d", "momentum", "1.5"]),
    (lambda: BatchNorm2d(eps=0), ["BatchNorm2d", "eps", "0"]),
    (lambda: BatchNorm2d(affine="no"), ["affine", "'no'"]),
    (lambda: MaxPool2d(2, stride=-1), ["MaxPool2d", "stride", "-1"]),
    (lambda: AvgPool2d(0), ["AvgPool2d", "kernel_size", "0"]),
    (lambda: LRN(size=2.5), ["LRN", "size", "2.5"]),
    (lambda: LRN(k=0), ["LRN", "k", "0"]),
])
def test_hyper_parameters_are_checked_at_construction(make, words):
    with pytest.raises(OptionError) as e:
        make()
    for w in words:
        assert w in str(e.value)


def test_integer_valued_hyper_parameters_of_numpy_type_are_accepted():
    c = Conv2d(np.int64(4), (np.int32(3), 3), bias=np.bool_(False))
    assert c.out_channels == 4 and c.kernel_size == (3, 3) and c.bias is False


def test_maxpool_window_entirely_in_padding_is_refused_at_build():
    with pytest.raises(GraphError) as e:
        _net(lambda x: MaxPool2d(2, stride=1, padding=1, dilation=2, name="mp")(x), shape=(2, 3, 1, 1))
    assert "'mp'" in str(e.value) and "padding" in str(e.value)
    # the same window on an input where every window sees a value builds (and PyTorch agrees on the shape)
    _net(lambda x: MaxPool2d(2, stride=1, padding=1, dilation=2, name="mp")(x), shape=(2, 3, 8, 8))


def test_huge_pooling_kernel_is_refused_at_build():
    """It used to build, then spend 71 s growing scratch into a MemoryError: a GraphError at build is the fix."""
    with pytest.raises(GraphError) as e:
        _net(lambda x: AvgPool2d(100000, ceil_mode=True, name="ap")(x))
    assert "'ap'" in str(e.value) and "100000" in str(e.value)


def test_batchnorm_with_one_value_per_channel_is_refused_before_planning():
    net = _net(lambda x: BatchNorm2d(name="bn")(x), shape=(1, 3, 1, 1))  # evaluation alone would be fine
    with pytest.raises(GraphError) as e:
        dl.Session(net, SGD(0.1))
    assert "'bn'" in str(e.value) and "one value per channel" in str(e.value)


@pytest.mark.parametrize("policy", ["liveness", "packs"])
def test_batchnorm_with_one_value_per_channel_in_a_micro_batch_is_refused_when_planning(policy):
    """Two samples of one value per channel train as one batch, not as two micro-batches of one: refused while
    planning, as the whole-batch case is, not by the CPU kernel at the first step."""
    from minidl.graph.packs import PackError

    net = _net(lambda x: BatchNorm2d(name="bn")(x), shape=(2, 3, 1, 1))
    with pytest.raises(PackError) as e:
        dl.Session(net, SGD(0.1), policy=policy, micro_batches=2)
    assert all(w in str(e.value) for w in ("2 micro-batches of the batch of 2", "'bn'", "(1, 3, 1, 1)",
                                           "one value per channel", "give fewer micro-batches")), str(e.value)
    sess = dl.Session(_net(lambda x: BatchNorm2d(name="bn")(x), shape=(2, 3, 1, 1)), SGD(0.1), policy=policy,
                      micro_batches=1)
    assert np.isfinite(sess.executor.train_step(np.arange(6, dtype=np.float32).reshape(2, 3, 1, 1), np.array([0, 1])))


def test_batchnorm_without_affine_on_the_data_trains():
    """Nothing trainable before or in the BN: its backward does not run, but its training forward still writes
    the batch statistics (was KeyError 'mean' at the first step)."""
    net = _net(lambda x: Conv2d(4, 3, padding=1, name="conv")(BatchNorm2d(affine=False, name="bn0")(x)))
    for policy in ("none", "liveness", "recompute", "offload"):
        sess = dl.Session(net, SGD(0.1), policy=policy)
        x = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
        loss = sess.executor.train_step(x, np.array([0, 1, 2, 3]))
        assert np.isfinite(loss)
        rm = sess.executor.state_dict()["bn0.running_mean"]
        np.testing.assert_allclose(rm, 0.1 * x.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("label", [-1, 5])
def test_labels_out_of_range(label):
    x = np.zeros((4, 3, 8, 8), np.float32)
    y = np.array([0, 1, 2, label])
    with pytest.raises(DataError) as e:
        Dataset(x, y, num_classes=5)
    assert str(label) in str(e.value)
    sess = dl.Session(_net(lambda x: Conv2d(2, 3, name="conv")(x)), SGD(0.1))
    with pytest.raises(DataError) as e:
        sess.executor.train_step(x, y)
    assert f"label {label}" in str(e.value) and "[0, 5)" in str(e.value)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e39])
def test_non_finite_data_is_refused_when_the_dataset_is_made(bad):
    x = np.zeros((4, 3, 8, 8), np.float64)
    x[2, 1, 3, 4] = bad
    with pytest.raises(DataError) as e:
        Dataset(x, np.zeros(4, np.int64), num_classes=2, name="mine")
    assert "mine" in str(e.value) and "sample 2" in str(e.value)


def test_an_arena_larger_than_host_memory_fails_before_allocating(monkeypatch):
    monkeypatch.setattr(guards, "available_host_bytes", lambda: 4096)
    with pytest.raises(HostMemoryError) as e:
        dl.Session(_net(lambda x: Conv2d(2, 3, name="conv")(x)), SGD(0.1))
    assert "available" in str(e.value) and "--budget" in str(e.value)


@pytest.mark.parametrize("make,words", [
    (lambda: SGD(lr=float("nan")), ["SGD", "lr", "nan"]),
    (lambda: SGD(lr=float("inf")), ["SGD", "lr", "inf"]),
    (lambda: SGD(lr=0.1, weight_decay=float("nan")), ["weight_decay", "nan"]),
    (lambda: SGD(lr=0.1, momentum=-0.5), ["momentum", "-0.5"]),
    (lambda: Adam(lr=float("nan")), ["Adam", "lr"]),
    (lambda: Adam(eps=0.0), ["Adam", "eps"]),
    (lambda: Adam(betas=(0.9, 1.0)), ["Adam", "betas"]),
])
def test_optimizer_values_are_finite(make, words):
    with pytest.raises(OptionError) as e:
        make()
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("argv,words", [
    (["--lr", "inf"], ["--lr", "inf"]),
    (["--lr", "nan"], ["--lr", "nan"]),
    (["--lr", "-1"], ["--lr", "-1"]),
    (["--weight-decay", "nan"], ["--weight-decay", "nan"]),
    (["--momentum", "1.5"], ["--momentum", "1.5"]),
    (["--steps", "0"], ["--steps", "0"]),
    (["--steps", "-3"], ["--steps", "-3"]),
    (["--batch", "0"], ["--batch", "0"]),
    (["--save", "."], ["--save", "directory"]),
    (["--save", "/nonexistent-dir/x.npz"], ["--save", "does not exist"]),
    (["--resume", "/nonexistent.npz"], ["--resume", "/nonexistent.npz"]),
])
def test_cli_values_give_one_line_and_status_2(capsys, argv, words):
    try:  # refused by argparse's type check (SystemExit) or by the checks after parsing (a return status)
        status = main(["train", "lenet", "--batch", "4", "--steps", "1", "--no-progress", *argv])
    except SystemExit as e:
        status = e.code
    assert status == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minidl: error: "), captured.err
    for w in words:
        assert w in lines[0]
    assert captured.out == ""  # nothing trained, nothing printed


def test_cli_debug_shows_the_traceback(capsys):
    """--debug adds the traceback to the error's line and keeps the exit status docs/cli.md gives."""
    assert main(["train", "lenet", "--lr", "nan", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "OptionError" in err and "minidl: error:" in err
    assert main(["info", "nosuchnet", "--debug"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def _tiny_session(**kw):
    from minidl.models import build_model

    net = build_model("lenet", batch=4, image_size=8, in_channels=1, num_classes=10)
    return dl.Session(net, SGD(0.1), **session_kw(kw))


def _user_mistakes():
    """(what a user wrote, the error class, words the message must hold): one row per user-facing check that
    used to raise a plain ValueError/TypeError/KeyError through the Python API."""
    from minidl.backend import get_backend
    from minidl.backend.cpu.backend import CPUBackend
    from minidl.data import BatchIterator, synthetic
    from minidl.memory.calibrate import measured_profile
    from minidl.memory.report.explain import parse_steps
    from minidl.memory.simulate import get_profile
    from minidl.models import build_model
    from minidl.runtime.executor import Executor

    tiny = _tiny_session
    return [
        (lambda: tiny().fit(synthetic(8, (3, 8, 8), 10), 1), DataError, ["(3, 8, 8)", "(1, 8, 8)", "'data'"]),
        (lambda: tiny(policy="fastest"), OptionError, ["unknown policy", "'fastest'"]),
        (lambda: planned(_net(lambda x: x), SGD(0.1), "fastest"), OptionError, ["unknown policy"]),
        (lambda: dl.parse_size("lots"), OptionError, ["'lots'"]),
        (lambda: dl.parse_size(-1), OptionError, ["negative", "-1"]),
        (lambda: dl.parse_size(1.5), OptionError, ["1.5"]),
        (lambda: dl.parse_size("3 parsecs"), OptionError, ["unknown unit", "parsecs"]),
        (lambda: get_profile("k99"), OptionError, ["unknown device profile", "'k99'"]),
        (lambda: get_profile("k40c:lots"), OptionError, ["'k40c:lots'"]),
        (lambda: get_backend("tpu"), OptionError, ["unknown backend", "'tpu'"]),
        (lambda: SGD(0.1, nesterov=True), OptionError, ["nesterov"]),
        (lambda: build_model("resnet", depth=21), OptionError, ["resnet", "21"]),
        (lambda: build_model("vgg", depth=12), OptionError, ["vgg", "12"]),
        (lambda: build_model("lenet", image_size=3), OptionError, ["lenet", "image_size", "3"]),
        (lambda: build_model("alexnet", image_size=100), OptionError, ["alexnet", "100"]),
        (lambda: build_model("densenet", depth=122), OptionError, ["densenet", "122"]),
        (lambda: build_model("densenet", variant="tiny", compression=0), OptionError, ["compression", "0"]),
        (lambda: build_model("inception_v4", image_size=64), OptionError, ["inception_v4", "64"]),
        (lambda: _net(lambda x: x).node("nope"), GraphError, ["no node named 'nope'", "'t'"]),
        (lambda: tiny().fit(synthetic(8, (1, 8, 8), 10), 1, save_every=2), OptionError, ["save_every", "save_path"]),
        (lambda: tiny().fit(synthetic(8, (1, 8, 8), 10), 1, save_every=1.5, save_path="x.npz"), OptionError,
         ["save_every", "1.5"]),
        (lambda: synthetic(8, (1, 4, 4), 2).split(True), DataError, ["bool"]),
        (lambda: synthetic(8, (1, 4, 4), 2).split("half"), DataError, ["str"]),
        (lambda: BatchIterator([1, 2, 3], 2), DataError, ["Dataset", "list"]),
        (lambda: tiny().executor.load_state_dict({}), CheckpointError, ["missing"]),
        (lambda: tiny().executor.load_state_dict({"conv1.weight": np.zeros(3)}, strict=False), CheckpointError,
         ["conv1.weight", "(3,)"]),
        (lambda: Executor(_net(lambda x: x), tiny().plan, SGD(0.1)), OptionError, ["another network"]),
        (lambda: parse_steps("5"), OptionError, ["--explain-steps", "'5'"]),
        (lambda: parse_steps("9:3"), OptionError, ["--explain-steps", "'9:3'"]),
        (lambda: measured_profile(CPUBackend()), OptionError, ["cannot measure a host link"]),
        (lambda: tiny(paged=1000), OptionError, ["1000"]),
    ]


def test_user_facing_mistakes_through_the_python_api_are_minidl_errors():
    """The README promises every mistake is a MinidlError: walk the user-facing checks outside layers (whose
    hyper-parameters the test above walks) and the CLI (whose exits the test below walks)."""
    for make, cls, words in _user_mistakes():
        with pytest.raises(MinidlError) as e:
            make()
        assert isinstance(e.value, cls), (type(e.value).__name__, str(e.value))
        for w in words:
            assert w in str(e.value), (w, str(e.value))
