"""The compiled max-pool (minidl/backend/cpu/pooling_jit.py) gives the numpy kernels' values: bit for bit on
finite data (ties, zeros and sums of several windows' gradients included), NaN where numpy gives NaN (only a
NaN's sign bit may differ: numpy's and LLVM's invalid operations make different NaNs), on one thread and split
over planes on two; non-contiguous arrays take the numpy path."""
from __future__ import annotations

import numpy as np
import pytest

from minidl.backend.cpu import pooling as cpu_pool
from minidl.backend.cpu.backend import CPUBackend

pytest.importorskip("numba")

GEOMETRIES = [  # shape, kernel, stride, padding, dilation, ceil-mode output size
    ((2, 3, 8, 8), (2, 2), (2, 2), (0, 0), (1, 1)),
    ((2, 4, 7, 9), (3, 3), (2, 2), (1, 1), (1, 1)),
    ((2, 3, 10, 13), (3, 2), (2, 1), (1, 0), (1, 1)),
    ((2, 2, 9, 9), (3, 3), (1, 1), (1, 1), (2, 2)),
    ((2, 2, 12, 11), (3, 3), (2, 3), (1, 1), (2, 1)),
    ((1, 3, 5, 5), (5, 5), (1, 1), (2, 2), (1, 1)),
    ((3, 2, 6, 6), (1, 1), (2, 2), (0, 0), (1, 1)),
    ((2, 1, 13, 13), (4, 4), (3, 3), (2, 2), (1, 1)),
    ((4, 64, 30, 30), (3, 3), (2, 2), (1, 1), (1, 1)),  # the ResNet stem's geometry
]


def _out(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _data(shape, dtype, seed, kind):
    rng = np.random.default_rng(seed)
    if kind == "ties":  # post-ReLU-like: most windows hold ties, zeros everywhere
        return np.maximum(rng.integers(-3, 3, size=shape), 0).astype(dtype)
    a = rng.standard_normal(shape).astype(dtype)
    if kind == "special":
        a[a > 1.6] = np.inf
        a[a < -1.6] = -np.inf
        a[(a > 0.2) & (a < 0.25)] = np.nan
        a[np.abs(a) < 0.05] = -0.0
    return a


def _run(be, x, dy, k, s, p, d):
    y = np.full(dy.shape, 7, x.dtype)
    dx = np.full_like(x, 7)
    be.maxpool2d_forward(x, y, k, s, p, d)
    be.maxpool2d_backward(x, dy, dx, k, s, p, d)
    return y, dx


def _same(a, b):
    """Equal bits, or NaN in both."""
    bits = np.uint32 if a.dtype == np.float32 else np.uint64
    return bool(np.all((a.view(bits) == b.view(bits)) | (np.isnan(a) & np.isnan(b))))


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_compiled_maxpool_gives_the_numpy_values(geometry, dtype, kind, workers, monkeypatch):
    shape, k, s, p, d = geometry
    out = (shape[0], shape[1], _out(shape[2], k[0], s[0], p[0], d[0]), _out(shape[3], k[1], s[1], p[1], d[1]))
    x = _data(shape, dtype, 0, kind)
    dy = _data(out, dtype, 1, "special" if kind == "special" else "normal")
    be = CPUBackend()
    monkeypatch.setattr(cpu_pool, "workers_for", lambda values: workers)
    assert cpu_pool.pooling_jit() is not None
    with np.errstate(invalid="ignore"):
        got = _run(be, x, dy, k, s, p, d)
        monkeypatch.setattr(cpu_pool, "pooling_jit", lambda: None)
        ref = _run(be, x, dy, k, s, p, d)
    assert _same(got[0], ref[0]) and _same(got[1], ref[1])
    if kind != "special":
        assert got[0].tobytes() == ref[0].tobytes() and got[1].tobytes() == ref[1].tobytes()


def test_several_windows_sum_in_the_numpy_order():
    """An input element that is the maximum of four overlapping windows receives four gradients: the compiled
    kernel adds them in tap order, as numpy does, so the sum rounds the same (a different order would differ
    in the last bit for these values)."""
    x = np.zeros((1, 1, 5, 5), np.float32)
    x[0, 0, 2, 2] = 1.0  # the maximum of all four 3x3 windows at stride 2
    dy = np.array([[[[1e8, 1.0], [-1e8, 3.0]]]], np.float32)
    be = CPUBackend()
    y, dx = _run(be, x, dy, (3, 3), (2, 2), (0, 0), (1, 1))
    terms = [3.0, -1e8, 1.0, 1e8]  # taps 0, 2, 6, 8 of windows (1,1), (1,0), (0,1), (0,0)
    total = np.float32(0)
    for t in terms:
        total = np.float32(total + np.float32(t))
    assert dx[0, 0, 2, 2] == total and total != np.float32(sum(terms[::-1]))


def test_non_contiguous_arrays_take_the_numpy_path():
    x = _data((2, 3, 9, 8), np.float32, 2, "normal").transpose(0, 1, 3, 2)  # (2, 3, 8, 9), not C-contiguous
    y = np.empty((2, 3, 4, 4), np.float32)
    g = cpu_pool._grid(x.shape[2:], y.shape[2:], (2, 2), (2, 2), (0, 0), (1, 1))
    assert not cpu_pool._compiled_max(x, y, None, g)
    CPUBackend().maxpool2d_forward(x, y, (2, 2), (2, 2), (0, 0), (1, 1))
    assert np.array_equal(y, x[:, :, :8, :8].reshape(2, 3, 4, 2, 4, 2).max(axis=(3, 5)))
