"""The row-shift convolution (`cpu.conv._RowShift`) compiled with numba: one OpenMP region a call.

Each worker takes whole samples: one sample's rows in its own slot of the buffer (warm in cache), then its kh
GEMMs through numpy's BLAS (`cpu.gemm_jit`), the first writing, the others accumulating (beta 1). ResNet-56 at
two threads, numpy lanes: forward 1.39 ms, weight gradient 2.17 (2.36 and 2.57 at one).
Rules: the weight gradient sums two fixed halves of the batch in sample order (the second in dW's memory), then
adds them, so one or two workers give the same bits; the BLAS runs one thread a call; no fastmath.
"""
from __future__ import annotations

import numpy as np
from numba import prange, uint64

from ...core.jit_cache import njit
from .eltwise_jit import add_into
from .gemm_jit import gemm_acc

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)


@njit(**_OPTS)
def im2rows(x, b, row_src, cols, sw):
    """One sample's rows b (C, kw, Hp, Wo) <- x's column taps: row_src[R] the input row of stored row R (-1:
    padding), cols[j] = (lo, n, iw0). Flat unsigned indices: signed ones ran 5x slower than numpy."""
    c_in, kw, hp, wo = b.shape
    h, w = x.shape[1], x.shape[2]
    xf = x.reshape(-1)
    bf = b.reshape(-1)
    zero = b.dtype.type(0)
    uwo, ustep = uint64(wo), uint64(sw)
    for c in range(c_in):
        for j in range(kw):
            lo, n = uint64(cols[j, 0]), uint64(cols[j, 1])
            for r in range(hp):
                d = uint64(((c * kw + j) * hp + r) * wo)
                ih = row_src[r]
                if ih < 0 or n == 0:
                    for q in range(uwo):
                        bf[d + q] = zero
                    continue
                src = uint64((c * h + ih) * w + cols[j, 2])
                for q in range(lo):
                    bf[d + q] = zero
                if sw == 1:
                    for q in range(n):
                        bf[d + lo + q] = xf[src + q]
                else:
                    for q in range(n):
                        bf[d + lo + q] = xf[src + q * ustep]
                for q in range(lo + n, uwo):
                    bf[d + q] = zero


@njit(**_OPTS)
def _per_sample(x, other, out, buf, row_src, cols, sw, wins, p, slot, lo, hi, grad, tiles, acc):
    """Samples [lo, hi), rows in buf[slot], then kh GEMMs: y[k] (+= via tiles[slot] with `acc`) = sum
    over i of Wr[i] @ window_i; with `grad`, out[i] = sum over samples of window_i @ dy[k].T."""
    k3 = buf.shape[1] * buf.shape[2]
    rows = buf[slot].reshape((k3, buf.shape[3] * buf.shape[4]))
    for k in range(lo, hi):
        im2rows(x[k], buf[slot], row_src, cols, sw)
        if grad:
            for i in range(wins.shape[0]):
                o = wins[i]
                gemm_acc(rows[:, o:o + p], other[k], out[i], False, True, k > lo)
            continue
        dst = tiles[slot] if acc else out[k]
        for i in range(wins.shape[0]):
            o = wins[i]
            gemm_acc(other[i], rows[:, o:o + p], dst, False, False, i > 0)
        if acc:
            add_into(out[k], tiles[slot])


@njit(**_OPTS)
def forward(x, wr, y, buf, row_src, cols, sw, wins, p, tiles, acc):
    """The forward of every sample on this thread, rows in buf[0]."""
    _per_sample(x, wr, y, buf, row_src, cols, sw, wins, p, 0, 0, x.shape[0], False, tiles, acc)


@njit(parallel=True, **_OPTS)
def forward_parallel(x, wr, y, buf, row_src, cols, sw, wins, p, tiles, acc, workers):
    """The forward on `workers` threads, worker w on a contiguous share, rows in buf[w]."""
    n = x.shape[0]
    for w in prange(workers):
        _per_sample(x, wr, y, buf, row_src, cols, sw, wins, p, w, n * w // workers, n * (w + 1) // workers,
                    False, tiles, acc)


@njit(**_OPTS)
def rows2im(b, dx, row_src, cols, sw):
    """One sample's dx (C, H, W) = the sum over column taps in order of b's rows scattered back."""
    c_in, kw, hp, wo = b.shape
    h, w = dx.shape[1], dx.shape[2]
    dxf = dx.reshape(-1)
    bf = b.reshape(-1)
    zero = dx.dtype.type(0)
    for i in range(uint64(dxf.size)):
        dxf[i] = zero
    ustep = uint64(sw)
    for c in range(c_in):
        for j in range(kw):
            lo, n = cols[j, 0], uint64(cols[j, 1])
            for r in range(hp):
                ih = row_src[r]
                if ih < 0:
                    continue
                d = uint64((c * h + ih) * w + cols[j, 2])
                s = uint64(((c * kw + j) * hp + r) * wo + lo)
                for q in range(n):
                    dxf[d + q * ustep] += bf[s + q]


@njit(**_OPTS)
def rows2im_add(b, dx, row_src, cols, sw):
    """dx += what `rows2im` writes, exactly: each input row summed from zero in a row, then added."""
    c_in, kw, hp, wo = b.shape
    h, w = dx.shape[1], dx.shape[2]
    dxf = dx.reshape(-1)
    bf = b.reshape(-1)
    row = np.empty(w, dx.dtype)
    zero = dx.dtype.type(0)
    ustep = uint64(sw)
    for c in range(c_in):
        for r in range(hp):
            ih = row_src[r]
            if ih < 0:
                continue
            for i in range(uint64(w)):
                row[i] = zero
            for j in range(kw):
                lo, n, iw0 = cols[j, 0], uint64(cols[j, 1]), uint64(cols[j, 2])
                s = uint64(((c * kw + j) * hp + r) * wo + lo)
                for q in range(n):
                    row[iw0 + q * ustep] += bf[s + q]
            d = uint64((c * h + ih) * w)
            for i in range(uint64(w)):
                dxf[d + i] += row[i]


@njit(**_OPTS)
def _input_grad_share(wr, dy, dx, buf, row_src, cols, sw, wins, p, slot, lo, hi, acc):
    """Samples [lo, hi) of dx where the flipped forward does not apply: sum over kernel rows of
    Wr[i].T @ dy[k] at window i, then `rows2im` (`rows2im_add` with `acc`)."""
    k3 = buf.shape[1] * buf.shape[2]
    rows = buf[slot].reshape((k3, buf.shape[3] * buf.shape[4]))
    flat = rows.reshape(-1)
    zero = rows.dtype.type(0)
    for k in range(lo, hi):
        for i in range(uint64(flat.size)):
            flat[i] = zero
        for i in range(wins.shape[0]):
            o = wins[i]
            gemm_acc(wr[i], dy[k], rows[:, o:o + p], True, False, True)
        if acc:
            rows2im_add(buf[slot], dx[k], row_src, cols, sw)
        else:
            rows2im(buf[slot], dx[k], row_src, cols, sw)


@njit(**_OPTS)
def input_grad(wr, dy, dx, buf, row_src, cols, sw, wins, p, acc):
    """dx (+)= the rows' gradient, every sample on this thread."""
    _input_grad_share(wr, dy, dx, buf, row_src, cols, sw, wins, p, 0, 0, dx.shape[0], acc)


@njit(parallel=True, **_OPTS)
def input_grad_parallel(wr, dy, dx, buf, row_src, cols, sw, wins, p, acc, workers):
    """The same on `workers` threads, rows in buf[w]."""
    n = dx.shape[0]
    for w in prange(workers):
        _input_grad_share(wr, dy, dx, buf, row_src, cols, sw, wins, p, w, n * w // workers, n * (w + 1) // workers,
                          acc)


@njit(**_OPTS)
def weight_grad(x, dy, acc, acc2, buf, row_src, cols, sw, wins, p):
    """acc = (first half's sum) + (second half's, in acc2), on this thread."""
    n = x.shape[0]
    half = n // 2 if n > 1 else n
    _per_sample(x, dy, acc, buf, row_src, cols, sw, wins, p, 0, 0, half, True, acc, False)
    if half < n:
        _per_sample(x, dy, acc2, buf, row_src, cols, sw, wins, p, 0, half, n, True, acc2, False)
        add_into(acc, acc2)


@njit(parallel=True, **_OPTS)
def weight_grad_parallel(x, dy, acc, acc2, buf, row_src, cols, sw, wins, p, workers):
    """The same two halves on two threads, rows in buf[0] and buf[1]."""
    n = x.shape[0]
    half = n // 2
    for w in prange(workers):
        if w == 0:
            _per_sample(x, dy, acc, buf, row_src, cols, sw, wins, p, 0, 0, half, True, acc, False)
        else:
            _per_sample(x, dy, acc2, buf, row_src, cols, sw, wins, p, 1, half, n, True, acc2, False)
    add_into(acc, acc2)
