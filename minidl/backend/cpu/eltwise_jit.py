"""ReLU of the CPU backend compiled with numba: forward and backward, and fused with an add (both ways).

Why. numpy's `maximum` and the chunked `dy * (y > 0)` run at a few GB/s on this machine and cost a few us of
fixed overhead per call; one compiled loop per call is ~4x faster at batch 32 (a (32, 16, 32, 32) ReLU: forward
209 -> 53 us, backward 199 -> 73 us) and ~3-5x at batch 1 (7 -> 1.6 us), without the backward's boolean
temporary.

Bit-identical to the numpy kernels they replace (`CoreOps.relu_forward` etc., which remain as the fallback):
- relu forward: y = 0 if x <= 0 else x, numpy's `maximum(x, 0)` (x when x > 0 or x is NaN, so NaN propagates;
  +0.0 for -0.0);
- relu backward: dx = dy * (1 if y > 0 else 0), a product as numpy's (so a non-finite dy stays non-finite:
  inf * 0 = NaN reaches the divergence guard);
- add+ReLU (the compiled step's fusions, `minidl.runtime.program`): forward as `np.add` then the ReLU; backward as the
  ReLU's backward, its result written to the add's two input gradients;
- accumulate (the executor's `into += partial`): a + b, as `np.add`.
Each kernel has a `_parallel` twin that cuts the array into contiguous pieces, one per worker (one OpenMP
region): elementwise, so the split changes no bits. At one thread numpy's two-input `add` is as fast as a
compiled loop here (measured), but it cannot use the second core: at two threads ResNet-50's adds and
accumulations went from one core's speed to ~1.3-1.7x that (they are bound by memory bandwidth).
The arrays are flat (1-D) C-contiguous views: the caller falls back to numpy for anything else.
"""
from __future__ import annotations

import numpy as np
from numba import prange, uint64

from ...core.jit_cache import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
_ADD_BLOCK = 4096  # elements per block of `add_relu` (16 KiB of float32: y's block stays in L1)


@njit(**_OPTS)
def _cut(n, t, workers):
    """Where worker t's piece of n elements starts: multiples of `_ADD_BLOCK`, the last piece ending at n."""
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
        lo, hi = uint64(s), uint64(min(stop, s + _ADD_BLOCK))  # unsigned: numba's negative-index check off
        for i in range(lo, hi):
            y[i] = a[i] + b[i]
        for i in range(lo, hi):
            v = y[i]
            r[i] = z if v <= z else v


@njit(**_OPTS)
def add_relu(a, b, y, r):
    """y = a + b and r = ReLU(y), as `np.add` and `relu_forward` compute them (the compiled step's add+ReLU,
    `minidl.runtime.program`), a block at a time, so that the ReLU reads y from the cache rather than memory. r may be
    exactly a or b (the plan places it there when that input dies at the add): each block is read before it is
    written, and the two loops stay free of overlapping operands, which LLVM vectorizes (one loop with r over a
    ran 3x slower, measured)."""
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
    """r = ReLU(a + b), the sum kept a block at a time in a local buffer (in cache) and not stored: `add_relu`
    where nothing reads the add's output (the compiled step checks the plan). The same values; r may be exactly
    a or b (each block is read before it is written)."""
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
    """d1 = d2 = `relu_backward(y, dy)`: the ReLU's backward and the backward of the add before it (which copies
    its output gradient to both inputs) in one pass, the compiled step's fused add+ReLU backward. The add's
    output gradient itself is not written: the add is its only reader (see `CoreOps.add_relu_backward`).
    d1 or d2 may be exactly y or dy (the plan may place an input gradient where the ReLU's tensors, dead after
    this step, lay): each element is read before it is written. One loop, no block buffer: measured on
    (8, 256, 56, 56), 3.4 ms, against 6.8 for the ReLU's backward and two copies, and 5.5 through a block
    buffer."""
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
    """a += b, one rounding per element (as `np.add`), C-contiguous arrays of one shape: the two halves of a
    weight gradient's sum (`cpu.rows_jit`, `cpu.winograd_jit`, `cpu.winograd`)."""
    af, bf = a.reshape(-1), b.reshape(-1)
    _add_into(af, bf, 0, af.size)


@njit(**_OPTS, parallel=True)
def add_into_parallel(a, b, workers):
    """a += b (the executor's gradient accumulation), one piece per worker."""
    for t in prange(workers):
        _add_into(a, b, _cut(a.size, t, workers), _cut(a.size, t + 1, workers))
