"""BatchNorm2d float32 accuracy against PyTorch float32, both measured against a float64 reference.

The statistics are a corrected two-pass algorithm and the applying passes subtract the mean first
(minidl/backend/cpu/norm.py), so a large mean/std ratio or a tiny per-channel count costs no more accuracy than in
PyTorch: every error here is at most twice PyTorch's on the same input (plus a floor of a few float32 roundings).
Errors are scaled by the natural size of each output: max |y| for y, max |dy * weight * invstd| for dx (the exact
dx of a two-value channel is nearly zero, so a relative error against it measures only cancellation), the
largest reference entry for the parameter gradients.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minidl.backend.cpu.backend import CPUBackend

_FLOOR = 1e-6  # a few float32 roundings: below it both implementations are exact to the precision that matters


def _torch(x, w, b, dy, dtype):
    xt = torch.tensor(x, dtype=dtype, requires_grad=True)
    wt = torch.tensor(w, dtype=dtype, requires_grad=True)
    bt = torch.tensor(b, dtype=dtype, requires_grad=True)
    y = F.batch_norm(xt, None, None, wt, bt, training=True, eps=1e-5)
    y.backward(torch.tensor(dy, dtype=dtype))
    return [t.detach().numpy().astype(np.float64) for t in (y, xt.grad, wt.grad, bt.grad)]


def _minidl(x, w, b, dy):
    be, c = CPUBackend(), x.shape[1]
    y, mean, invstd = np.empty_like(x), np.empty(c, x.dtype), np.empty(c, x.dtype)
    be.batchnorm_forward_train(x, w, b, np.zeros(c, x.dtype), np.ones(c, x.dtype), y, mean, invstd, 0.1, 1e-5)
    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
    be.batchnorm_backward(x, w, dy, mean, invstd, dx, dw, db)
    return [a.astype(np.float64) for a in (y, dx, dw, db)]


@pytest.mark.parametrize("shape", [(2, 3, 1, 1), (1, 3, 1, 2), (3, 4, 1, 1), (4, 3, 5, 5), (64, 3, 1, 1),
                                   (2, 4, 16, 16)])
@pytest.mark.parametrize("ratio", [0.0, 1e2, 1e3, 1e4])
def test_float32_error_within_twice_torch(shape, ratio):
    worst_t, worst_m = np.zeros(4), np.zeros(4)
    for seed in range(4):
        rng = np.random.default_rng(seed)
        c = shape[1]
        x = (rng.standard_normal(shape) + ratio).astype(np.float32)
        w = rng.uniform(0.5, 1.5, c).astype(np.float32)
        b = rng.standard_normal(c).astype(np.float32)
        dy = rng.standard_normal(shape).astype(np.float32)
        ref = _torch(x, w, b, dy, torch.float64)
        t32, m32 = _torch(x, w, b, dy, torch.float32), _minidl(x, w, b, dy)
        invstd = 1 / np.sqrt(x.astype(np.float64).var(axis=(0, 2, 3)) + 1e-5)
        scales = [np.abs(ref[0]).max(), np.abs(dy * (w * invstd)[None, :, None, None]).max(),
                  np.abs(ref[2]).max(), np.abs(ref[3]).max()]
        for i, s in enumerate(scales):
            worst_t[i] = max(worst_t[i], np.abs(t32[i] - ref[i]).max() / s)
            worst_m[i] = max(worst_m[i], np.abs(m32[i] - ref[i]).max() / s)
    for name, t, m in zip(("y", "dx", "dweight", "dbias"), worst_t, worst_m):
        assert m <= 2 * t + _FLOOR, f"{name}: minidl float32 error {m:.2e} > 2 x PyTorch's {t:.2e}"


def test_statistics_survive_a_first_sample_far_from_the_batch():
    """Pass 1 centres on the first sample's mean; when that sample sits far from the others the one-pass
    variance from those shifted sums would cancel (amplifying rounding by up to N). Pass 2 does not."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 2, 4, 4)) * 0.01 + 1.0).astype(np.float32)
    x[0] += 100.0
    be, c = CPUBackend(), 2
    y, mean, invstd = np.empty_like(x), np.empty(c, np.float32), np.empty(c, np.float32)
    rv = np.ones(c, np.float32)
    be.batchnorm_forward_train(x, None, None, np.zeros(c, np.float32), rv, y, mean, invstd, 1.0, 1e-5)
    x64 = x.astype(np.float64)
    var = x64.var(axis=(0, 2, 3))
    np.testing.assert_allclose(mean, x64.mean(axis=(0, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(var + 1e-5), rtol=1e-6)
    np.testing.assert_allclose(rv, var * x[:, 0].size / (x[:, 0].size - 1), rtol=1e-6)
