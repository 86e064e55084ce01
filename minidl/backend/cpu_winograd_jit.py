"""The transforms of the Winograd convolution F(2x2, 3x3) (`cpu_winograd`), compiled with numba.

Layout. Channels are taken 16 at a time (a block; the last one zero-padded): a block's planes are first
transposed into a small channels-last scratch (rows, columns, 16), so that each tile's arithmetic runs on
16 channels at once, which LLVM vectorizes. The transformed tiles of a group of samples form a (16, T, CB)
array: position (k, l) of the 4x4 tile at index 4k + l, tile t = (sample * th + ti) * tw + tj, channel c (CB
= the channels rounded up to a multiple of 16); each position is then a plain (T, CB) matrix for the GEMMs.

Why the odd style below. numba checks every signed index for a negative value (Python's wrap-around), which
stops LLVM from seeing consecutive addresses; the tile loops therefore index flat arrays with unsigned
integers. And LLVM vectorizes a loop only if it can rule out that its stores overlap its loads: the 16 results
of a tile go first to a small scratch at fixed offsets, then out in 16 contiguous copies. Measured on the
2-core Xeon VM, 32 x 64 x 8 x 8: the input transform 1.6 ms as plain indexed numba, 0.2 ms this way.

Exactness. Each value is a fixed sequence of additions and subtractions (and exact halvings in the weight
transforms) of its own tile's inputs, written out below; nothing is compiled with fastmath, so the same inputs
give the same bits whatever the group, the workspace or the thread count.
"""
from __future__ import annotations

import numpy as np
from numba import njit, uint64

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)
L = 16  # channels per block


@njit(**_OPTS)
def _to_block(x, s, cb, r_off, q_off, xs):
    """xs[r + r_off, q + q_off, c] = x[s, cb + c, r, q] for the block's channels (zero for the padded ones).

    A full block is read 16 channels at a time (a gather across the planes, one contiguous store): 4x faster
    than plane by plane with strided stores (measured, 32 x 16 x 32 x 32: 0.62 -> 0.14 ms)."""
    _, c, h, w = x.shape
    nb = min(L, c - cb)
    if nb == L:
        xf = x.reshape(-1)
        xsf = xs.reshape(-1)
        ll, wp, hw = uint64(L), uint64(xs.shape[1]), uint64(h * w)
        base = (uint64(s) * uint64(c) + uint64(cb)) * hw
        for r in range(uint64(h)):
            for q in range(uint64(w)):
                d = ((r + uint64(r_off)) * wp + q + uint64(q_off)) * ll
                src = base + r * uint64(w) + q
                for ch in range(ll):
                    xsf[d + ch] = xf[src + ch * hw]
        return
    zero = x.dtype.type(0)
    for ch in range(nb):
        for r in range(h):
            for q in range(w):
                xs[r + r_off, q + q_off, ch] = x[s, cb + ch, r, q]
    for ch in range(nb, L):
        for r in range(h):
            for q in range(w):
                xs[r + r_off, q + q_off, ch] = zero


@njit(**_OPTS)
def _scatter(buf, vf, o, ps, rows):
    """vf[o + k * ps + c] = buf[k * L + c] for k < rows, c < L: a tile's results to their positions."""
    ll = uint64(L)
    for k in range(uint64(rows)):
        q = o + k * ps
        b = k * ll
        for ch in range(ll):
            vf[q + ch] = buf[b + ch]


@njit(inline="always", **_OPTS)
def _put4(buf, k, ch, v0, v1, v2, v3):
    """Tile row k's four results for channel ch into the per-tile scratch: position 4k + l at (4k + l) * 16."""
    o = uint64(64 * k) + ch
    buf[o] = v0
    buf[o + uint64(16)] = v1
    buf[o + uint64(32)] = v2
    buf[o + uint64(48)] = v3


@njit(**_OPTS)
def _input_block(xf, vf, th, tw, wp, base, cbo, ps, cbw, buf):
    """B^T d B of every tile of one sample's block (xs flattened in xf) into vf at tiles base.."""
    ll = uint64(L)
    rw = uint64(wp) * ll
    for ti in range(uint64(th)):
        for tj in range(uint64(tw)):
            i0 = (uint64(2) * ti * uint64(wp) + uint64(2) * tj) * ll
            for ch in range(ll):
                p = i0 + ch
                d00 = xf[p]
                d01 = xf[p + ll]
                d02 = xf[p + uint64(2) * ll]
                d03 = xf[p + uint64(3) * ll]
                p = p + rw
                d10 = xf[p]
                d11 = xf[p + ll]
                d12 = xf[p + uint64(2) * ll]
                d13 = xf[p + uint64(3) * ll]
                p = p + rw
                d20 = xf[p]
                d21 = xf[p + ll]
                d22 = xf[p + uint64(2) * ll]
                d23 = xf[p + uint64(3) * ll]
                p = p + rw
                d30 = xf[p]
                d31 = xf[p + ll]
                d32 = xf[p + uint64(2) * ll]
                d33 = xf[p + uint64(3) * ll]
                # B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], rows then columns
                a0, a1, a2, a3 = d00 - d20, d01 - d21, d02 - d22, d03 - d23
                b0, b1, b2, b3 = d10 + d20, d11 + d21, d12 + d22, d13 + d23
                e0, e1, e2, e3 = d20 - d10, d21 - d11, d22 - d12, d23 - d13
                f0, f1, f2, f3 = d10 - d30, d11 - d31, d12 - d32, d13 - d33
                _put4(buf, 0, ch, a0 - a2, a1 + a2, a2 - a1, a1 - a3)
                _put4(buf, 1, ch, b0 - b2, b1 + b2, b2 - b1, b1 - b3)
                _put4(buf, 2, ch, e0 - e2, e1 + e2, e2 - e1, e1 - e3)
                _put4(buf, 3, ch, f0 - f2, f1 + f2, f2 - f1, f1 - f3)
            t = uint64(base) + ti * uint64(tw) + tj
            _scatter(buf, vf, t * uint64(cbw) + uint64(cbo), uint64(ps), 16)


@njit(**_OPTS)
def _grad_block(df, mf, th, tw, wp, base, cbo, ps, cbw, buf):
    """A dY A^T of every 2x2 tile of one sample's block of dy (flattened in df) into mf."""
    ll = uint64(L)
    rw = uint64(wp) * ll
    for ti in range(uint64(th)):
        for tj in range(uint64(tw)):
            i0 = (uint64(2) * ti * uint64(wp) + uint64(2) * tj) * ll
            for ch in range(ll):
                p = i0 + ch
                y00 = df[p]
                y01 = df[p + ll]
                y10 = df[p + rw]
                y11 = df[p + rw + ll]
                # A = [[1, 0], [1, 1], [1, -1], [0, -1]]: rows y0, y0 + y1, y0 - y1, -y1, then the columns
                r00, r01 = y00, y01
                r10, r11 = y00 + y10, y01 + y11
                r20, r21 = y00 - y10, y01 - y11
                r30, r31 = -y10, -y11
                _put4(buf, 0, ch, r00, r00 + r01, r00 - r01, -r01)
                _put4(buf, 1, ch, r10, r10 + r11, r10 - r11, -r11)
                _put4(buf, 2, ch, r20, r20 + r21, r20 - r21, -r21)
                _put4(buf, 3, ch, r30, r30 + r31, r30 - r31, -r31)
            t = uint64(base) + ti * uint64(tw) + tj
            _scatter(buf, mf, t * uint64(cbw) + uint64(cbo), uint64(ps), 16)


@njit(**_OPTS)
def _tiles(x, s0, s1, r_off, q_off, th, tw, xs, buf, out, grad):
    """Samples [s0, s1) of x, block by block, through the channels-last scratch xs (x placed at rows r_off,
    columns q_off; everything else stays zero) into `out`: the input transform, or with `grad` the gradient
    of the output transform."""
    c = x.shape[1]
    wp = xs.shape[1]
    xs[:] = 0
    xf = xs.reshape(-1)
    of = out.reshape(-1)
    ps, cbw = out.shape[1] * out.shape[2], out.shape[2]
    for s in range(s0, s1):
        base = (s - s0) * th * tw
        for cb in range(0, c, L):
            _to_block(x, s, cb, r_off, q_off, xs)
            if grad:
                _grad_block(xf, of, th, tw, wp, base, cb, ps, cbw, buf)
            else:
                _input_block(xf, of, th, tw, wp, base, cb, ps, cbw, buf)


@njit(**_OPTS)
def input_tiles(x, s0, s1, pad_h, pad_w, th, tw, xs, buf, v):
    """v (16, (s1-s0)*th*tw, CB) <- B^T d B of every 4x4 input patch d of samples [s0, s1) of x (n, C, H, W);
    the patch of tile (ti, tj) starts at input row 2ti - pad_h, column 2tj - pad_w, zero outside the image.
    Scratch: xs (2th + 2, 2tw + 2, 16), buf (256,)."""
    _tiles(x, s0, s1, pad_h, pad_w, th, tw, xs, buf, v, False)


@njit(**_OPTS)
def grad_tiles(dy, s0, s1, th, tw, ds, buf, dm):
    """dm (16, (s1-s0)*th*tw, CB) <- A dY A^T of every 2x2 tile dY of samples [s0, s1) of dy (n, Co, Ho, Wo),
    zero beyond Ho, Wo: the gradient of `output_tiles`. Scratch: ds (2th, 2tw, 16), buf (256,)."""
    _tiles(dy, s0, s1, 0, 0, th, tw, ds, buf, dm, True)


@njit(**_OPTS)
def _output_block(mf, yf, th, tw, base, cbo, ps, cbw, buf):
    """A^T m A of every tile of one sample's block into the channels-last scratch (flattened in yf)."""
    ll = uint64(L)
    ysw = uint64(2) * uint64(tw)
    rw = ysw * ll
    pss = uint64(ps)
    for ti in range(uint64(th)):
        for tj in range(uint64(tw)):
            t = uint64(base) + ti * uint64(tw) + tj
            o = t * uint64(cbw) + uint64(cbo)
            for ch in range(ll):
                q = o + ch
                m0 = mf[q]
                m1 = mf[q + pss]
                m2 = mf[q + uint64(2) * pss]
                m3 = mf[q + uint64(3) * pss]
                m4 = mf[q + uint64(4) * pss]
                m5 = mf[q + uint64(5) * pss]
                m6 = mf[q + uint64(6) * pss]
                m7 = mf[q + uint64(7) * pss]
                m8 = mf[q + uint64(8) * pss]
                m9 = mf[q + uint64(9) * pss]
                m10 = mf[q + uint64(10) * pss]
                m11 = mf[q + uint64(11) * pss]
                m12 = mf[q + uint64(12) * pss]
                m13 = mf[q + uint64(13) * pss]
                m14 = mf[q + uint64(14) * pss]
                m15 = mf[q + uint64(15) * pss]
                # A^T = [[1, 1, 1, 0], [0, 1, -1, -1]], columns then rows
                a0, b0 = m0 + m1 + m2, m1 - m2 - m3
                a1, b1 = m4 + m5 + m6, m5 - m6 - m7
                a2, b2 = m8 + m9 + m10, m9 - m10 - m11
                a3, b3 = m12 + m13 + m14, m13 - m14 - m15
                buf[ch] = a0 + a1 + a2
                buf[ch + uint64(16)] = b0 + b1 + b2
                buf[ch + uint64(32)] = a1 - a2 - a3
                buf[ch + uint64(48)] = b1 - b2 - b3
            y0 = (uint64(2) * ti * ysw + uint64(2) * tj) * ll
            for ch in range(uint64(32)):
                yf[y0 + ch] = buf[ch]
            for ch in range(uint64(32)):
                yf[y0 + rw + ch] = buf[uint64(32) + ch]


@njit(**_OPTS)
def output_tiles(m, s0, s1, th, tw, ys, buf, y):
    """y[s0:s1] (n, Co, Ho, Wo) <- A^T m A of every tile of m (16, T, CB), the 2x2 outputs of tile (ti, tj) at
    rows 2ti, 2ti + 1 and columns 2tj, 2tj + 1 (those beyond Ho, Wo are dropped). Scratch: ys (2th, 2tw, 16),
    buf (64,)."""
    _, co, ho, wo = y.shape
    mf = m.reshape(-1)
    yf = ys.reshape(-1)
    ps, cbw = m.shape[1] * m.shape[2], m.shape[2]
    for s in range(s0, s1):
        for cb in range(0, co, L):
            _output_block(mf, yf, th, tw, (s - s0) * th * tw, cb, ps, cbw, buf)
            for ch in range(min(L, co - cb)):
                for r in range(ho):
                    for q in range(wo):
                        y[s, cb + ch, r, q] = ys[r, q, ch]


@njit(**_OPTS)
def weight_tiles(wt, u):
    """u (16, CiB, CoB) <- G g G^T of every 3x3 kernel g, from wt (3, 3, Ci, Co) (the weight transposed so that
    the loops below run along Co); padded channels get zero. G = [[1, 0, 0], [1/2, 1/2, 1/2], [1/2, -1/2, 1/2],
    [0, 0, 1]]; the halvings are exact."""
    _, _, ci, co = wt.shape
    half = wt.dtype.type(0.5)
    u[:] = 0
    t = np.empty((4, 3, co), wt.dtype)
    for i in range(ci):
        for b in range(3):
            for o in range(co):
                t[0, b, o] = wt[0, b, i, o]
            for o in range(co):
                t[1, b, o] = (wt[0, b, i, o] + wt[1, b, i, o] + wt[2, b, i, o]) * half
            for o in range(co):
                t[2, b, o] = (wt[0, b, i, o] - wt[1, b, i, o] + wt[2, b, i, o]) * half
            for o in range(co):
                t[3, b, o] = wt[2, b, i, o]
        for k in range(4):
            for o in range(co):
                u[4 * k, i, o] = t[k, 0, o]
            for o in range(co):
                u[4 * k + 1, i, o] = (t[k, 0, o] + t[k, 1, o] + t[k, 2, o]) * half
            for o in range(co):
                u[4 * k + 2, i, o] = (t[k, 0, o] - t[k, 1, o] + t[k, 2, o]) * half
            for o in range(co):
                u[4 * k + 3, i, o] = t[k, 2, o]


@njit(**_OPTS)
def weight_grad_tiles(du, dwt):
    """dwt (3, 3, Ci, Co) <- G^T dU G, the gradient of `weight_tiles`: du (16, CiB, CoB) is dL/du."""
    _, ci, co = dwt.shape[0], dwt.shape[2], dwt.shape[3]
    half = du.dtype.type(0.5)
    s = np.empty((4, 3, co), du.dtype)
    for i in range(ci):
        for k in range(4):  # columns: G^T's rows [1, 1/2, 1/2, 0], [0, 1/2, -1/2, 0], [0, 1/2, 1/2, 1]
            for o in range(co):
                s[k, 0, o] = du[4 * k, i, o] + (du[4 * k + 1, i, o] + du[4 * k + 2, i, o]) * half
            for o in range(co):
                s[k, 1, o] = (du[4 * k + 1, i, o] - du[4 * k + 2, i, o]) * half
            for o in range(co):
                s[k, 2, o] = (du[4 * k + 1, i, o] + du[4 * k + 2, i, o]) * half + du[4 * k + 3, i, o]
        for b in range(3):  # then rows
            for o in range(co):
                dwt[0, b, i, o] = s[0, b, o] + (s[1, b, o] + s[2, b, o]) * half
            for o in range(co):
                dwt[1, b, i, o] = (s[1, b, o] - s[2, b, o]) * half
            for o in range(co):
                dwt[2, b, i, o] = (s[1, b, o] + s[2, b, o]) * half + s[3, b, o]
