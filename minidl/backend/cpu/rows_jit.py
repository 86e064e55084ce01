"""The row-shift convolution (`cpu.conv._RowShift`) compiled with numba: one OpenMP region a call.

Why. The row-shift pair runs CIFAR's 16-channel layers (below Winograd's 32 channels) and every stride-2 3x3.
In numpy, its per-sample GEMMs ((16, 48) x (48, 1024) in ResNet-56's first stage) split over Python threads
(`cpu.lanes`) scaled poorly at two threads: a hand-off costs 30-70 us, the batch's rows buffer (6.5 MB there)
streams through memory between the copies and the GEMMs, every kernel row's product goes through a scratch
and an addition, and the weight gradient could split only its three kernel rows over two threads (measured,
in the network at two threads: forward 1.39 ms, weight gradient 2.17 ms, against 2.36 and 2.57 at one).
Here each worker takes whole samples: it builds one sample's rows in its own slot of the buffer (which stays
in cache), then runs that sample's kh GEMMs through numpy's BLAS (`cpu.gemm_jit`), the first writing, the
others accumulating in the BLAS (beta = 1): no scratch, no separate addition.

The weight gradient is a sum over samples, which a split by samples would cut. So its summation order is fixed
by the shapes, whatever the threads: two halves of the batch, each summed in sample order into its own
accumulator (the first half into the workspace's, the second into dW's own memory, which is written only at
the end), then added. One worker runs both halves in turn, two run one each: the same bits (tested on 1, 2, 3
threads). The same formulation runs every algorithm of the layer (`rows` and `rows_chunked`), so every
budget gives the same bits too.

Exactness. The rows are copies; each output is the BLAS's own sum of its kernel rows' products in order, the
same call whichever worker makes it (the BLAS runs one thread a call: `cpu.lanes.blas_pinned`). Nothing is
compiled with fastmath.
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
    """One sample's rows: b (C, kw, Hp, Wo) <- the column taps of x (C, H, W), both C-contiguous. row_src[R] is
    the input row that the buffer's row R holds (-1: padding; rows may be stored phase by phase, see
    `_RowShift`); cols[j] = (lo, n, iw0): tap j's output columns [lo, lo + n) read input columns iw0, iw0 + sw,
    ...; the rest is zero. Flat unsigned indices (see `cpu.winograd_jit`): with numba's signed, wrap-checked
    indexing the same loops ran 5x slower than numpy's strided copies."""
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
    """Samples [lo, hi), each one's rows built in buf[slot], then its kh GEMMs. Forward (other: Wr (kh, Cout,
    K3), out: y (N, Cout, P)): y[k] = sum over kernel rows i (in order) of Wr[i] @ window_i; with `acc`,
    y[k] += that sum, finished in tiles[slot] (Cout, P) first. With `grad` (other: dy (N, Cout, P), out: an
    accumulator (kh, K3, Cout)): out[i] = sum over the samples (in order) of window_i @ dy[k].T."""
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
    """The forward of every sample on this thread, rows in buf[0]. y: (N, Cout, P); wr: (kh, Cout, K3); `acc`:
    y += the forward, through tiles[0] (`_per_sample`)."""
    _per_sample(x, wr, y, buf, row_src, cols, sw, wins, p, 0, 0, x.shape[0], False, tiles, acc)


@njit(parallel=True, **_OPTS)
def forward_parallel(x, wr, y, buf, row_src, cols, sw, wins, p, tiles, acc, workers):
    """The forward on `workers` threads (one OpenMP region), worker w on a contiguous share of the samples
    with its rows in buf[w] (and its tile in tiles[w]); the BLAS must run one thread a call."""
    n = x.shape[0]
    for w in prange(workers):
        _per_sample(x, wr, y, buf, row_src, cols, sw, wins, p, w, n * w // workers, n * (w + 1) // workers,
                    False, tiles, acc)


@njit(**_OPTS)
def rows2im(b, dx, row_src, cols, sw):
    """One sample's dx (C, H, W) = the sum over the column taps j (in order) of b's rows (C, kw, Hp, Wo)
    scattered back to the input columns they were copied from (the mirror of `im2rows`; each input row is
    stored once, so every value of dx sums one term per tap)."""
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
    """dx (C, H, W) += what `rows2im` writes, exactly dx + (rows2im's values): each input row's column taps are
    scattered in order into a one-row sum (from zero, as rows2im sums them in dx), which is then added to the
    row of dx. Every input row is stored once (`row_src`), so each row of dx is added to once."""
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
    """Samples [lo, hi) of dx where the flipped forward does not apply (stride 2 down the rows): the rows'
    gradient in buf[slot], sum over kernel rows i (in order) of Wr[i].T @ dy[k] added at window i, then
    scattered back (`rows2im`); with `acc`, added to dx (`rows2im_add`)."""
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
    """dx (+)= the rows' gradient, every sample on this thread (rows in buf[0]). dy: (N, Cout, P)."""
    _input_grad_share(wr, dy, dx, buf, row_src, cols, sw, wins, p, 0, 0, dx.shape[0], acc)


@njit(parallel=True, **_OPTS)
def input_grad_parallel(wr, dy, dx, buf, row_src, cols, sw, wins, p, acc, workers):
    """The same on `workers` threads, worker w on a contiguous share of the samples with its rows in buf[w]."""
    n = dx.shape[0]
    for w in prange(workers):
        _input_grad_share(wr, dy, dx, buf, row_src, cols, sw, wins, p, w, n * w // workers, n * (w + 1) // workers,
                          acc)


@njit(**_OPTS)
def weight_grad(x, dy, acc, acc2, buf, row_src, cols, sw, wins, p):
    """dW's accumulator on this thread: acc = (the first half's sum) + (the second half's, in acc2); rows in
    buf[0]. acc, acc2: (kh, K3, Cout); dy: (N, Cout, P). With one sample there is one half."""
    n = x.shape[0]
    half = n // 2 if n > 1 else n
    _per_sample(x, dy, acc, buf, row_src, cols, sw, wins, p, 0, 0, half, True, acc, False)
    if half < n:
        _per_sample(x, dy, acc2, buf, row_src, cols, sw, wins, p, 0, half, n, True, acc2, False)
        add_into(acc, acc2)


@njit(parallel=True, **_OPTS)
def weight_grad_parallel(x, dy, acc, acc2, buf, row_src, cols, sw, wins, p, workers):
    """The same two halves on two threads (`workers` is 2: one per half), rows in buf[0] and buf[1]; then the
    same addition."""
    n = x.shape[0]
    half = n // 2
    for w in prange(workers):
        if w == 0:
            _per_sample(x, dy, acc, buf, row_src, cols, sw, wins, p, 0, 0, half, True, acc, False)
        else:
            _per_sample(x, dy, acc2, buf, row_src, cols, sw, wins, p, 1, half, n, True, acc2, False)
    add_into(acc, acc2)
