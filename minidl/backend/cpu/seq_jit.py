"""GELU, layer norm, the embedding gradient and row softmax of the CPU backend compiled with numba.

Rules: a row is one thread's, its sums in `rowmath_jit._sum`'s lanes; a column's or an embedding row's sums
are one thread's, over rows in order; no fastmath: the bits never depend on the threads or the CPU. GELU is
`F.gelu`: exact in float64, rounded once; tanh in `seq.SeqOps`' dtype and order, serial only (it vectorizes;
split, it did not: GPT-2 small's MLP 0.74 ms on one thread, 1.12 on two).
"""
from __future__ import annotations

import math

import numpy as np
from numba import prange

from ...core.jit_cache import njit
from .rowmath_jit import _LANES, _exp_shifted, _row_max, _sum, _tanh32
from .seq import _SQRT_2_OVER_PI, _TANH_CUBIC

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
_SQRT_HALF = 0.7071067811865476  # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 pi)


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


_K, _C = _SQRT_2_OVER_PI, _TANH_CUBIC


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


# Layer norm: worker t takes a piece of the rows, and in backward a piece of the columns' parameter sums.


@njit(**_OPTS)
def _ln_apply_row(x, w, b, has_w, has_b, m, r, y):
    """y = (x - m) * r, then * w, then + b, in the stored dtype: forward's and recomputation's."""
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
    sq, acc = np.empty(c), np.empty(_LANES)
    for i in range(lo, hi):
        xi = x[i]
        mean[i] = _sum(xi, acc) / c
        m = mean[i]
        for j in range(c):
            d = float(xi[j] - m)  # the stored dtype's, squared in float64
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
    """dx = (g - mean(g) - xhat mean(g xhat)) rstd per row, g = dy w, in float64, rounded once."""
    c = x.shape[1]
    gs, hs, acc = np.empty(c), np.empty(c), np.empty(_LANES)
    for i in range(lo, hi):
        m = float(mean[i])
        r = float(rstd[i])
        xi, gi, di = x[i], dy[i], dx[i]  # numba vectorizes over 1-D views only
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
    """Columns [lo, hi) of the float64 sums over rows, in order, of dy xhat and dy."""
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
    """dx where `has_dx`; sum_w / sum_b (C,) float64, rounded into the gradients by the caller."""
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


# Embedding gradient: worker t zeroes its table rows and adds the dy rows landing there in order (`np.add.at`'s).


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


# Row softmax; with `causal` (attention's (H*T, T) scores) row r sees keys 0 .. r % T. NaN or +inf: NaNs.


@njit(**_OPTS)
def _softmax_rows(s, p, scale, causal, lo, hi):
    """p[r] = softmax(s[r] * scale) over the row's visible entries, 0 past them; p may be s."""
    t = s.shape[1]
    sc = s.dtype.type(scale)
    e, acc = np.empty(t, s.dtype), np.empty(_LANES)  # not in place: the exp ran ~25x slower
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
    """dx[r] = (dy[r] - sum(dy[r] y[r])) * y[r] * scale in float64, rounded once; dx may be dy."""
    t = y.shape[1]
    prod, acc = np.empty(t), np.empty(_LANES)
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
