"""Exact GELU and layer norm of the CPU backend compiled with numba, forward and backward.

Layer norm: see the note above its kernels below. Exact GELU: compiled because it needs erf, which numpy does not
have (numba compiles `math.erf` to the C library's); the tanh form runs in numpy (`seq.SeqOps.gelu_forward`), whose
vectorized tanh is far faster than a compiled scalar loop. Each GELU kernel has a `_parallel` twin that cuts the
flat array into one piece per worker: elementwise, so the split changes no bits.

Formulas (PyTorch's `F.gelu`, `approximate='none'`): y = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2));
dy/dx = Phi(x) + x phi(x), phi(x) = exp(-x^2/2) / sqrt(2 pi). Each value is computed in float64 and rounded once to
the array's dtype. The arrays are C-contiguous, of one dtype: the caller falls back to numpy for anything else.
"""
from __future__ import annotations

import math

from numba import prange

from ...core.jit_cache import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
_SQRT_HALF = 0.7071067811865476      # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327   # 1 / sqrt(2 pi)


@njit(**_OPTS)
def _forward(x, y, lo, hi):
    for i in range(lo, hi):
        a = float(x[i])
        y[i] = 0.5 * a * (1.0 + math.erf(a * _SQRT_HALF))


@njit(**_OPTS)
def _backward(x, dy, dx, lo, hi):
    for i in range(lo, hi):
        a = float(x[i])
        dx[i] = float(dy[i]) * (0.5 * (1.0 + math.erf(a * _SQRT_HALF)) + a * _INV_SQRT_2PI * math.exp(-0.5 * a * a))


@njit(**_OPTS)
def gelu_exact_forward(x, y):
    _forward(x, y, 0, x.size)


@njit(**_OPTS, parallel=True)
def gelu_exact_forward_parallel(x, y, workers):
    n = x.size
    for t in prange(workers):
        _forward(x, y, n * t // workers, n * (t + 1) // workers)


@njit(**_OPTS)
def gelu_exact_backward(x, dy, dx):
    _backward(x, dy, dx, 0, x.size)


@njit(**_OPTS, parallel=True)
def gelu_exact_backward_parallel(x, dy, dx, workers):
    n = x.size
    for t in prange(workers):
        _backward(x, dy, dx, n * t // workers, n * (t + 1) // workers)


# -- layer norm over rows ---------------------------------------------------------------------------------------------
# One sweep per row for the statistics (sums in float64, then the mean rounded to the stored dtype and the squared
# deviations from that rounded mean summed: the two-pass numerics of the numpy kernels, on a row in cache), one for
# the output; backward's dx and its weight and bias sums in one pass over the rows, in order. One thread: a GPT
# layer norm (1024 rows of 128) takes ~0.13 ms forward here, less than an OpenMP region costs on a busy machine
# (a 2-thread region waited ~8 ms for a descheduled worker on this shared 2-core VM), and the sums' order, hence
# the bits, cannot depend on the thread count.


@njit(**_OPTS)
def _ln_apply_row(x, w, b, has_w, has_b, m, r, y, i):
    """y[i] = (x[i] - m) * r, then * w, then + b, in the stored dtype: what forward and the recomputing apply both
    run, so they give the same bits."""
    for j in range(x.shape[1]):
        v = (x[i, j] - m) * r
        if has_w:
            v = v * w[j]
        if has_b:
            v = v + b[j]
        y[i, j] = v


@njit(**_OPTS)
def layernorm_forward(x, w, b, has_w, has_b, y, mean, rstd, eps):
    rows, c = x.shape
    for i in range(rows):
        s = 0.0
        for j in range(c):
            s += x[i, j]
        mean[i] = s / c
        m = mean[i]
        q = 0.0
        for j in range(c):
            d = float(x[i, j] - m)
            q += d * d
        rstd[i] = 1.0 / math.sqrt(q / c + eps)
        _ln_apply_row(x, w, b, has_w, has_b, m, rstd[i], y, i)


@njit(**_OPTS)
def layernorm_forward_apply(x, w, b, has_w, has_b, mean, rstd, y):
    for i in range(x.shape[0]):
        _ln_apply_row(x, w, b, has_w, has_b, mean[i], rstd[i], y, i)


@njit(**_OPTS)
def layernorm_backward(x, w, has_w, dy, mean, rstd, dx, has_dx, sum_w, sum_b):
    """dx per row (float64 inside, rounded once); sum_w / sum_b (C,), float64: the sums over rows of dy xhat
    and of dy, in row order (the caller rounds them into the gradients)."""
    rows, c = x.shape
    sum_w[:] = 0.0
    sum_b[:] = 0.0
    for i in range(rows):
        m = float(mean[i])
        r = float(rstd[i])
        c1 = 0.0
        c2 = 0.0
        for j in range(c):
            xhat = (float(x[i, j]) - m) * r
            g = float(dy[i, j])
            sum_w[j] += g * xhat
            sum_b[j] += g
            if has_w:
                g *= float(w[j])
            c1 += g
            c2 += g * xhat
        if not has_dx:
            continue
        c1 /= c
        c2 /= c
        for j in range(c):
            xhat = (float(x[i, j]) - m) * r
            g = float(dy[i, j])
            if has_w:
                g *= float(w[j])
            dx[i, j] = (g - c1 - xhat * c2) * r
