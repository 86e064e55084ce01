"""MaxPool2d, AvgPool2d and GlobalAvgPool against PyTorch (float32) and finite differences (float64)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minidl as dl
from minidl.layers import AvgPool2d, GlobalAvgPool, MaxPool2d
from minidl.testing import directional_gradcheck, run_layer

# (input shape, kernel, stride, padding, dilation, ceil_mode)
MAX_CONFIGS = [
    ((2, 3, 8, 8), 2, None, 0, 1, False),
    ((2, 4, 7, 9), 3, 2, 1, 1, False),
    ((2, 4, 7, 9), 3, 2, 1, 1, True),
    ((1, 2, 11, 10), 3, 2, 0, 1, True),
    ((2, 3, 10, 13), (3, 2), (2, 1), (1, 0), 1, False),
    ((2, 2, 9, 9), 3, 1, 1, 2, False),
    ((2, 2, 12, 11), (3, 3), (2, 3), (1, 1), (2, 1), True),
    ((1, 3, 5, 5), 5, 1, 2, 1, False),
    ((3, 2, 6, 6), 1, 2, 0, 1, False),
    ((2, 1, 13, 13), 4, 3, 2, 1, True),
    ((1, 1, 3, 3), 3, 3, 1, 1, True),
    ((2, 64, 28, 28), 3, 2, 1, 1, False),  # the ResNet stem shape, scaled down; spans several kernel blocks
]


def _dy(shape, seed=1, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _torch_grad(fn, x, dy):
    xt = torch.tensor(x, requires_grad=True)
    yt = fn(xt)
    yt.backward(torch.tensor(dy))
    return yt.detach().numpy(), xt.grad.numpy()


def _distinct(shape, seed=0):
    """A random permutation of well-separated values: no ties, so max-pool is differentiable there."""
    n = int(np.prod(shape))
    return (np.random.default_rng(seed).permutation(n).reshape(shape) * 0.01 - n * 0.005).astype(np.float64)


@pytest.mark.parametrize("shape,k,s,p,d,ceil", MAX_CONFIGS)
def test_maxpool_matches_torch(shape, k, s, p, d, ceil):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    layer = MaxPool2d(k, s, p, d, ceil)
    out_shape = run_layer(MaxPool2d(k, s, p, d, ceil), [x]).out.shape
    dy = _dy(out_shape)
    run = run_layer(layer, [x], dout=dy)
    ty, tdx = _torch_grad(lambda t: F.max_pool2d(t, k, s if s is not None else k, p, d, ceil_mode=ceil), x, dy)
    assert run.out.shape == ty.shape
    np.testing.assert_array_equal(run.out, ty)
    np.testing.assert_allclose(run.dinputs[0], tdx, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k,s,p", [(3, 2, 1), (2, 2, 0), (3, 1, 1)])
def test_maxpool_ties_go_to_first_max_like_torch(k, s, p):
    # Post-ReLU-like data: many zeros and repeated small integers, so most windows hold ties.
    x = np.maximum(np.random.default_rng(3).integers(-3, 3, size=(2, 3, 9, 9)), 0).astype(np.float32)
    out_shape = run_layer(MaxPool2d(k, s, p), [x]).out.shape
    dy = _dy(out_shape)
    run = run_layer(MaxPool2d(k, s, p), [x], dout=dy)
    ty, tdx = _torch_grad(lambda t: F.max_pool2d(t, k, s, p), x, dy)
    np.testing.assert_array_equal(run.out, ty)
    np.testing.assert_allclose(run.dinputs[0], tdx, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape,k,s,p,d,ceil", MAX_CONFIGS[:8])
def test_maxpool_gradcheck_float64(shape, k, s, p, d, ceil):
    x = _distinct(shape)
    directional_gradcheck(lambda: MaxPool2d(k, s, p, d, ceil), [x], {}, directions=2)


def test_maxpool_backward_needs_only_input():
    assert MaxPool2d.needs_inputs == (0,) and MaxPool2d.needs_output is False
    assert AvgPool2d.needs_inputs == () and not AvgPool2d.needs_output
    assert GlobalAvgPool.needs_inputs == () and not GlobalAvgPool.needs_output


# (input shape, kernel, stride, padding, ceil_mode, count_include_pad)
AVG_CONFIGS = [
    ((2, 3, 8, 8), 2, None, 0, False, True),
    ((2, 4, 7, 9), 3, 2, 1, False, True),
    ((2, 4, 7, 9), 3, 2, 1, False, False),
    ((2, 4, 7, 9), 3, 2, 1, True, True),
    ((2, 4, 7, 9), 3, 2, 1, True, False),
    ((1, 2, 11, 10), (3, 2), (2, 1), (1, 1), True, True),
    ((2, 3, 10, 13), (3, 2), (2, 1), (1, 0), False, False),
    ((2, 2, 5, 5), 5, 1, 2, False, False),
    ((2, 2, 6, 7), 4, 3, 2, True, True),
    ((2, 32, 14, 14), 3, 1, 1, False, False),
]


@pytest.mark.parametrize("shape,k,s,p,ceil,cip", AVG_CONFIGS)
def test_avgpool_matches_torch(shape, k, s, p, ceil, cip):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    out_shape = run_layer(AvgPool2d(k, s, p, ceil, cip), [x]).out.shape
    dy = _dy(out_shape)
    run = run_layer(AvgPool2d(k, s, p, ceil, cip), [x], dout=dy)
    ty, tdx = _torch_grad(lambda t: F.avg_pool2d(t, k, s, p, ceil_mode=ceil, count_include_pad=cip), x, dy)
    assert run.out.shape == ty.shape
    np.testing.assert_allclose(run.out, ty, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run.dinputs[0], tdx, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape,k,s,p,ceil,cip", AVG_CONFIGS[:6])
def test_avgpool_gradcheck_float64(shape, k, s, p, ceil, cip):
    x = np.random.default_rng(2).standard_normal(shape)
    directional_gradcheck(lambda: AvgPool2d(k, s, p, ceil, cip), [x], {}, directions=2)


@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (4, 16, 1, 1), (1, 5, 3, 8), (3, 2048, 2, 2)])
def test_global_avgpool_matches_torch(shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    dy = _dy(shape[:2])
    run = run_layer(GlobalAvgPool(), [x], dout=dy)
    ty, tdx = _torch_grad(lambda t: F.adaptive_avg_pool2d(t, 1).flatten(1), x, dy)
    assert run.out.shape == shape[:2]
    np.testing.assert_allclose(run.out, ty, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run.dinputs[0], tdx, rtol=1e-6, atol=1e-7)
    directional_gradcheck(GlobalAvgPool, [x.astype(np.float64)], {}, directions=2)


def test_global_avgpool_feeds_linear():
    net = dl.Network()
    x = net.input((2, 8, 5, 5))
    y = dl.layers.Linear(3)(GlobalAvgPool()(x))
    assert y.shape == (2, 3)


def _build(layer, shape):
    net = dl.Network()
    return layer(net.input(shape, name="x"))


@pytest.mark.parametrize("layer,shape,needle", [
    (lambda: MaxPool2d(3, 1, 2, name="mp"), (1, 2, 8, 8), "at most half the kernel size"),
    (lambda: MaxPool2d(2, 2, 0, name="mp"), (1, 2, 1, 8), "too small"),
    (lambda: MaxPool2d(3, 1, 1, dilation=4, name="mp"), (1, 2, 5, 5), "too small"),
    (lambda: MaxPool2d(2, name="mp"), (2, 8), "4-D"),
    # a stride of 0 is refused earlier, at construction (tests/test_errors.py)
    (lambda: AvgPool2d(2, 1, 2, name="ap"), (1, 2, 8, 8), "at most half the kernel size"),
    (lambda: AvgPool2d(5, name="ap"), (1, 2, 4, 4), "too small"),
    (lambda: GlobalAvgPool(name="gp"), (4, 3, 2), "4-D"),
])
def test_build_errors_name_the_layer(layer, shape, needle):
    lay = layer()
    with pytest.raises(dl.GraphError) as e:
        _build(lay, shape)
    msg = str(e.value)
    assert needle in msg and f"'{lay.name}'" in msg and lay.type_name in msg and str(shape) in msg


def test_output_shapes_match_torch_formula():
    # ceil_mode drops a last window that would start in the right padding (PyTorch's rule)
    for h in range(3, 12):
        for k, s, p in [(3, 2, 1), (2, 2, 1), (3, 3, 1), (4, 3, 2)]:
            x = torch.zeros(1, 1, h, h)
            for ceil in (False, True):
                want = F.max_pool2d(x, k, s, p, ceil_mode=ceil).shape
                assert _build(MaxPool2d(k, s, p, ceil_mode=ceil), (1, 1, h, h)).shape == tuple(want)
                want = F.avg_pool2d(x, k, s, p, ceil_mode=ceil).shape
                assert _build(AvgPool2d(k, s, p, ceil_mode=ceil), (1, 1, h, h)).shape == tuple(want)


def test_config_and_flops():
    mp = MaxPool2d(3, 2, 1)
    assert mp.config() == {"kernel_size": (3, 3), "stride": (2, 2), "padding": (1, 1), "dilation": (1, 1),
                           "ceil_mode": False}
    assert mp.flops([(2, 4, 8, 8)], (2, 4, 4, 4)) == 2 * 4 * 4 * 4 * 9
    ap = AvgPool2d(2, count_include_pad=False)
    assert ap.config()["stride"] == (2, 2) and ap.config()["count_include_pad"] is False
    assert ap.flops([(1, 1, 4, 4)], (1, 1, 2, 2)) > 0
    assert GlobalAvgPool().flops([(2, 3, 4, 4)], (2, 3)) == 96
