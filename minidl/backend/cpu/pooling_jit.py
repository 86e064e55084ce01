"""Max pooling of the CPU backend compiled with numba on `cpu.pooling`'s phase grids, planes split over threads.
The numpy kernels' values term for term (taps in row-major order, `maximum`'s NaN rule, the backward's
recurrence), no fastmath. Indices are unsigned: numba's negative-index check keeps LLVM from vectorizing.
"""
from __future__ import annotations

import numpy as np
from numba import prange, uint64

from ...core.jit_cache import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)


@njit(**_OPTS)
def _fill(xp, q, phases, cols, sh, sw):
    """Lay plane xp (h, w) on its phase grids q, -inf around it."""
    ninf = q.dtype.type(-np.inf)
    w = xp.shape[1]
    xf = xp.reshape(-1)
    rows = q.shape[1] // cols
    for s in range(phases.shape[0]):
        slot, a, b, t0, nt, u0, nu = phases[s]
        qs = q[slot]
        for i in range(uint64(t0 * cols)):  # padding rows
            qs[i] = ninf
        for i in range(uint64((t0 + nt) * cols), uint64(rows * cols)):
            qs[i] = ninf
        for t in range(uint64(nt)):
            src = uint64((a + t * sh) * w + b)
            d = uint64((t0 + t) * cols)
            for u in range(uint64(u0)):  # padding columns
                qs[d + u] = ninf
            for u in range(uint64(u0 + nu), uint64(cols)):
                qs[d + u] = ninf
            d += uint64(u0)
            for u in range(uint64(nu)):
                qs[d + u] = xf[src + u * sw]


@njit(**_OPTS)
def _reduce_max(q, taps, m, length):
    """m[:length] = the maximum over the taps (slot, offset) in order."""
    n = uint64(length)
    qs = q[taps[0, 0]]
    off = uint64(taps[0, 1])
    for i in range(n):
        m[i] = qs[off + i]
    for k in range(1, taps.shape[0]):
        qs = q[taps[k, 0]]
        off = uint64(taps[k, 1])
        for i in range(n):
            a = m[i]
            v = qs[off + i]
            m[i] = a if (a >= v) | (a != a) else v


@njit(**_OPTS)
def maxpool_forward(x, y, q, m, phases, taps, cols, sh, sw, lo, hi):
    """y[p] for planes [lo, hi) of x; q and m are scratch."""
    ho, wo = y.shape[1], y.shape[2]
    length = (ho - 1) * cols + wo
    for p in range(lo, hi):
        _fill(x[p], q, phases, cols, sh, sw)
        _reduce_max(q, taps, m, length)
        for oh in range(ho):
            for ow in range(wo):
                y[p, oh, ow] = m[oh * cols + ow]


@njit(**_OPTS, parallel=True)
def maxpool_forward_parallel(x, y, q, m, phases, taps, cols, sh, sw, workers):
    """The forward, worker t on a share of the planes with scratch q[t], m[t]."""
    n = x.shape[0]
    for t in prange(workers):
        maxpool_forward(x, y, q[t], m[t], phases, taps, cols, sh, sw, n * t // workers, n * (t + 1) // workers)


@njit(**_OPTS)
def maxpool_backward(x, dy, dx, q, dq, m, r, phases, taps, cols, sh, sw, covers, lo, hi):
    """dx[p] for planes [lo, hi); q, dq, m, r are scratch."""
    ho, wo = dy.shape[1], dy.shape[2]
    length = (ho - 1) * cols + wo
    zero, one = dx.dtype.type(0), dx.dtype.type(1)
    last = taps.shape[0] - 1
    for p in range(lo, hi):
        _fill(x[p], q, phases, cols, sh, sw)
        _reduce_max(q, taps, m, length)
        for oh in range(ho):  # r = dy on the grid, zero between rows
            for ow in range(cols):
                r[oh * cols + ow] = dy[p, oh, ow] if ow < wo else zero
        dqf = dq.reshape(-1)
        for i in range(uint64(dqf.size)):
            dqf[i] = zero
        n = uint64(length)
        for k in range(taps.shape[0]):
            qs, dqs = q[taps[k, 0]], dq[taps[k, 0]]
            off = uint64(taps[k, 1])
            if k != last:
                for i in range(n):
                    g = r[i] * (one if qs[off + i] == m[i] else zero)
                    dqs[off + i] += g
                    r[i] -= g
            else:
                for i in range(n):
                    dqs[off + i] += r[i] * (one if qs[off + i] == m[i] else zero)
        dxp = dx[p]
        if not covers:
            for ih in range(dxp.shape[0]):
                for iw in range(dxp.shape[1]):
                    dxp[ih, iw] = zero
        dxf, w = dxp.reshape(-1), dxp.shape[1]
        for s in range(phases.shape[0]):
            slot, a, b, t0, nt, u0, nu = phases[s]
            dqs = dq[slot]
            for t in range(uint64(nt)):
                dst = uint64((a + t * sh) * w + b)
                d = uint64((t0 + t) * cols + u0)
                for u in range(uint64(nu)):
                    dxf[dst + u * sw] = dqs[d + u]


@njit(**_OPTS, parallel=True)
def maxpool_backward_parallel(x, dy, dx, q, dq, m, r, phases, taps, cols, sh, sw, covers, workers):
    """The backward, worker t on a share of the planes with its own scratch."""
    n = x.shape[0]
    for t in prange(workers):
        maxpool_backward(x, dy, dx, q[t], dq[t], m[t], r[t], phases, taps, cols, sh, sw, covers,
                         n * t // workers, n * (t + 1) // workers)
