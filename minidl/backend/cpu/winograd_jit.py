"""The transforms of the Winograd convolution F(2x2, 3x3) (`cpu.winograd`), compiled with numba.

Layout: channels 16 at a time (a block, the last zero-padded) in a channels-last scratch (rows, columns, 16),
so LLVM vectorizes a tile's arithmetic over 16 channels; a group's transformed tiles form (16, T, CB), position
(k, l) at 4k + l, tile t = (sample * th + ti) * tw + tj. Flat unsigned indices and a per-tile scratch written at
fixed offsets let LLVM vectorize (32 x 64 x 8 x 8 input transform: 1.6 ms plainly indexed, 0.2 this way).
Rules: each value is a fixed sequence of additions, subtractions and exact halvings of its own tile's inputs;
no fastmath; the same inputs give the same bits whatever the group, workspace or thread count.
"""
from __future__ import annotations

import numpy as np
from numba import prange, uint64

from ...core.jit_cache import njit
from .eltwise_jit import add_into
from .gemm_jit import gemm, gemm_acc

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)
L = 16  # channels per block


@njit(**_OPTS)
def _to_block(x, s, cb, r_off, q_off, xs, ra=0, rb=-1):
    """xs[r + r_off, q + q_off, c] = x[s, cb + c, r, q] for rows [ra, rb) (rb -1: all), 16 channels at a
    time (32 x 16 x 32 x 32: 0.62 -> 0.14 ms against plane by plane)."""
    _, c, h, w = x.shape
    nb = min(L, c - cb)
    ra = max(ra, 0)
    rb = h if rb < 0 else min(rb, h)
    if nb == L:
        xf = x.reshape(-1)
        xsf = xs.reshape(-1)
        ll, wp, hw = uint64(L), uint64(xs.shape[1]), uint64(h * w)
        base = (uint64(s) * uint64(c) + uint64(cb)) * hw
        for r in range(uint64(ra), uint64(rb)):
            for q in range(uint64(w)):
                d = ((r + uint64(r_off)) * wp + q + uint64(q_off)) * ll
                src = base + r * uint64(w) + q
                for ch in range(ll):
                    xsf[d + ch] = xf[src + ch * hw]
        return
    zero = x.dtype.type(0)
    for ch in range(nb):
        for r in range(ra, rb):
            for q in range(w):
                xs[r + r_off, q + q_off, ch] = x[s, cb + ch, r, q]
    for ch in range(nb, L):
        for r in range(ra, rb):
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
def _input_block(xf, vf, ta, tb, tw, wp, base, cbo, ps, cbw, buf):
    """B^T d B of the tiles in tile rows [ta, tb) of one sample's block into vf."""
    ll = uint64(L)
    rw = uint64(wp) * ll
    for ti in range(uint64(ta), uint64(tb)):
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
def _grad_block(df, mf, ta, tb, tw, wp, base, cbo, ps, cbw, buf):
    """A dY A^T of the 2x2 tiles in tile rows [ta, tb) of one sample's block of dy (flattened in df) into mf."""
    ll = uint64(L)
    rw = uint64(wp) * ll
    for ti in range(uint64(ta), uint64(tb)):
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
def _tiles(x, s0, s1, r_off, q_off, th, tw, xs, buf, out, grad, lo, hi):
    """Units [lo, hi) (a unit: one tile row of one sample) of samples [s0, s1) into `out`: the input transform,
    or with `grad` the output transform's gradient; units are independent."""
    c = x.shape[1]
    wp = xs.shape[1]
    xs[:] = 0
    xf = xs.reshape(-1)
    of = out.reshape(-1)
    ps, cbw = out.shape[1] * out.shape[2], out.shape[2]
    span = 2 if grad else 4  # rows of x a tile reads
    for j in range(lo // th, (hi + th - 1) // th):
        ta = max(lo - j * th, 0)
        tb = min(hi - j * th, th)
        base = j * th * tw
        for cb in range(0, c, L):
            _to_block(x, s0 + j, cb, r_off, q_off, xs, 2 * ta - r_off, 2 * (tb - 1) + span - r_off)
            if grad:
                _grad_block(xf, of, ta, tb, tw, wp, base, cb, ps, cbw, buf)
            else:
                _input_block(xf, of, ta, tb, tw, wp, base, cb, ps, cbw, buf)


@njit(**_OPTS)
def input_tiles(x, s0, s1, pad_h, pad_w, th, tw, xs, buf, v):
    """v (16, T, CB) <- B^T d B of every 4x4 input patch of samples [s0, s1), zero outside the image."""
    _tiles(x, s0, s1, pad_h, pad_w, th, tw, xs, buf, v, False, 0, (s1 - s0) * th)


@njit(**_OPTS)
def grad_tiles(dy, s0, s1, th, tw, ds, buf, dm):
    """dm <- A dY A^T of every 2x2 tile of dy (zero beyond Ho, Wo): the gradient of `output_tiles`."""
    _tiles(dy, s0, s1, 0, 0, th, tw, ds, buf, dm, True, 0, (s1 - s0) * th)


@njit(**_OPTS)
def _output_block(mf, yf, ta, tb, tw, base, cbo, ps, cbw, buf):
    """A^T m A of the tiles in tile rows [ta, tb) of one sample's block into the scratch."""
    ll = uint64(L)
    ysw = uint64(2) * uint64(tw)
    rw = ysw * ll
    pss = uint64(ps)
    for ti in range(uint64(ta), uint64(tb)):
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
                # A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]: nine terms left to right in position order, unfactored,
                # the order `output_position` keeps
                buf[ch] = m0 + m1 + m2 + m4 + m5 + m6 + m8 + m9 + m10
                buf[ch + uint64(16)] = m1 - m2 - m3 + m5 - m6 - m7 + m9 - m10 - m11
                buf[ch + uint64(32)] = m4 + m5 + m6 - m8 - m9 - m10 - m12 - m13 - m14
                buf[ch + uint64(48)] = m5 - m6 - m7 - m9 + m10 + m11 - m13 + m14 + m15
            y0 = (uint64(2) * ti * ysw + uint64(2) * tj) * ll
            for ch in range(uint64(32)):
                yf[y0 + ch] = buf[ch]
            for ch in range(uint64(32)):
                yf[y0 + rw + ch] = buf[uint64(32) + ch]


@njit(**_OPTS)
def _outputs(m, s0, s1, th, tw, ys, buf, y, lo, hi, acc):
    """Units [lo, hi) (tile rows of samples, as in `_tiles`) of `output_tiles`."""
    _, co, ho, wo = y.shape
    mf = m.reshape(-1)
    yf = ys.reshape(-1)
    ps, cbw = m.shape[1] * m.shape[2], m.shape[2]
    for j in range(lo // th, (hi + th - 1) // th):
        ta = max(lo - j * th, 0)
        tb = min(hi - j * th, th)
        s = s0 + j
        for cb in range(0, co, L):
            _output_block(mf, yf, ta, tb, tw, j * th * tw, cb, ps, cbw, buf)
            for ch in range(min(L, co - cb)):
                for r in range(2 * ta, min(2 * tb, ho)):
                    if acc:
                        for q in range(wo):
                            y[s, cb + ch, r, q] = y[s, cb + ch, r, q] + ys[r, q, ch]
                    else:
                        for q in range(wo):
                            y[s, cb + ch, r, q] = ys[r, q, ch]


@njit(**_OPTS)
def output_tiles(m, s0, s1, th, tw, ys, buf, y, acc):
    """y[s0:s1] (+= with `acc`) <- A^T m A of every tile of m (16, T, CB); outputs beyond Ho, Wo
    dropped."""
    _outputs(m, s0, s1, th, tw, ys, buf, y, 0, (s1 - s0) * th, acc)


@njit(**_OPTS)
def weight_tiles(wt, u):
    """u (16, CiB, CoB) <- G g G^T of every kernel, from wt (3, 3, Ci, Co); padded channels zero.
    G = [[1, 0, 0], [1/2, 1/2, 1/2], [1/2, -1/2, 1/2], [0, 0, 1]]; the halvings are exact."""
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
    """dwt (3, 3, Ci, Co) <- G^T dU G, the gradient of `weight_tiles`."""
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


# -- one position at a time (`winograd_by_position`)
# Each function evaluates, for one position (k, j), exactly the whole-tile expression: the same bits.

@njit(inline="always", **_OPTS)
def _b_row(k):
    """Row k of B^T as (first, second, sign): a[first] + sign * a[second]."""
    if k == 0:
        return 0, 2, -1
    if k == 1:
        return 1, 2, 1
    if k == 2:
        return 2, 1, -1
    return 1, 3, -1


@njit(**_OPTS)
def input_position(x, s0, s1, pad_h, pad_w, th, tw, k, j, xs, v1):
    """v1 (T, CB) <- position (k, j) of B^T d B, computed as `_input_block` does."""
    c = x.shape[1]
    wp = xs.shape[1]
    r1, r2, sk = _b_row(k)
    j1, j2, sl = _b_row(j)
    sgk, sgl = x.dtype.type(sk), x.dtype.type(sl)   # in x's type: an int64 sign would promote to float64
    xs[:] = 0
    xf = xs.reshape(-1)
    vf = v1.reshape(-1)
    ll, cbw, uwp = uint64(L), uint64(v1.shape[1]), uint64(wp)
    o11 = (uint64(r1) * uwp + uint64(j1)) * ll
    o21 = (uint64(r2) * uwp + uint64(j1)) * ll
    o12 = (uint64(r1) * uwp + uint64(j2)) * ll
    o22 = (uint64(r2) * uwp + uint64(j2)) * ll
    for s in range(s0, s1):
        base = uint64((s - s0) * th * tw)
        for cb in range(0, c, L):
            _to_block(x, s, cb, pad_h, pad_w, xs)
            for ti in range(uint64(th)):
                for tj in range(uint64(tw)):
                    i0 = (uint64(2) * ti * uwp + uint64(2) * tj) * ll
                    o = (base + ti * uint64(tw) + tj) * cbw + uint64(cb)
                    for ch in range(ll):
                        p = i0 + ch
                        ra = xf[p + o11] + sgk * xf[p + o21]
                        rb = xf[p + o12] + sgk * xf[p + o22]
                        vf[o + ch] = ra + sgl * rb


@njit(inline="always", **_OPTS)
def _a_comb(k, a, b):
    """Row k of A = [[1, 0], [1, 1], [1, -1], [0, -1]] applied to (a, b), as `_grad_block` writes it."""
    if k == 0:
        return a
    if k == 1:
        return a + b
    if k == 2:
        return a - b
    return -b


@njit(**_OPTS)
def grad_position(dy, s0, s1, th, tw, k, j, ds, dm1):
    """dm1 (T, CB) <- position (k, j) of A dY A^T, rows first, as `grad_tiles`."""
    c = dy.shape[1]
    wp = ds.shape[1]
    ds[:] = 0
    df = ds.reshape(-1)
    mf = dm1.reshape(-1)
    ll, cbw, uwp = uint64(L), uint64(dm1.shape[1]), uint64(wp)
    rw = uwp * ll
    for s in range(s0, s1):
        base = uint64((s - s0) * th * tw)
        for cb in range(0, c, L):
            _to_block(dy, s, cb, 0, 0, ds)
            for ti in range(uint64(th)):
                for tj in range(uint64(tw)):
                    p0 = (uint64(2) * ti * uwp + uint64(2) * tj) * ll
                    o = (base + ti * uint64(tw) + tj) * cbw + uint64(cb)
                    for ch in range(ll):
                        p = p0 + ch
                        r0 = _a_comb(k, df[p], df[p + rw])
                        r1 = _a_comb(k, df[p + ll], df[p + rw + ll])
                        mf[o + ch] = _a_comb(j, r0, r1)


@njit(**_OPTS)
def output_position(m1, s0, s1, th, tw, k, j, y):
    """y[s0:s1] (+)= position (k, j)'s share of A^T m A, positions called in order, so each
    output sums its nine terms as `_output_block` does."""
    _, co, ho, wo = y.shape
    for a in range(2):
        ca = _a_comb(k, 1, 0) if a == 0 else _a_comb(k, 0, 1)   # A[k, a]
        if ca == 0:
            continue
        for b in range(2):
            cb = _a_comb(j, 1, 0) if b == 0 else _a_comb(j, 0, 1)
            if cb == 0:
                continue
            first = k == a and j == b
            plus = ca * cb > 0
            for s in range(s0, s1):
                base = (s - s0) * th * tw
                for ch in range(co):
                    for ti in range(th):
                        r = 2 * ti + a
                        if r >= ho:
                            break
                        for tj in range(tw):
                            q = 2 * tj + b
                            if q >= wo:
                                break
                            v = m1[(base + ti * tw + tj), ch]
                            if first:
                                y[s, ch, r, q] = v
                            elif plus:
                                y[s, ch, r, q] = y[s, ch, r, q] + v
                            else:
                                y[s, ch, r, q] = y[s, ch, r, q] - v


@njit(inline="always", **_OPTS)
def _g_comb(k, a0, a1, a2, half):
    """Row k of G applied to (a0, a1, a2), as `weight_tiles` writes it."""
    if k == 0:
        return a0
    if k == 1:
        return (a0 + a1 + a2) * half
    if k == 2:
        return (a0 - a1 + a2) * half
    return a2


@njit(**_OPTS)
def weight_position(wt, k, j, u1):
    """u1 (CiB, CoB) <- position (k, j) of G g G^T, as `weight_tiles` computes it."""
    _, _, ci, co = wt.shape
    half = wt.dtype.type(0.5)
    u1[:] = 0
    for i in range(ci):
        for o in range(co):
            t0 = _g_comb(k, wt[0, 0, i, o], wt[1, 0, i, o], wt[2, 0, i, o], half)
            t1 = _g_comb(k, wt[0, 1, i, o], wt[1, 1, i, o], wt[2, 1, i, o], half)
            t2 = _g_comb(k, wt[0, 2, i, o], wt[1, 2, i, o], wt[2, 2, i, o], half)
            u1[i, o] = _g_comb(j, t0, t1, t2, half)


# -- with numpy's GEMM from compiled code, on one thread or several
# Pieces are fixed by the shapes, never by the workers: a block of a GEMM's rows need not sum as the whole
# product does (OpenBLAS's edge kernels), so every GEMM is the same call whichever worker makes it.

_PIECE_ROWS = 32  # tiles of a full group per forward piece at least
_WIDE_ROWS = 1024  # tiles of a full group from which the forward cuts four pieces


@njit(**_OPTS)
def forward_pieces(rows):
    """Pieces the forward cuts a group into, from a full group's `rows` alone: 1, 2 or 4."""
    if rows < 2 * _PIECE_ROWS:
        return 1
    return 2 if rows < _WIDE_ROWS else 4


@njit(inline="always", **_OPTS)
def piece_units(size, th, units, q, pieces):
    """Piece q's units [lo, hi): the full group's cut, clipped to a short last group."""
    full = size * th
    return min(full * q // pieces, units), min(full * (q + 1) // pieces, units)


@njit(inline="always", **_OPTS)
def _share(units, w, workers):
    """Worker w's contiguous share [lo, hi) of `units`."""
    return units * w // workers, units * (w + 1) // workers


@njit(inline="always", **_OPTS)
def _slot_views(slot, th, tw):
    """A worker's scratch slot: input block, output block in the same memory, 256 values."""
    return (slot[:(2 * th + 2) * (2 * tw + 2) * L].reshape((2 * th + 2, 2 * tw + 2, L)),
            slot[:4 * th * tw * L].reshape((2 * th, 2 * tw, L)), slot[slot.size - 256:])


@njit(inline="always", **_OPTS)
def _full_group(flat, rows, cb):
    """A flat V or M buffer seen as a full group's (16, rows, CB)."""
    return flat[:16 * rows * cb].reshape((16, rows, cb))


@njit(**_OPTS)
def _forward_share(x, u, vf, mf, y, size, pad_h, pad_w, th, tw, slot, w, workers, acc):
    """Worker w's pieces (w, w + workers, ...) of every group: input transform, 16 GEMMs, output
    transform; no worker waits for another."""
    n = x.shape[0]
    cib, cob = u.shape[1], u.shape[2]
    xs, ys, buf = _slot_views(slot, th, tw)
    v, m = _full_group(vf, size * th * tw, cib), _full_group(mf, size * th * tw, cob)
    pieces = forward_pieces(size * th * tw)
    for s0 in range(0, n, size):
        s1 = min(n, s0 + size)
        for q in range(w, pieces, workers):
            lo, hi = piece_units(size, th, (s1 - s0) * th, q, pieces)
            if lo == hi:
                continue
            _tiles(x, s0, s1, pad_h, pad_w, th, tw, xs, buf, v, False, lo, hi)
            for p in range(16):
                gemm(v[p, lo * tw:hi * tw], u[p], m[p, lo * tw:hi * tw], False)
            _outputs(m, s0, s1, th, tw, ys, buf, y, lo, hi, acc)


@njit(**_OPTS)
def forward(x, u, vf, mf, y, size, pad_h, pad_w, th, tw, slots, acc):
    """The whole-tile forward (groups of `size` samples) on this thread, scratch slots[0]; `acc`: y += it."""
    _forward_share(x, u, vf, mf, y, size, pad_h, pad_w, th, tw, slots[0], 0, 1, acc)


@njit(parallel=True, **_OPTS)
def forward_parallel(x, u, vf, mf, y, size, pad_h, pad_w, th, tw, slots, acc):
    """The whole-tile forward on len(slots) threads; the BLAS must run one thread a call."""
    workers = slots.shape[0]
    for w in prange(workers):
        _forward_share(x, u, vf, mf, y, size, pad_h, pad_w, th, tw, slots[w], w, workers, acc)


@njit(**_OPTS)
def _transforms_share(x, dy, s0, s1, pad_h, pad_w, th, tw, v, dm, slot, w, workers):
    """Worker w's share of one group's transforms for the weight gradient: V from x, then dM from dy."""
    lo, hi = _share((s1 - s0) * th, w, workers)
    if lo == hi:
        return
    xs, ds, buf = _slot_views(slot, th, tw)
    _tiles(x, s0, s1, pad_h, pad_w, th, tw, xs, buf, v, False, lo, hi)
    _tiles(dy, s0, s1, 0, 0, th, tw, ds, buf, dm, True, lo, hi)


@njit(**_OPTS)
def transforms(x, dy, s0, s1, pad_h, pad_w, th, tw, v, dm, slots):
    """V and dM of samples [s0, s1) on this thread (see `_transforms_share`)."""
    _transforms_share(x, dy, s0, s1, pad_h, pad_w, th, tw, v, dm, slots[0], 0, 1)


@njit(parallel=True, **_OPTS)
def transforms_parallel(x, dy, s0, s1, pad_h, pad_w, th, tw, v, dm, slots):
    """V and dM of samples [s0, s1) on len(slots) threads."""
    workers = slots.shape[0]
    for w in prange(workers):
        _transforms_share(x, dy, s0, s1, pad_h, pad_w, th, tw, v, dm, slots[w], w, workers)


@njit(**_OPTS)
def _positions(a, b, c, acc, add, w, workers):
    """Positions w, w + workers, ... of c[p] = a[p].T @ b[p]; with `add`, acc[p] += c[p]."""
    for p in range(w, a.shape[0], workers):
        gemm(a[p], b[p], c[p], True)
        if add:
            ap, cp = acc[p].reshape(-1), c[p].reshape(-1)
            for i in range(ap.size):
                ap[i] = ap[i] + cp[i]


@njit(**_OPTS)
def positions(a, b, c, acc, add):
    """The 16 positions' products on this thread (see `_positions`)."""
    _positions(a, b, c, acc, add, 0, 1)


@njit(parallel=True, **_OPTS)
def positions_parallel(a, b, c, acc, add, workers):
    """The 16 positions' products on `workers` threads."""
    for w in prange(workers):
        _positions(a, b, c, acc, add, w, workers)


# The weight gradient over several groups: dU = H0 + H1, Hh summing V[p]^T dM[p] over half h's tile rows of
# each group (cut at a full group's middle), group after group in the BLAS (beta 1). One or two workers: the
# same calls in the same order; the by-position variant repeats them (`half_products`).

@njit(inline="always", **_OPTS)
def half_cut(size, th, units):
    """The unit where a group's two halves meet: a full group's middle, clipped to `units`."""
    return min(size * th // 2, units)


@njit(**_OPTS)
def half_products(v, dm, cut, tw, acc, acc1, started):
    """One position's share of one group: acc (+)= half 0's V^T dM, acc1 (+)= half 1's;
    `started[h]`: whether half h holds a sum yet."""
    r = cut * tw
    if r > 0:
        gemm_acc(v[:r], dm[:r], acc, True, False, started[0])
        started[0] = True
    if r < v.shape[0]:
        gemm_acc(v[r:], dm[r:], acc1, True, False, started[1])
        started[1] = True


@njit(**_OPTS)
def _dw_half(x, dy, size, pad_h, pad_w, th, tw, vf, df, acc, slot, h):
    """Half h of every group in group order: V and dM of its units, then 16 products into acc."""
    n = x.shape[0]
    cib, cob = acc.shape[1], acc.shape[2]
    xs, ds, buf = _slot_views(slot, th, tw)
    v, dm = _full_group(vf, size * th * tw, cib), _full_group(df, size * th * tw, cob)
    started = False
    for s0 in range(0, n, size):
        s1 = min(n, s0 + size)
        units = (s1 - s0) * th
        cut = half_cut(size, th, units)
        lo, hi = (0, cut) if h == 0 else (cut, units)
        if lo == hi:
            continue
        _tiles(x, s0, s1, pad_h, pad_w, th, tw, xs, buf, v, False, lo, hi)
        _tiles(dy, s0, s1, 0, 0, th, tw, ds, buf, dm, True, lo, hi)
        for p in range(16):
            gemm_acc(v[p, lo * tw:hi * tw], dm[p, lo * tw:hi * tw], acc[p], True, False, started)
        started = True


@njit(**_OPTS)
def weight_grad_halves(x, dy, size, pad_h, pad_w, th, tw, vf, df, acc, acc1, slots):
    """dU = H0 + H1 on this thread (scratch slots[0]): acc <- H0, acc1 <- H1, then acc += acc1."""
    _dw_half(x, dy, size, pad_h, pad_w, th, tw, vf, df, acc, slots[0], 0)
    _dw_half(x, dy, size, pad_h, pad_w, th, tw, vf, df, acc1, slots[0], 1)
    add_into(acc, acc1)


@njit(parallel=True, **_OPTS)
def weight_grad_halves_parallel(x, dy, size, pad_h, pad_w, th, tw, vf, df, acc, acc1, slots):
    """The same on two threads, one half each; the BLAS must run one thread a call."""
    for h in prange(2):
        _dw_half(x, dy, size, pad_h, pad_w, th, tw, vf, df, acc if h == 0 else acc1, slots[h], h)
    add_into(acc, acc1)
