"""Backend conformance: the layers' forward and backward on every backend, against PyTorch (float32, CPU).

Parameterized over backends:
  * "cpu" always runs;
  * "cuda" (marked `gpu`) runs where cupy, NVIDIA's cuDNN frontend and a CUDA device are all present, and is
    skipped otherwise with the reason (what is missing).

The layers run through `minidl.testing.run_layer`, which allocates numpy arrays. For the CUDA backend `OnDevice`
wraps it: before each backend call it copies every numpy argument into a device array (on the backend's compute
stream, with `copy_in`), and afterwards copies the device arrays back into the numpy ones; convolutions get one of
the backend's own algorithms (`conv_workspace_options`) and a device workspace of its size instead of the CPU
algorithm `run_layer` picked. Every convolution test runs each algorithm (CPU) or each offered cuDNN plan (CUDA).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minidl import layers as L
from minidl.backend.base import backend_name
from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.cuda import halves
from minidl.backend.precision import HALF_DTYPES, is_half
from minidl.testing import run_layer

from .cuda_device import cuda_backend

RTOL = 1e-4


def _close(got, ref, rtol=RTOL, scale_atol=True):
    ref = ref.detach().numpy() if torch.is_tensor(ref) else np.asarray(ref)
    atol = rtol * max(1.0, float(np.abs(ref).max())) if scale_atol and ref.size else rtol
    np.testing.assert_allclose(np.asarray(got), ref, rtol=rtol, atol=atol)


def _t(a, grad=True):
    return torch.tensor(a, requires_grad=grad)


# ---------------------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------------------

class OnDevice:
    """Runs a device backend on host (numpy) arguments: copy in, call, copy back."""

    def __init__(self, be):
        self.be = be
        self.cp = be.cp
        self.conv_option = 0  # which of conv_workspace_options() convolutions use (clamped to the last one)

    def _to_device(self, a, pairs):
        if isinstance(a, np.ndarray):
            d = self.cp.empty(a.shape, halves.storage_dtype(a.dtype))   # bf16: its uint16 bits
            self.be.copy_in(d, a)
            pairs.append((a, d))
            return d
        if isinstance(a, list):
            return [self._to_device(v, pairs) for v in a]
        return a

    def _conv_algo(self, phase, args, accumulate=False):
        x, w, y = args[0], args[1], args[2] if phase == "bwd" else args[3]
        stride, padding, dilation, groups = args[-6:-2]
        opts = self.be.conv_workspace_options(phase, x.shape, w.shape, y.shape, stride, padding, dilation, groups,
                                              x.dtype, accumulate=accumulate)
        opt = opts[min(self.conv_option, len(opts) - 1)]
        # `empty`, not `zeros`: a memset on cupy's default stream would race the backend's compute stream
        ws = self.cp.empty(opt.workspace_bytes, self.cp.uint8) if opt.workspace_bytes else None
        return opt.algo, ws

    def __getattr__(self, name):
        fn = getattr(self.be, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            pairs: list = []
            args = [self._to_device(a, pairs) for a in args]
            kwargs = {k: self._to_device(v, pairs) for k, v in kwargs.items()}
            if name in ("conv2d_forward", "conv2d_backward"):
                assert set(kwargs) <= {"accumulate"}, "layers call the convolution kernels positionally"
                args[-2:] = self._conv_algo("fwd" if name == "conv2d_forward" else "bwd", args,
                                            kwargs.get("accumulate", False))
            out = fn(*args, **kwargs)
            for host, dev in pairs:
                if host.flags.writeable:
                    host[...] = self.be.to_host(dev)
            self.be.synchronize()  # before the temporaries go back to cupy's pool for reuse
            return out

        return call


def _cuda_backend_or_skip():
    return cuda_backend("fp32")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    if request.param == "cpu":
        yield CPUBackend()
        return
    be = _cuda_backend_or_skip()
    yield OnDevice(be)
    print(f"CUDA backend memory outside the arena: {be.memory_report()}")


def _is_cuda(backend) -> bool:
    return backend_name(backend) == "cuda"


def _conv_variants(backend, layer_factory, x_shape, w_shape, y_shape):
    """run_layer keyword sets covering every algorithm of the backend for this convolution."""
    if not _is_cuda(backend):
        algos = layer_factory().algorithms()
        return [dict(algo_fwd=a, algo_bwd=a) for a in algos]
    layer = layer_factory()
    n = max(len(backend.be.conv_workspace_options(ph, x_shape, w_shape, y_shape, layer.stride, layer.padding,
                                                  layer.dilation, layer.groups)) for ph in ("fwd", "bwd"))
    return [dict(conv_option=k) for k in range(n)]


# ---------------------------------------------------------------------------------------------------------
# Convolution
# ---------------------------------------------------------------------------------------------------------

CONV_CONFIGS = [
    # x shape, out channels, kernel, stride, padding, dilation, groups, bias
    ((2, 3, 8, 8), 4, 3, 1, 1, 1, 1, True),
    ((2, 4, 9, 7), 6, (3, 2), (2, 1), (1, 0), 1, 2, False),
    ((1, 8, 10, 10), 8, 3, 1, 2, 2, 8, True),          # depthwise, dilated
    ((3, 5, 6, 6), 7, 1, 1, 0, 1, 1, True),            # 1x1
    ((2, 3, 11, 13), 5, (5, 3), (3, 2), (2, 1), (1, 2), 1, False),
    ((4, 16, 14, 14), 32, 3, 2, 1, 1, 1, True),
]


@pytest.mark.parametrize("shape,cout,k,s,p,d,g,bias", CONV_CONFIGS)
def test_conv2d(backend, shape, cout, k, s, p, d, g, bias):
    rng = np.random.default_rng(0)
    make = lambda: L.Conv2d(cout, k, s, p, d, g, bias=bias)  # noqa: E731
    layer = make()
    x = rng.standard_normal(shape).astype(np.float32)
    kh, kw = layer.kernel_size
    w = (rng.standard_normal((cout, shape[1] // g, kh, kw)) * 0.3).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    params = {"weight": w, **({"bias": b} if bias else {})}
    tx, tw, tb = _t(x), _t(w), _t(b)
    ty = F.conv2d(tx, tw, tb if bias else None, layer.stride, layer.padding, layer.dilation, g)
    dy = rng.standard_normal(tuple(ty.shape)).astype(np.float32)
    ty.backward(torch.tensor(dy))
    for variant in _conv_variants(backend, make, x.shape, w.shape, tuple(ty.shape)):
        if _is_cuda(backend):
            backend.conv_option = variant.pop("conv_option")
        r = run_layer(make(), [x], params, dout=dy, backend=backend, **variant)
        _close(r.out, ty)
        _close(r.dinputs[0], tx.grad)
        _close(r.grads["weight"], tw.grad)
        if bias:
            _close(r.grads["bias"], tb.grad)
    if _is_cuda(backend):
        backend.conv_option = 0


@pytest.mark.parametrize("shape,cout,k,s,p,d,g,bias", CONV_CONFIGS)
def test_conv2d_backward_adds_into_the_delta(backend, shape, cout, k, s, p, d, g, bias):
    """A fork's later convolution: dx += the input gradient, the whole batch in one call, under each of the
    backend's accumulating options (CPU: every algorithm; CUDA: the data gradient with a fused add, or `+add`)."""
    rng = np.random.default_rng(2)
    layer = L.Conv2d(cout, k, s, p, d, g, bias=bias)
    kh, kw = layer.kernel_size
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((cout, shape[1] // g, kh, kw)) * 0.3).astype(np.float32)
    tx = _t(x)
    ty = F.conv2d(tx, _t(w), None, layer.stride, layer.padding, layer.dilation, g)
    dy = rng.standard_normal(tuple(ty.shape)).astype(np.float32)
    ty.backward(torch.tensor(dy))
    delta = rng.standard_normal(shape).astype(np.float32)
    conf = (layer.stride, layer.padding, layer.dilation, g)
    be = backend.be if _is_cuda(backend) else backend
    opts = be.conv_workspace_options("bwd", x.shape, w.shape, tuple(ty.shape), *conf, accumulate=True)
    assert opts
    for k_opt, opt in enumerate(opts):
        got = delta.copy()
        if _is_cuda(backend):
            backend.conv_option = k_opt
            backend.conv2d_backward(x, w, dy, got, None, None, *conf, None, None, accumulate=True)
        else:
            ws = np.zeros(opt.workspace_bytes, np.uint8)
            backend.conv2d_backward(x, w, dy, got, None, None, *conf, opt.algo, ws, accumulate=True)
        _close(got, delta + tx.grad.numpy())
    if _is_cuda(backend):
        backend.conv_option = 0


# ---------------------------------------------------------------------------------------------------------
# Batch normalization
# ---------------------------------------------------------------------------------------------------------

def _bn_case(shape, affine):
    """x, dy and the parameters of a batch-norm test (seed 1)."""
    rng = np.random.default_rng(1)
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    p = {"running_mean": rng.standard_normal(c).astype(np.float32),
         "running_var": rng.uniform(0.5, 2.0, c).astype(np.float32)}
    if affine:
        p["weight"] = rng.uniform(0.5, 1.5, c).astype(np.float32)
        p["bias"] = rng.standard_normal(c).astype(np.float32)
    return x, dy, p


@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (2, 16, 7, 9), (8, 4, 1, 1), (1, 5, 30, 20)])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm(backend, shape, training, affine):
    x, dy, p = _bn_case(shape, affine)
    tx = _t(x)
    tw, tb = (_t(p["weight"]), _t(p["bias"])) if affine else (None, None)
    rm, rv = torch.tensor(p["running_mean"]), torch.tensor(p["running_var"])
    ty = F.batch_norm(tx, rm, rv, tw, tb, training=training, momentum=0.1, eps=1e-5)
    ty.backward(torch.tensor(dy))
    mine = {k: v.copy() for k, v in p.items()}
    r = run_layer(L.BatchNorm2d(affine=affine), [x], mine, dout=dy, training=training, backend=backend)
    _close(r.out, ty)
    _close(r.dinputs[0], tx.grad, rtol=1e-3)
    if affine:
        _close(r.grads["weight"], tw.grad, rtol=1e-3)
        _close(r.grads["bias"], tb.grad)
    _close(mine["running_mean"], rm, rtol=1e-5)
    _close(mine["running_var"], rv, rtol=1e-5)
    if training:
        mean = x.mean(axis=(0, 2, 3), dtype=np.float64)
        _close(r.aux["mean"], mean, rtol=1e-5)
        _close(r.aux["invstd"], 1 / np.sqrt(x.var(axis=(0, 2, 3), dtype=np.float64) + 1e-5), rtol=1e-4)


@pytest.mark.parametrize("shape", [(4, 6, 5, 5), (8, 16, 9, 7)])
def test_batchnorm_recompute_reproduces_forward(backend, shape):
    """forward_apply with the saved statistics gives the training forward's output bit for bit (what policy
    `recompute` relies on to stay bit-identical to `none`), running stats untouched."""
    rng = np.random.default_rng(2)
    c = shape[1]
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    p = {"weight": rng.uniform(0.5, 1.5, c).astype(np.float32), "bias": rng.standard_normal(c).astype(np.float32),
         "running_mean": np.zeros(c, np.float32), "running_var": np.ones(c, np.float32)}
    r = run_layer(L.BatchNorm2d(), [x], p, backend=backend)
    y2 = np.empty_like(r.out)
    backend.batchnorm_forward_apply(x, p["weight"], p["bias"], r.aux["mean"], r.aux["invstd"], y2)
    np.testing.assert_array_equal(y2, r.out)


# ---------------------------------------------------------------------------------------------------------
# Activation, pooling, dense, loss
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (4, 17), (1, 1, 1, 1)])
def test_relu(backend, shape):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    r = run_layer(L.ReLU(), [x], dout=dy, backend=backend)
    tx = _t(x)
    F.relu(tx).backward(torch.tensor(dy))
    np.testing.assert_array_equal(r.out, np.maximum(x, 0))
    np.testing.assert_array_equal(r.dinputs[0], tx.grad.numpy())


@pytest.mark.parametrize("shape,k,s,p,d,ceil", [
    ((2, 3, 8, 8), 2, None, 0, 1, False),
    ((2, 4, 7, 9), 3, 2, 1, 1, True),
    ((2, 3, 10, 13), (3, 2), (2, 1), (1, 0), 1, False),
    ((2, 2, 12, 11), (3, 3), (2, 3), (1, 1), (2, 1), True),
])
def test_maxpool(backend, shape, k, s, p, d, ceil):
    x = np.random.default_rng(4).permutation(int(np.prod(shape))).reshape(shape).astype(np.float32)  # no ties
    tx = _t(x)
    ty = F.max_pool2d(tx, k, s if s is not None else k, p, d, ceil_mode=ceil)
    dy = np.random.default_rng(5).standard_normal(tuple(ty.shape)).astype(np.float32)
    ty.backward(torch.tensor(dy))
    r = run_layer(L.MaxPool2d(k, s, p, d, ceil), [x], dout=dy, backend=backend)
    np.testing.assert_array_equal(r.out, ty.detach().numpy())
    _close(r.dinputs[0], tx.grad, rtol=1e-6)


@pytest.mark.parametrize("shape,k,s,p,ceil,cip", [
    ((2, 3, 8, 8), 2, None, 0, False, True),
    ((2, 4, 7, 9), 3, 2, 1, True, True),
    ((2, 4, 7, 9), 3, 2, 1, True, False),
    ((1, 2, 11, 10), (3, 2), (2, 1), (1, 1), False, False),
])
def test_avgpool(backend, shape, k, s, p, ceil, cip):
    x = np.random.default_rng(6).standard_normal(shape).astype(np.float32)
    tx = _t(x)
    ty = F.avg_pool2d(tx, k, s if s is not None else k, p, ceil, cip)
    dy = np.random.default_rng(7).standard_normal(tuple(ty.shape)).astype(np.float32)
    ty.backward(torch.tensor(dy))
    r = run_layer(L.AvgPool2d(k, s, p, ceil, cip), [x], dout=dy, backend=backend)
    _close(r.out, ty, rtol=1e-5)
    _close(r.dinputs[0], tx.grad, rtol=1e-5)


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (4, 64, 1, 1), (1, 2, 33, 31)])
def test_global_avgpool(backend, shape):
    x = np.random.default_rng(8).standard_normal(shape).astype(np.float32)
    dy = np.random.default_rng(9).standard_normal(shape[:2]).astype(np.float32)
    tx = _t(x)
    ty = tx.mean(dim=(2, 3))
    ty.backward(torch.tensor(dy))
    r = run_layer(L.GlobalAvgPool(), [x], dout=dy, backend=backend)
    _close(r.out, ty, rtol=1e-5)
    _close(r.dinputs[0], tx.grad, rtol=1e-5)


@pytest.mark.parametrize("shape,out,bias", [((3, 10), 4, True), ((2, 3, 4, 5), 7, False), ((1, 1), 1, True),
                                            ((16, 300), 33, True)])
def test_linear(backend, shape, out, bias):
    rng = np.random.default_rng(10)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((out, int(np.prod(shape[1:])))).astype(np.float32)
    b = rng.standard_normal(out).astype(np.float32)
    dy = rng.standard_normal((shape[0], out)).astype(np.float32)
    params = {"weight": w, **({"bias": b} if bias else {})}
    r = run_layer(L.Linear(out, bias=bias), [x], params, dout=dy, backend=backend)
    tx, tw, tb = _t(x), _t(w), _t(b)
    ty = F.linear(tx.reshape(shape[0], -1), tw, tb if bias else None)
    ty.backward(torch.tensor(dy))
    _close(r.out, ty, rtol=1e-5)
    _close(r.dinputs[0], tx.grad, rtol=1e-5)
    _close(r.grads["weight"], tw.grad, rtol=1e-5)
    if bias:
        _close(r.grads["bias"], tb.grad, rtol=1e-5)


@pytest.mark.parametrize("n,k", [(4, 10), (1, 3), (32, 1000)])
def test_softmax_cross_entropy(backend, n, k):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((n, k)) * 3).astype(np.float32)
    y = rng.integers(0, k, n).astype(np.int64)
    r = run_layer(L.SoftmaxCrossEntropy(), [x, y], dout=np.array(1.0, np.float32), backend=backend)
    tx = _t(x)
    loss = F.cross_entropy(tx, torch.tensor(y))
    loss.backward()
    _close(r.out, loss, rtol=1e-5)
    _close(r.dinputs[0], tx.grad, rtol=1e-5)


@pytest.mark.parametrize("size,alpha,beta,k", [(5, 1e-4, 0.75, 2.0), (3, 0.1, 0.5, 1.0)])
def test_lrn(backend, size, alpha, beta, k):
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 7, 4, 5)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    r = run_layer(L.LRN(size, alpha, beta, k), [x], dout=dy, backend=backend)
    tx = _t(x)
    F.local_response_norm(tx, size, alpha, beta, k).backward(torch.tensor(dy))
    _close(r.out, F.local_response_norm(torch.tensor(x), size, alpha, beta, k), rtol=1e-5)
    _close(r.dinputs[0], tx.grad, rtol=1e-4)


def test_add_concat(backend):
    rng = np.random.default_rng(13)
    a, b = (rng.standard_normal((2, 3, 4, 5)).astype(np.float32) for _ in range(2))
    c = rng.standard_normal((2, 1, 4, 5)).astype(np.float32)
    dy = rng.standard_normal(a.shape).astype(np.float32)
    r = run_layer(L.Add(), [a, b, a], dout=dy, backend=backend)
    _close(r.out, a + b + a, rtol=1e-6)
    for dx in r.dinputs:
        np.testing.assert_array_equal(dx, dy)
    dy = rng.standard_normal((2, 7, 4, 5)).astype(np.float32)
    r = run_layer(L.Concat(), [a, c, b], dout=dy, backend=backend)
    np.testing.assert_array_equal(r.out, np.concatenate([a, c, b], axis=1))
    for dx, lo, hi in zip(r.dinputs, (0, 3, 4), (3, 4, 7)):
        np.testing.assert_array_equal(dx, dy[:, lo:hi])


def test_dropout_matches_cpu_mask(backend):
    """Both backends draw the same mask from the same key (counter-based RNG), so results agree exactly."""
    rng = np.random.default_rng(14)
    x = rng.standard_normal((3, 5, 7, 11)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    r = run_layer(L.Dropout(0.3), [x], dout=dy, rng_key=987654321, backend=backend)
    ref = run_layer(L.Dropout(0.3), [x], dout=dy, rng_key=987654321)
    np.testing.assert_array_equal(r.out, ref.out)
    np.testing.assert_array_equal(r.dinputs[0], ref.dinputs[0])
    assert 0.2 < float(np.mean(r.out == 0)) < 0.4


# ---------------------------------------------------------------------------------------------------------
# Optimizers
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("momentum,dampening,wd,nesterov", [(0.0, 0.0, 0.0, False), (0.9, 0.0, 1e-2, True),
                                                            (0.9, 0.1, 0.0, False)])
def test_sgd(backend, momentum, dampening, wd, nesterov):
    rng = np.random.default_rng(15)
    p0 = rng.standard_normal(37).astype(np.float32)
    grads = [rng.standard_normal(37).astype(np.float32) for _ in range(3)]
    tp = torch.tensor(p0.copy(), requires_grad=True)
    opt = torch.optim.SGD([tp], lr=0.1, momentum=momentum, dampening=dampening, weight_decay=wd,
                          nesterov=nesterov)
    p, buf = p0.copy(), np.zeros(37, np.float32) if momentum else None
    for i, g in enumerate(grads):
        tp.grad = torch.tensor(g)
        opt.step()
        backend.sgd_update(p, g, buf, 0.1, momentum, dampening, wd, nesterov, i == 0)
    _close(p, tp, rtol=1e-6)


def test_adam(backend):
    rng = np.random.default_rng(16)
    p0 = rng.standard_normal(41).astype(np.float32)
    tp = torch.tensor(p0.copy(), requires_grad=True)
    opt = torch.optim.Adam([tp], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-3)
    p, m, v = p0.copy(), np.zeros(41, np.float32), np.zeros(41, np.float32)
    for step in range(1, 4):
        g = rng.standard_normal(41).astype(np.float32)
        tp.grad = torch.tensor(g)
        opt.step()
        backend.adam_update(p, g, m, v, 1e-2, 0.9, 0.999, 1e-8, 1e-3, step)
    _close(p, tp, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Half precision (--math bf16|fp16): the CUDA backend's cuDNN and cuBLAS half kernels against the CPU's
# ---------------------------------------------------------------------------------------------------------

#: Half outputs: within HALF_ULPS units of the half dtype's spacing at 1, at the reference's scale. Both backends
#: compute in float32 from the same stored half values and round once, so they differ only by their sums' orders
#: (cuDNN's and cuBLAS's tensor-core engines against the CPU's), which can move a value across a rounding boundary.
HALF_ULPS = 2
#: Float32 results from half operands (weight and bias gradients, BN's parameter gradients and statistics):
#: exact products, float32 sums in another order.
HALF_F32_RTOL = 1e-3


class HalfOnDevice(OnDevice):
    """`OnDevice` in a half mode: the test's inputs are rounded on the host by the CPU backend's `copy` (what
    run_layer stores is the reference's, not a kernel under test); every other call runs on the device."""

    def __init__(self, be):
        super().__init__(be)
        self._cpu = CPUBackend()

    def __getattr__(self, name):
        return self._cpu.copy if name == "copy" else super().__getattr__(name)


@pytest.fixture(scope="module", params=[pytest.param(m, marks=pytest.mark.gpu) for m in ("bf16", "fp16")])
def half_device(request):
    yield request.param, HalfOnDevice(cuda_backend(request.param))


def _half_close(got, ref, mode, ulps=HALF_ULPS):
    """`got` (CUDA) against `ref` (the CPU's half run): half arrays within `ulps`, float32 ones within
    HALF_F32_RTOL, both at the reference's scale."""
    assert np.asarray(got).dtype == np.asarray(ref).dtype
    g, r = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    scale = max(1.0, float(np.abs(r).max())) if r.size else 1.0
    if is_half(np.asarray(ref).dtype):
        eps = float(np.finfo(np.float16).eps) if mode == "fp16" else 2.0 ** -7
        np.testing.assert_allclose(g, r, rtol=0, atol=ulps * eps * scale)
    else:
        np.testing.assert_allclose(g, r, rtol=HALF_F32_RTOL, atol=HALF_F32_RTOL * scale)


def _half_runs(mode, layer, inputs, params, dy, dev, **kw):
    """(the CPU backend's half run, the CUDA backend's) of `layer` on the same values."""
    ref = run_layer(layer(), inputs, {k: v.copy() for k, v in params.items()}, dout=dy, math=mode, **kw)
    got = run_layer(layer(), inputs, {k: v.copy() for k, v in params.items()}, dout=dy, backend=dev, math=mode, **kw)
    return ref, got


@pytest.mark.parametrize("shape,cout,k,s,p,d,g,bias", CONV_CONFIGS)
def test_half_conv2d_matches_the_cpus_half(half_device, shape, cout, k, s, p, d, g, bias):
    mode, dev = half_device
    rng = np.random.default_rng(0)
    make = lambda: L.Conv2d(cout, k, s, p, d, g, bias=bias)  # noqa: E731
    layer = make()
    kh, kw = layer.kernel_size
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((cout, shape[1] // g, kh, kw)) * 0.3).astype(np.float32)
    params = {"weight": w, **({"bias": rng.standard_normal(cout).astype(np.float32)} if bias else {})}
    y_shape = run_layer(make(), [x], params).out.shape
    dy = rng.standard_normal(y_shape).astype(np.float32)
    conf = (layer.stride, layer.padding, layer.dilation, g)
    n = max(len(dev.be.conv_workspace_options(ph, x.shape, w.shape, y_shape, *conf, HALF_DTYPES[mode]))
            for ph in ("fwd", "bwd"))
    for option in range(n):
        dev.conv_option = option
        ref, got = _half_runs(mode, make, [x], params, dy, dev)
        _half_close(got.out, ref.out, mode)
        _half_close(got.dinputs[0], ref.dinputs[0], mode)
        for name in params:
            _half_close(got.grads[name], ref.grads[name], mode)
    dev.conv_option = 0


@pytest.mark.parametrize("shape,out,bias", [((3, 10), 4, True), ((2, 3, 4, 5), 7, False), ((16, 300), 33, True)])
def test_half_linear_matches_the_cpus_half(half_device, shape, out, bias):
    mode, dev = half_device
    rng = np.random.default_rng(10)
    x = rng.standard_normal(shape).astype(np.float32)
    params = {"weight": rng.standard_normal((out, int(np.prod(shape[1:])))).astype(np.float32),
              **({"bias": rng.standard_normal(out).astype(np.float32)} if bias else {})}
    dy = rng.standard_normal((shape[0], out)).astype(np.float32)
    ref, got = _half_runs(mode, lambda: L.Linear(out, bias=bias), [x], params, dy, dev)
    _half_close(got.out, ref.out, mode)
    _half_close(got.dinputs[0], ref.dinputs[0], mode)
    for name in params:
        _half_close(got.grads[name], ref.grads[name], mode)


@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (2, 16, 7, 9), (8, 4, 1, 1)])
@pytest.mark.parametrize("affine", [True, False])
def test_half_batchnorm_matches_the_cpus_half(half_device, shape, affine):
    """Training forward and backward, then the evaluation forward (the running statistics' backward is not a
    cuDNN graph)."""
    mode, dev = half_device
    x, dy, params = _bn_case(shape, affine)
    make = lambda: L.BatchNorm2d(affine=affine)  # noqa: E731
    ref, got = _half_runs(mode, make, [x], params, dy, dev)
    _half_close(got.out, ref.out, mode)
    _half_close(got.dinputs[0], ref.dinputs[0], mode, ulps=2 * HALF_ULPS)   # dy - its means: cancellation
    for name in ("mean", "invstd"):
        _half_close(got.aux[name], ref.aux[name], mode)
    for name in params if affine else ():
        if name in ("weight", "bias"):
            _half_close(got.grads[name], ref.grads[name], mode)
    ref, got = _half_runs(mode, make, [x], params, None, dev, training=False)
    _half_close(got.out, ref.out, mode)


@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (2, 16, 7, 9), (8, 4, 1, 1)])
@pytest.mark.parametrize("affine", [True, False])
def test_half_batchnorm_eval_backward_matches_the_cpus_half(half_device, shape, affine):
    """The backward with the running statistics (batchnorm_backward_eval: the fallback kernels' half forms, dx a
    per-channel scale of dy rounded once; float32 dweight and dbias)."""
    mode, dev = half_device
    x, dy, params = _bn_case(shape, affine)
    ref, got = _half_runs(mode, lambda: L.BatchNorm2d(affine=affine), [x], params, dy, dev, training=False)
    _half_close(got.out, ref.out, mode)
    _half_close(got.dinputs[0], ref.dinputs[0], mode)
    for name in ("weight", "bias") if affine else ():
        _half_close(got.grads[name], ref.grads[name], mode)
