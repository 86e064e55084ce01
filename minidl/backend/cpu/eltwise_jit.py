"""ReLU of the CPU backend compiled with numba: forward, backward, fused with an add; ~4x numpy's passes. The numpy
kernels' bits (`CoreOps`): maximum(x, 0), dx = dy * (y > 0) as a product (inf * 0 = NaN), adds as `np.add`.
`_parallel` twins split flat arrays by position. An output may be exactly an input: each value is read first.
"""
from __future__ import annotations

import numpy as np
from numba import prange, uint64

from ...core.jit_cache import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
_ADD_BLOCK = 4096  # elements per block of `add_relu` (16 KiB of float32: y's block stays in L1)


@njit(**_OPTS)
def _cut(n, t, workers):
    """Where worker t's piece starts: a multiple of `_ADD_BLOCK`, the last ending at n."""
    return n if t == workers else (n * t // workers) // _ADD_BLOCK * _ADD_BLOCK


@njit(**_OPTS)
def _relu_forward(x, y, lo, hi):
    z = x.dtype.type(0)
    for i in range(uint64(lo), uint64(hi)):
        a = x[i]
        y[i] = z if a <= z else a


@njit(**_OPTS)
def relu_forward(x, y):
    _relu_forward(x, y, 0, x.size)


@njit(**_OPTS, parallel=True)
def relu_forward_parallel(x, y, workers):
    for t in prange(workers):
        _relu_forward(x, y, _cut(x.size, t, workers), _cut(x.size, t + 1, workers))


@njit(**_OPTS)
def _relu_backward(y, dy, dx, lo, hi):
    z = y.dtype.type(0)
    one = y.dtype.type(1)
    for i in range(uint64(lo), uint64(hi)):
        dx[i] = dy[i] * (one if y[i] > z else z)


@njit(**_OPTS)
def relu_backward(y, dy, dx):
    _relu_backward(y, dy, dx, 0, y.size)


@njit(**_OPTS, parallel=True)
def relu_backward_parallel(y, dy, dx, workers):
    for t in prange(workers):
        _relu_backward(y, dy, dx, _cut(y.size, t, workers), _cut(y.size, t + 1, workers))


@njit(**_OPTS)
def _add_relu(a, b, y, r, start, stop):
    z = y.dtype.type(0)
    for s in range(start, stop, _ADD_BLOCK):
        lo, hi = uint64(s), uint64(min(stop, s + _ADD_BLOCK))  # unsigned: no negative-index check
        for i in range(lo, hi):
            y[i] = a[i] + b[i]
        for i in range(lo, hi):
            v = y[i]
            r[i] = z if v <= z else v


@njit(**_OPTS)
def add_relu(a, b, y, r):
    """y = a + b and r = ReLU(y) a block at a time, in two loops LLVM vectorizes (one: 3x slower)."""
    _add_relu(a, b, y, r, 0, y.size)


@njit(**_OPTS, parallel=True)
def add_relu_parallel(a, b, y, r, workers):
    for t in prange(workers):
        _add_relu(a, b, y, r, _cut(y.size, t, workers), _cut(y.size, t + 1, workers))


@njit(**_OPTS)
def _add_relu_only(a, b, r, start, stop):
    z = r.dtype.type(0)
    t = np.empty(_ADD_BLOCK, r.dtype)
    for s in range(start, stop, _ADD_BLOCK):
        lo = uint64(s)
        m = uint64(min(stop, s + _ADD_BLOCK)) - lo
        for i in range(m):
            t[i] = a[lo + i] + b[lo + i]
        for i in range(m):
            v = t[i]
            r[lo + i] = z if v <= z else v


@njit(**_OPTS)
def add_relu_only(a, b, r):
    """r = ReLU(a + b), the sum kept a block at a time in a local buffer."""
    _add_relu_only(a, b, r, 0, r.size)


@njit(**_OPTS, parallel=True)
def add_relu_only_parallel(a, b, r, workers):
    for t in prange(workers):
        _add_relu_only(a, b, r, _cut(r.size, t, workers), _cut(r.size, t + 1, workers))


@njit(**_OPTS)
def _relu_backward_add(y, dy, d1, d2, lo, hi):
    z = y.dtype.type(0)
    one = y.dtype.type(1)
    for i in range(uint64(lo), uint64(hi)):
        v = dy[i] * (one if y[i] > z else z)
        d1[i] = v
        d2[i] = v


@njit(**_OPTS)
def relu_backward_add(y, dy, d1, d2):
    """d1 = d2 = `relu_backward(y, dy)` in one loop: 3.4 ms against 6.8 with two copies ((8, 256, 56, 56))."""
    _relu_backward_add(y, dy, d1, d2, 0, y.size)


@njit(**_OPTS, parallel=True)
def relu_backward_add_parallel(y, dy, d1, d2, workers):
    for t in prange(workers):
        _relu_backward_add(y, dy, d1, d2, _cut(y.size, t, workers), _cut(y.size, t + 1, workers))


@njit(**_OPTS)
def _add_into(a, b, lo, hi):
    for i in range(uint64(lo), uint64(hi)):
        a[i] = a[i] + b[i]


@njit(**_OPTS)
def add_into(a, b):
    """a += b, as `np.add`, for C-contiguous arrays of one shape."""
    af, bf = a.reshape(-1), b.reshape(-1)
    _add_into(af, bf, 0, af.size)


@njit(**_OPTS, parallel=True)
def add_into_parallel(a, b, workers):
    """a += b, one piece per worker."""
    for t in prange(workers):
        _add_into(a, b, _cut(a.size, t, workers), _cut(a.size, t + 1, workers))
