"""Property tests: random layer configurations against PyTorch (float64 values and gradients), and random
invalid definitions, which must give a `MinidlError` and nothing else. Examples per property: `--fuzz-examples N`
(default 12, derandomized, so the default run is fast and repeatable)."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import minidl as dl
from minidl.core.errors import GraphError, MinidlError
from minidl.layers import LRN, AvgPool2d, BatchNorm2d, Conv2d, Dropout, Linear, MaxPool2d
from minidl.testing import run_layer

FUZZ = settings.get_profile("minidl-fuzz")


def _close(a, b, what):
    scale = max(1.0, float(np.abs(b).max()) if b.size else 1.0)
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10 * scale, err_msg=what)


@FUZZ
@given(n=st.integers(1, 3), cin_g=st.integers(1, 3), cout_g=st.integers(1, 3), groups=st.integers(1, 2),
       h=st.integers(1, 9), w=st.integers(1, 9), k=st.integers(1, 4), kw=st.integers(1, 4), stride=st.integers(1, 3),
       pad=st.integers(0, 2), dil=st.integers(1, 2), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_conv_matches_torch(n, cin_g, cout_g, groups, h, w, k, kw, stride, pad, dil, bias, seed):
    cin, cout = cin_g * groups, cout_g * groups
    assume(h + 2 * pad >= dil * (k - 1) + 1 and w + 2 * pad >= dil * (kw - 1) + 1)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, cin, h, w))
    wt = rng.standard_normal((cout, cin_g, k, kw))
    params = {"weight": wt}
    if bias:
        params["bias"] = rng.standard_normal(cout)
    layer = Conv2d(cout, (k, kw), stride=stride, padding=pad, dilation=dil, groups=groups, bias=bias)
    tx = torch.tensor(x, requires_grad=True)
    tw = torch.tensor(wt, requires_grad=True)
    tb = torch.tensor(params["bias"], requires_grad=True) if bias else None
    ty = F.conv2d(tx, tw, tb, stride, pad, dil, groups)
    dy = rng.standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(dy))
    run = run_layer(layer, [x], params, dout=dy)
    _close(run.out, ty.detach().numpy(), "out")
    _close(run.dinputs[0], tx.grad.numpy(), "dx")
    _close(run.grads["weight"], tw.grad.numpy(), "dweight")
    if bias:
        _close(run.grads["bias"], tb.grad.numpy(), "dbias")


@FUZZ
@given(kind=st.sampled_from(["max", "avg"]), n=st.integers(1, 2), c=st.integers(1, 3), h=st.integers(1, 9),
       w=st.integers(1, 9), k=st.integers(1, 4), stride=st.integers(1, 3), pad=st.integers(0, 2),
       dil=st.integers(1, 3), ceil=st.booleans(), incl=st.booleans(), seed=st.integers(0, 2**16))
def test_pooling_matches_torch_or_is_refused_with_a_reason(kind, n, c, h, w, k, stride, pad, dil, ceil, incl, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w))
    if kind == "max":
        layer = MaxPool2d(k, stride, pad, dilation=dil, ceil_mode=ceil)
        fn = lambda t: F.max_pool2d(t, k, stride, pad, dil, ceil)
    else:
        layer = AvgPool2d(k, stride, pad, ceil_mode=ceil, count_include_pad=incl)
        fn = lambda t: F.avg_pool2d(t, k, stride, pad, ceil, incl)
    tx = torch.tensor(x, requires_grad=True)
    try:
        ty = fn(tx)
        torch_ok = bool(torch.isfinite(ty).all())
    except RuntimeError:
        torch_ok = False
    try:
        net = dl.Network("p", dtype="float64")
        layer(net.input(x.shape))
    except GraphError:
        return  # refused at build, with a message (stricter than PyTorch where PyTorch outputs -inf or NaN)
    assert torch_ok, "minidl built a pooling that PyTorch refuses or that outputs non-finite values"
    dy = rng.standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(dy))
    run = run_layer(type(layer)(k, stride, pad, **({"dilation": dil, "ceil_mode": ceil} if kind == "max" else
                                                    {"ceil_mode": ceil, "count_include_pad": incl})), [x], {},
                    dout=dy)
    _close(run.out, ty.detach().numpy(), "out")
    _close(run.dinputs[0], tx.grad.numpy(), "dx")


@FUZZ
@given(n=st.integers(1, 4), c=st.integers(1, 3), h=st.integers(1, 4), w=st.integers(1, 4),
       ratio=st.sampled_from([0.0, 1.0, 100.0]), affine=st.booleans(), seed=st.integers(0, 2**16))
def test_batchnorm_matches_torch(n, c, h, w, ratio, affine, seed):
    assume(n * h * w >= 2)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)) + ratio
    p = {"running_mean": np.zeros(c), "running_var": np.ones(c)}
    if affine:
        p["weight"], p["bias"] = rng.uniform(0.5, 1.5, c), rng.standard_normal(c)
    tx = torch.tensor(x, requires_grad=True)
    tw = torch.tensor(p["weight"], requires_grad=True) if affine else None
    tb = torch.tensor(p["bias"], requires_grad=True) if affine else None
    ty = F.batch_norm(tx, torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64), tw, tb, True)
    dy = rng.standard_normal(x.shape)
    ty.backward(torch.tensor(dy))
    run = run_layer(BatchNorm2d(affine=affine), [x], p, dout=dy)
    _close(run.out, ty.detach().numpy(), "out")
    np.testing.assert_allclose(run.dinputs[0], tx.grad.numpy(), rtol=1e-7, atol=1e-9, err_msg="dx")
    if affine:
        _close(run.grads["weight"], tw.grad.numpy(), "dweight")
        _close(run.grads["bias"], tb.grad.numpy(), "dbias")


_WEIRD = st.one_of(st.integers(-3, 6), st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.none(), st.booleans(), st.text(max_size=3),
                   st.tuples(st.integers(-1, 4), st.integers(-1, 4)),
                   st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)),
                   st.just(np.int64(2)), st.just(float("nan")), st.just(2.5))

_LAYERS = {
    Conv2d: ["out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "bias"],
    MaxPool2d: ["kernel_size", "stride", "padding", "dilation", "ceil_mode"],
    AvgPool2d: ["kernel_size", "stride", "padding", "ceil_mode", "count_include_pad"],
    BatchNorm2d: ["momentum", "eps", "affine"],
    Linear: ["out_features", "bias"],
    Dropout: ["p"],
    LRN: ["size", "alpha", "beta", "k"],
}


@FUZZ
@given(data=st.data(), cls=st.sampled_from(sorted(_LAYERS, key=lambda c: c.__name__)),
       shape=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 6), st.integers(1, 6)))
def test_invalid_definitions_give_minidl_errors_only(data, cls, shape):
    names = _LAYERS[cls]
    chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    kwargs = {name: data.draw(_WEIRD, label=name) for name in chosen}
    required = {Conv2d: ("out_channels", "kernel_size"), MaxPool2d: ("kernel_size",), AvgPool2d: ("kernel_size",),
                Linear: ("out_features",)}.get(cls, ())
    for r in required:
        kwargs.setdefault(r, 2)
    try:
        layer = cls(**kwargs)
        net = dl.Network("f")
        x = net.input(shape, name="data")
        y = net.input((shape[0],), dtype="int64", name="label")
        h = layer(x)
        h = dl.layers.Linear(3, name="head")(dl.layers.Flatten(name="flat")(h) if len(h.shape) > 2 else h)
        net.set_loss(dl.layers.SoftmaxCrossEntropy(name="loss")(h, y))
        dl.Session(net, dl.SGD(0.1))  # plan and allocate: shape and training checks included
    except MinidlError as e:
        assert str(e), "an error without a message"
        return
    # accepted: every numeric hyper-parameter it kept is finite
    for v in vars(layer).values():
        if isinstance(v, float):
            assert math.isfinite(v)
