"""The tile transforms of the Winograd convolution F(2x2, 3x3) (`cpu_winograd`), compiled with numba.

Each transform is a fixed sequence of additions and subtractions per tile (no multiplications but the exact
halves of the weight transform, which stays in numpy): the same inputs give the same bits, whatever the
workspace, the thread count or the order in which tiles are visited, because every output value is computed
from its own tile alone. Nothing is compiled with fastmath (no reassociation).

Layout: the transformed tiles of a group of samples are a (16, C, T) array, position (k, l) of the 4x4 tile at
row 4k + l, tile t = (sample * th + ti) * tw + tj at column t, so that one transform writes 16 contiguous runs
and the GEMMs of the 16 positions read plain (C, T) matrices.

Why loops over whole rows first: the row stage of a transform combines whole input rows (contiguous, LLVM
vectorizes it); only the column stage reads with stride 2.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)


@njit(**_OPTS)
def input_tiles(x, pad_h, pad_w, th, tw, v):
    """v (16, C, n*th*tw) <- B^T d B of every 4x4 input patch d of x (n, C, H, W); the patch of tile (ti, tj)
    starts at input row 2ti - pad_h, column 2tj - pad_w, reading zero outside the image.

    B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]: rows r0..r3 of the patch combine into
    r0 - r2, r1 + r2, r2 - r1, r1 - r3 (the row stage, over whole padded rows, their even and odd columns
    apart), then each combination's columns c0..c3 the same way (the column stage: tile tj's columns are the
    even and odd columns tj and tj + 1, so every loop below reads and writes contiguous runs, which LLVM
    vectorizes; one output row per loop keeps its alias checks few enough that it does)."""
    n, c, h, w = x.shape
    wp = 2 * tw + 2
    zero = x.dtype.type(0)
    r = np.zeros((4, wp), x.dtype)        # the 4 input rows of a tile row, zero-padded left and right
    e = np.empty((4, tw + 1), x.dtype)    # row combinations, even padded columns
    o = np.empty((4, tw + 1), x.dtype)    # row combinations, odd padded columns
    for s in range(n):
        for ch in range(c):
            for ti in range(th):
                for k in range(4):
                    row = 2 * ti - pad_h + k
                    if 0 <= row < h:
                        for q in range(w):
                            r[k, pad_w + q] = x[s, ch, row, q]
                    else:
                        for q in range(w):
                            r[k, pad_w + q] = zero
                for j in range(tw + 1):
                    e[0, j] = r[0, 2 * j] - r[2, 2 * j]
                    o[0, j] = r[0, 2 * j + 1] - r[2, 2 * j + 1]
                for j in range(tw + 1):
                    e[1, j] = r[1, 2 * j] + r[2, 2 * j]
                    o[1, j] = r[1, 2 * j + 1] + r[2, 2 * j + 1]
                for j in range(tw + 1):
                    e[2, j] = r[2, 2 * j] - r[1, 2 * j]
                    o[2, j] = r[2, 2 * j + 1] - r[1, 2 * j + 1]
                for j in range(tw + 1):
                    e[3, j] = r[1, 2 * j] - r[3, 2 * j]
                    o[3, j] = r[1, 2 * j + 1] - r[3, 2 * j + 1]
                base = (s * th + ti) * tw
                for k in range(4):
                    v0 = v[4 * k + 0, ch, base:base + tw]
                    v1 = v[4 * k + 1, ch, base:base + tw]
                    v2 = v[4 * k + 2, ch, base:base + tw]
                    v3 = v[4 * k + 3, ch, base:base + tw]
                    for j in range(tw):
                        v0[j] = e[k, j] - e[k, j + 1]
                    for j in range(tw):
                        v1[j] = o[k, j] + e[k, j + 1]
                    for j in range(tw):
                        v2[j] = e[k, j + 1] - o[k, j]
                    for j in range(tw):
                        v3[j] = o[k, j] - o[k, j + 1]


@njit(**_OPTS)
def output_tiles(m, th, tw, y):
    """y (n, Co, Ho, Wo) <- A^T m A of every tile of m (16, Co, n*th*tw), the 2x2 outputs of tile (ti, tj) at
    rows 2ti, 2ti+1 and columns 2tj, 2tj+1 (those beyond Ho, Wo are dropped).

    A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]: each row k of the tile gives a_k = m0 + m1 + m2 and b_k = m1 - m2 - m3,
    then y00 = a0 + a1 + a2, y01 = b0 + b1 + b2, y10 = a1 - a2 - a3, y11 = b1 - b2 - b3."""
    n, co, ho, wo = y.shape
    a = np.empty((4, tw), m.dtype)
    b = np.empty((4, tw), m.dtype)
    for s in range(n):
        for o in range(co):
            for ti in range(th):
                base = (s * th + ti) * tw
                for k in range(4):
                    for tj in range(tw):
                        m0 = m[4 * k + 0, o, base + tj]
                        m1 = m[4 * k + 1, o, base + tj]
                        m2 = m[4 * k + 2, o, base + tj]
                        m3 = m[4 * k + 3, o, base + tj]
                        a[k, tj] = m0 + m1 + m2
                        b[k, tj] = m1 - m2 - m3
                r0 = 2 * ti
                full = wo // 2
                for tj in range(full):
                    y[s, o, r0, 2 * tj] = a[0, tj] + a[1, tj] + a[2, tj]
                    y[s, o, r0, 2 * tj + 1] = b[0, tj] + b[1, tj] + b[2, tj]
                if full < tw:
                    y[s, o, r0, 2 * full] = a[0, full] + a[1, full] + a[2, full]
                if r0 + 1 < ho:
                    for tj in range(full):
                        y[s, o, r0 + 1, 2 * tj] = a[1, tj] - a[2, tj] - a[3, tj]
                        y[s, o, r0 + 1, 2 * tj + 1] = b[1, tj] - b[2, tj] - b[3, tj]
                    if full < tw:
                        y[s, o, r0 + 1, 2 * full] = a[1, full] - a[2, full] - a[3, full]


@njit(**_OPTS)
def grad_tiles(dy, th, tw, dm):
    """dm (16, Co, n*th*tw) <- A dY A^T of every 2x2 tile dY of dy (n, Co, Ho, Wo), zero beyond Ho, Wo: the
    gradient of `output_tiles` (A = the transpose of its A^T).

    Rows y0, y1 of a tile combine into y0, y0 + y1, y0 - y1, -y1, then the columns the same way."""
    n, co, ho, wo = dy.shape
    wp = 2 * tw
    zero = dy.dtype.type(0)
    r = np.zeros((2, wp), dy.dtype)
    t = np.empty((4, wp), dy.dtype)
    for s in range(n):
        for o in range(co):
            for ti in range(th):
                for k in range(2):
                    row = 2 * ti + k
                    if row < ho:
                        for q in range(wo):
                            r[k, q] = dy[s, o, row, q]
                    else:
                        for q in range(wo):
                            r[k, q] = zero
                for q in range(wp):
                    t[0, q] = r[0, q]
                    t[1, q] = r[0, q] + r[1, q]
                    t[2, q] = r[0, q] - r[1, q]
                    t[3, q] = -r[1, q]
                base = (s * th + ti) * tw
                for k in range(4):
                    for tj in range(tw):
                        a0 = t[k, 2 * tj]
                        a1 = t[k, 2 * tj + 1]
                        dm[4 * k + 0, o, base + tj] = a0
                        dm[4 * k + 1, o, base + tj] = a0 + a1
                        dm[4 * k + 2, o, base + tj] = a0 - a1
                        dm[4 * k + 3, o, base + tj] = -a1
