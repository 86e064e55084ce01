"""Max pooling of the CPU backend compiled with numba: forward and backward, planes split over threads.

Why. numpy's phase-grid kernels (`cpu_pool`) make about 3 + 5 * taps ufunc calls a block, each a pass over
memory, and run on one thread: ResNet-50's max-pool ((8, 64, 112, 112), 3x3 stride 2) took ~30 ms backward
at two threads, against PyTorch's < 17 ms. Here one loop nest a plane reads the input plane once per tap
from cache, and the planes are split over the compiled kernels' threads (one OpenMP region a call).

The same values as the numpy kernels, term for term:
- forward: m = the window's first in-bounds tap's value, then `maximum(m, v)` for each later tap in row-major
  window order, as numpy's ufunc computes it (m stays when m >= v or m is NaN); a tap in the padding reads
  -inf, which never replaces m, so it is skipped (a window wholly in the padding is refused at build);
- backward: the same recurrence as `PoolOps.maxpool2d_backward`, output by output: r = dy, then for each tap
  in row-major order g = r * (1 if v == m else 0) and r -= g (not after the last tap), g added to the tap's
  input element (a padding tap's g is dropped, its v is -inf). Each input element receives its terms in tap
  order, the order numpy adds them in, so sums of several windows round the same; non-finite dy and NaN
  maxima give what the numpy kernel gives (inf * 0 is NaN there too).
Planes are independent, so the split over threads changes no bits. Nothing is compiled with fastmath.
"""
from __future__ import annotations

import numpy as np
from numba import prange, uint64

from ...core.jit_cache import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)


@njit(**_OPTS)
def _fill(xp, q, phases, cols, sh, sw):
    """Lay one input plane xp (h, w) out on its phase grids q (slots, rows * cols), -inf around the input.
    phases[s] = (slot, a, b, t0, nt, u0, nu), as `cpu_pool._Phase`. (Indices are unsigned throughout this
    module: numba's signed indexing checks for negative indices, which keeps LLVM from vectorizing.)"""
    ninf = q.dtype.type(-np.inf)
    w = xp.shape[1]
    xf = xp.reshape(-1)
    rows = q.shape[1] // cols
    for s in range(phases.shape[0]):
        slot, a, b, t0, nt, u0, nu = phases[s]
        qs = q[slot]
        for i in range(uint64(t0 * cols)):  # the padding rows above and below
            qs[i] = ninf
        for i in range(uint64((t0 + nt) * cols), uint64(rows * cols)):
            qs[i] = ninf
        for t in range(uint64(nt)):
            src = uint64((a + t * sh) * w + b)
            d = uint64((t0 + t) * cols)
            for u in range(uint64(u0)):  # the padding columns left and right
                qs[d + u] = ninf
            for u in range(uint64(u0 + nu), uint64(cols)):
                qs[d + u] = ninf
            d += uint64(u0)
            for u in range(uint64(nu)):
                qs[d + u] = xf[src + u * sw]


@njit(**_OPTS)
def _reduce_max(q, taps, m, length):
    """m[:length] = the maximum over the taps (slot, offset) in order, as numpy's `maximum` takes it (m stays
    where m >= v or m is NaN): each tap is one contiguous pass."""
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
    """y[p] for the planes p in [lo, hi) of x (planes, h, w); q (slots, rows * cols) and m (ho * cols) are
    scratch."""
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
    """The forward on `workers` threads, worker t on a contiguous share of the planes with scratch q[t], m[t]."""
    n = x.shape[0]
    for t in prange(workers):
        maxpool_forward(x, y, q[t], m[t], phases, taps, cols, sh, sw, n * t // workers, n * (t + 1) // workers)


@njit(**_OPTS)
def maxpool_backward(x, dy, dx, q, dq, m, r, phases, taps, cols, sh, sw, covers, lo, hi):
    """dx[p] for the planes p in [lo, hi): `PoolOps.maxpool2d_backward` plane by plane. q and dq (slots,
    rows * cols), m and r (ho * cols) are scratch."""
    ho, wo = dy.shape[1], dy.shape[2]
    length = (ho - 1) * cols + wo
    zero, one = dx.dtype.type(0), dx.dtype.type(1)
    last = taps.shape[0] - 1
    for p in range(lo, hi):
        _fill(x[p], q, phases, cols, sh, sw)
        _reduce_max(q, taps, m, length)
        for oh in range(ho):  # r = dy on the grid layout, the junk cells between rows zero
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
    """The backward on `workers` threads, worker t on a contiguous share of the planes with its own scratch."""
    n = x.shape[0]
    for t in prange(workers):
        maxpool_backward(x, dy, dx, q[t], dq[t], m[t], r[t], phases, taps, cols, sh, sw, covers,
                         n * t // workers, n * (t + 1) // workers)
