"""GELU (both forms), layer norm and the embedding gradient of the CPU backend compiled with numba.

Layer norm and the embedding gradient: see the notes above their kernels below; the row sums and the float32
tanh come from `rowmath_jit`.

Exact GELU: compiled because it needs erf, which numpy does not have (numba compiles `math.erf` to the C
library's). Each exact GELU kernel has a `_parallel` twin that cuts the flat array into one piece per worker:
elementwise, so the split changes no bits. The tanh form has none: its serial loop vectorizes and the split
one did not (GPT-2 small's MLP, 512 x 3072 values, quiet 2-core EPYC: forward 0.74 ms on one thread, 1.12 ms
on two; the exact form, a scalar erf, 10.7 ms against 5.8).

Formulas (PyTorch's `F.gelu`): exact, y = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)); dy/dx = Phi(x) + x phi(x),
phi(x) = exp(-x^2/2) / sqrt(2 pi), each value computed in float64 and rounded once to the array's dtype. tanh,
y = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3); dy/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u)
sqrt(2/pi) (1 + 3 0.044715 x^2), in the dtype and the operation order of the numpy twins (`seq.SeqOps`), float32
through `rowmath_jit._tanh32` (vectorized: numba's tanh is the C library's scalar call, ~150x slower than
numpy's vectorized float32 tanh), float64 through `math.tanh`. The arrays are C-contiguous, of one dtype: the
caller falls back to numpy for anything else.
"""
from __future__ import annotations

import math

import numpy as np
from numba import prange

from ...core.jit_cache import njit
from .rowmath_jit import _LANES, _exp_shifted, _row_max, _sum, _tanh32
from .seq import _SQRT_2_OVER_PI, _TANH_CUBIC

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


_K, _C = _SQRT_2_OVER_PI, _TANH_CUBIC  # the numpy twins' constants


@njit(**_OPTS)
def _tanh_forward(x, y, lo, hi):
    t = x.dtype.type
    k, c, one, half = t(_K), t(_C), t(1), t(0.5)
    if x.itemsize == 4:
        for i in range(lo, hi):
            a = x[i]
            y[i] = (_tanh32((a * a * c + one) * a * k) + one) * a * half
    else:
        for i in range(lo, hi):
            a = x[i]
            y[i] = (math.tanh((a * a * c + one) * a * k) + one) * a * half


@njit(**_OPTS)
def _tanh_backward(x, dy, dx, lo, hi):
    t = x.dtype.type
    k, c3, one, half, halfk = t(_K), t(3 * _C), t(1), t(0.5), t(0.5 * _K)
    c = t(_C)
    for i in range(lo, hi):
        a = x[i]
        u = (a * a * c + one) * a * k
        th = _tanh32(u) if x.itemsize == 4 else math.tanh(u)
        q = (a * a * c3 + one) * a * halfk
        dx[i] = ((th + one) * half + q * (one - th * th)) * dy[i]


@njit(**_OPTS)
def gelu_tanh_forward(x, y):
    _tanh_forward(x, y, 0, x.size)


@njit(**_OPTS)
def gelu_tanh_backward(x, dy, dx):
    _tanh_backward(x, dy, dx, 0, x.size)


# -- layer norm over rows ---------------------------------------------------------------------------------------------
# Note [layer norm on threads]
# Rules: each row's statistics and dx are computed by one thread; each column's weight and bias sums by one
# thread, over the rows in row order; so the bits never depend on the thread count.
# Approach: a row's sums run in `_LANES` float64 lanes (`_sum`, over the row or a float64 scratch row of the
# terms): lane l adds the values at l, l + 64, ... in order, then the lanes are added in a fixed tree and the
# tail after them. The order is fixed by the row's length alone, so it is the same on any CPU and vector width
# (nothing is compiled with fastmath: LLVM keeps the written order), and it vectorizes, where one running sum
# cannot (measured, sums of float32 rows of 50257: 0.24 ns a value with one sum or 8 lanes, 0.08 with 64).
# Forward splits the rows into one piece per worker; backward's region gives worker t a piece of the rows (their
# dx) and a piece of the columns (their weight and bias sums over every row). Statistics: sums in float64, the
# mean rounded to the stored dtype and the squared deviations from that rounded mean summed (two passes, no
# cancellation), on a row in cache. Loops run over 1-D row views: numba vectorized none over x[i, j].
# Measured at GPT-2 small's shape ((512, 768) float32), one thread's CPU time: forward 0.45 -> 0.12 ms, backward
# 0.48 -> 0.21 ms against the one-running-sum kernels this replaced (which ran on one thread). The threads
# (`jit.workers_for`, as every compiled kernel) pay only where a second core is free: on the shared 2-core VM,
# with other jobs holding the second core, forward took 0.58 ms on two threads (the region waits for its
# descheduled worker), and once 0.14 ms against 0.27 on one when that core was mostly free.



@njit(**_OPTS)
def _ln_apply_row(x, w, b, has_w, has_b, m, r, y):
    """y = (x - m) * r, then * w, then + b, for one row, in the stored dtype: what forward and the recomputing
    apply both run, so they give the same bits."""
    for j in range(x.shape[0]):
        v = (x[j] - m) * r
        if has_w:
            v = v * w[j]
        if has_b:
            v = v + b[j]
        y[j] = v


@njit(**_OPTS)
def _ln_forward_rows(x, w, b, has_w, has_b, y, mean, rstd, eps, lo, hi):
    c = x.shape[1]
    sq, acc = np.empty(c), np.empty(_LANES)  # one row of squared deviations, the sums' lanes (float64 scratch)
    for i in range(lo, hi):
        xi = x[i]
        mean[i] = _sum(xi, acc) / c
        m = mean[i]
        for j in range(c):
            d = float(xi[j] - m)  # in the stored dtype, then squared in float64
            sq[j] = d * d
        rstd[i] = 1.0 / math.sqrt(_sum(sq, acc) / c + eps)
        _ln_apply_row(xi, w, b, has_w, has_b, m, rstd[i], y[i])


@njit(**_OPTS)
def layernorm_forward(x, w, b, has_w, has_b, y, mean, rstd, eps):
    _ln_forward_rows(x, w, b, has_w, has_b, y, mean, rstd, eps, 0, x.shape[0])


@njit(**_OPTS, parallel=True)
def layernorm_forward_parallel(x, w, b, has_w, has_b, y, mean, rstd, eps, workers):
    rows = x.shape[0]
    for t in prange(workers):
        _ln_forward_rows(x, w, b, has_w, has_b, y, mean, rstd, eps, rows * t // workers, rows * (t + 1) // workers)


@njit(**_OPTS)
def _ln_apply_rows(x, w, b, has_w, has_b, mean, rstd, y, lo, hi):
    for i in range(lo, hi):
        _ln_apply_row(x[i], w, b, has_w, has_b, mean[i], rstd[i], y[i])


@njit(**_OPTS)
def layernorm_forward_apply(x, w, b, has_w, has_b, mean, rstd, y):
    _ln_apply_rows(x, w, b, has_w, has_b, mean, rstd, y, 0, x.shape[0])


@njit(**_OPTS, parallel=True)
def layernorm_forward_apply_parallel(x, w, b, has_w, has_b, mean, rstd, y, workers):
    rows = x.shape[0]
    for t in prange(workers):
        _ln_apply_rows(x, w, b, has_w, has_b, mean, rstd, y, rows * t // workers, rows * (t + 1) // workers)


@njit(**_OPTS)
def _ln_dx_rows(x, w, has_w, dy, mean, rstd, dx, lo, hi):
    """dx for rows [lo, hi): g = dy w, xhat = (x - mean) rstd (float64); c1 = mean of g, c2 = mean of g xhat
    (`_sum` over a row of each, kept in float64 scratch); dx = (g - c1 - xhat c2) rstd, rounded once."""
    c = x.shape[1]
    gs, hs, acc = np.empty(c), np.empty(c), np.empty(_LANES)  # one row of g and of g xhat, the sums' lanes
    for i in range(lo, hi):
        m = float(mean[i])
        r = float(rstd[i])
        xi, gi, di = x[i], dy[i], dx[i]  # row views: numba vectorizes loops over 1-D views, not over x[i, j]
        for j in range(c):
            g = float(gi[j])
            if has_w:
                g *= float(w[j])
            gs[j] = g
            hs[j] = g * ((float(xi[j]) - m) * r)
        c1 = _sum(gs, acc) / c
        c2 = _sum(hs, acc) / c
        for j in range(c):
            di[j] = (gs[j] - c1 - ((float(xi[j]) - m) * r) * c2) * r


@njit(**_OPTS)
def _ln_param_sums(x, dy, mean, rstd, sum_w, sum_b, lo, hi):
    """sum_w[j] = the sum over rows (in order) of dy xhat, sum_b[j] of dy, for the columns [lo, hi), in float64."""
    sw, sb = sum_w[lo:hi], sum_b[lo:hi]
    sw[:] = 0.0
    sb[:] = 0.0
    for i in range(x.shape[0]):
        m = float(mean[i])
        r = float(rstd[i])
        xi, gi = x[i, lo:hi], dy[i, lo:hi]
        for j in range(hi - lo):
            g = float(gi[j])
            sw[j] += g * ((float(xi[j]) - m) * r)
            sb[j] += g


@njit(**_OPTS)
def layernorm_backward(x, w, has_w, dy, mean, rstd, dx, has_dx, sum_w, sum_b):
    """dx (float64 inside, rounded once) where `has_dx`; sum_w / sum_b (C,), float64: the sums over rows of
    dy xhat and of dy, in row order (the caller rounds them into the gradients)."""
    if has_dx:
        _ln_dx_rows(x, w, has_w, dy, mean, rstd, dx, 0, x.shape[0])
    _ln_param_sums(x, dy, mean, rstd, sum_w, sum_b, 0, x.shape[1])


@njit(**_OPTS, parallel=True)
def layernorm_backward_parallel(x, w, has_w, dy, mean, rstd, dx, has_dx, sum_w, sum_b, workers):
    rows, c = x.shape
    for t in prange(workers):
        if has_dx:
            _ln_dx_rows(x, w, has_w, dy, mean, rstd, dx, rows * t // workers, rows * (t + 1) // workers)
        _ln_param_sums(x, dy, mean, rstd, sum_w, sum_b, c * t // workers, c * (t + 1) // workers)


# -- embedding gradient ---------------------------------------------------------------------------------------------
# dw[v] = the sum of dy[r] over the rows r with idx[r] == v, in row order, from zero: the sums `np.add.at` makes,
# bit for bit. Worker t owns the table rows [V t / workers, V (t + 1) / workers): it zeroes them, then walks every
# index in order and adds the rows that land in its range. No table row is written by two threads and each is
# summed in row order, so the bits never depend on the thread count. Zeroing the table is most of the work (GPT-2's
# 50257 x 768 float32 table is 154 MB against 1.5 MB of dy at batch 4 x 128), and it splits with the rows.


@njit(**_OPTS)
def _embedding_backward_rows(idx, dy, dw, lo, hi):
    dw[lo:hi] = 0
    for r in range(idx.shape[0]):
        v = idx[r]
        if lo <= v < hi:
            d, g = dw[v], dy[r]
            for j in range(d.shape[0]):
                d[j] += g[j]


@njit(**_OPTS)
def embedding_backward(idx, dy, dw):
    _embedding_backward_rows(idx, dy, dw, 0, dw.shape[0])


@njit(**_OPTS, parallel=True)
def embedding_backward_parallel(idx, dy, dw, workers):
    v = dw.shape[0]
    for t in prange(workers):
        _embedding_backward_rows(idx, dy, dw, v * t // workers, v * (t + 1) // workers)


# -- softmax over rows (the Softmax layer's and attention's) ----------------------------------------------------------
# Rows of (R, T). Attention calls these on one sample's (H*T, T) scores: with `causal`, row r is query r % T and
# sees the keys 0 .. r % T only (the others get probability 0, exactly). One pass to scale and take the max (as
# integers: `rowmath_jit._row_max`), one for exp(s - max) (`_exp_shifted`), one for the sum (`_sum`) and one
# to normalize, over a row in cache, where the numpy passes made six over the sample's whole (H, T, T) block.
# A row with a NaN or +inf score gets NaNs (numpy's result). Rows are independent: the caller splits samples,
# never a row.


@njit(**_OPTS)
def _softmax_rows(s, p, scale, causal, lo, hi):
    """p[r] = softmax(s[r] * scale) over the row's visible entries, 0 past them; s and p may be one array."""
    t = s.shape[1]
    sc = s.dtype.type(scale)
    e, acc = np.empty(t, s.dtype), np.empty(_LANES)  # a row of exponentials (in place, the exp ran ~25x slower)
    for r in range(lo, hi):
        n = r % t + 1 if causal else t
        si, pi = s[r], p[r]
        for j in range(n):
            pi[j] = si[j] * sc
        for j in range(n, t):
            pi[j] = 0
        m, bad = _row_max(pi[:n])
        if bad:
            pi[:n] = np.nan
            continue
        en = e[:n]
        _exp_shifted(pi[:n], m, en)
        inv = 1.0 / _sum(en, acc)
        for j in range(n):
            pi[j] = float(en[j]) * inv


@njit(**_OPTS)
def softmax_rows(s, p, scale, causal):
    _softmax_rows(s, p, scale, causal, 0, s.shape[0])


@njit(**_OPTS)
def _softmax_backward_rows(y, dy, dx, scale, lo, hi):
    """dx[r] = (dy[r] - sum(dy[r] y[r])) * y[r] * scale, in float64 (the sum in `_sum`'s order), rounded once;
    dx may be dy."""
    t = y.shape[1]
    prod, acc = np.empty(t), np.empty(_LANES)  # one row of dy * y, the sum's lanes (float64 scratch)
    for r in range(lo, hi):
        yi, gi, di = y[r], dy[r], dx[r]
        for j in range(t):
            prod[j] = float(gi[j]) * float(yi[j])
        dot = _sum(prod, acc)
        for j in range(t):
            di[j] = (float(gi[j]) - dot) * float(yi[j]) * scale


@njit(**_OPTS)
def softmax_backward_rows(y, dy, dx, scale):
    _softmax_backward_rows(y, dy, dx, scale, 0, y.shape[0])


@njit(**_OPTS, parallel=True)
def softmax_rows_parallel(s, p, scale, causal, workers):
    rows = s.shape[0]
    for t in prange(workers):
        _softmax_rows(s, p, scale, causal, rows * t // workers, rows * (t + 1) // workers)


@njit(**_OPTS, parallel=True)
def softmax_backward_rows_parallel(y, dy, dx, scale, workers):
    rows = y.shape[0]
    for t in prange(workers):
        _softmax_backward_rows(y, dy, dx, scale, rows * t // workers, rows * (t + 1) // workers)
