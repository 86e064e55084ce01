"""The SZ codec's compiled (numba) kernels: quantization with its bound check, the Huffman stage, the one-pass
decoder, and the statistics `memory.errorbound` chooses a bound from.

Rule: the same arithmetic in the same order as `sz`'s numpy reference (float64, then one rounding to the tensor's
dtype), so bins, outliers and decoded values match it bit for bit (tests/codec/test_sz.py). Compiled because
numpy's ~15 passes per tensor took most of a compressed step (`benchmarks/compression.py`).
"""
from __future__ import annotations

import math

import numpy as np

from ..core.jit_cache import njit

_OPTS = dict(cache=True, nogil=True, error_model="numpy")

HUFF_MAX_LEN = 16
"""Longest Huffman code: the decoder resolves a code with one lookup in a 2**16-entry table."""


@njit(**_OPTS)
def _bin(xf, eb, two_eb, p_max, rt):
    """(bin, kept) of one value as float64; `rt` rounds as the decoder stores."""
    a = abs(xf) / two_eb
    if not (np.isfinite(a) and a <= p_max):
        return 0, False
    q = np.int64(math.ceil(a))
    if q == 0 and xf != 0.0:
        q = 1
    if xf < 0.0:
        q = -q
    if q == 0:
        return 0, math.copysign(1.0, xf) > 0.0     # -0.0 would decode as +0.0: an outlier
    rt[0] = math.copysign((2.0 * abs(q) - 1.0) * eb, q)
    return q, abs(xf - np.float64(rt[0])) <= eb


@njit(**_OPTS)
def quantize(x, eb, p_max):
    """`sz.quantize` element by element: (bins, outlier indices)."""
    n = x.size
    p = np.empty(n, np.int64)
    bad = np.empty(n, np.int64)
    nbad = 0
    rt = np.empty(1, x.dtype)
    for i in range(n):
        q, ok = _bin(np.float64(x[i]), eb, 2.0 * eb, p_max, rt)
        p[i] = q if ok else 0
        if not ok:
            bad[nbad] = i
            nbad += 1
    return p, bad[:nbad].copy()


@njit(**_OPTS)
def quantize_symbols(x, eb, p_max, nsym):
    """Quantize and predict in one pass: (uint16 symbols, escaped codes, counts, outliers); no bins stored."""
    n = x.size
    s = np.empty(n, np.uint16)
    esc = np.empty(n, np.int64)   # pages never written are never committed
    ne = 0
    bad = np.empty(n, np.int64)
    nbad = 0
    freq = np.zeros(nsym + 1, np.int64)
    rt = np.empty(1, x.dtype)
    two_eb = 2.0 * eb
    prev = 0
    for i in range(n):
        q, ok = _bin(np.float64(x[i]), eb, two_eb, p_max, rt)
        if not ok:
            q = 0
            bad[nbad] = i
            nbad += 1
        d = q - prev
        prev = q
        u = (d << 1) ^ (d >> 63)
        if u < nsym:
            s[i] = u
            freq[u] += 1
        else:
            s[i] = nsym
            freq[nsym] += 1
            esc[ne] = u
            ne += 1
    return s, esc[:ne].copy(), freq, bad[:nbad].copy()


@njit(**_OPTS)
def finite_stats(x):
    """(max |x|, sum of x^2, count) over the finite values, in float64."""
    top = 0.0
    sq = 0.0
    cnt = 0
    for i in range(x.size):
        v = np.float64(x[i])
        if np.isfinite(v):
            a = abs(v)
            if a > top:
                top = a
            sq += v * v
            cnt += 1
    return top, sq, cnt


@njit(**_OPTS)
def channel_variances(x):
    """Per-channel variance of x as (N, C, M) over finite values (nanvar's order), NaN for none."""
    nn, c, m = x.shape
    out = np.empty(c, np.float64)
    for ch in range(c):
        tot = 0.0
        cnt = 0
        for k in range(nn):
            for j in range(m):
                v = np.float64(x[k, ch, j])
                if np.isfinite(v):
                    tot += v
                    cnt += 1
        if cnt == 0:
            out[ch] = np.nan
            continue
        mean = tot / cnt
        dev = 0.0
        for k in range(nn):
            for j in range(m):
                v = np.float64(x[k, ch, j])
                if np.isfinite(v):
                    dev += (v - mean) * (v - mean)
        out[ch] = dev / cnt
    return out


@njit(**_OPTS)
def _lengths_once(w):
    """Huffman code lengths of ascending weights `w`, a leaf first on ties (deterministic)."""
    m = w.size
    weight = np.empty(2 * m - 1, np.int64)
    parent = np.zeros(2 * m - 1, np.int64)
    weight[:m] = w
    leaf, node = 0, m
    for new in range(m, 2 * m - 1):
        pick = np.empty(2, np.int64)
        for j in range(2):
            if leaf < m and (node >= new or weight[leaf] <= weight[node]):
                pick[j] = leaf
                leaf += 1
            else:
                pick[j] = node
                node += 1
        weight[new] = weight[pick[0]] + weight[pick[1]]
        parent[pick[0]] = new
        parent[pick[1]] = new
    depth = np.zeros(2 * m - 1, np.int64)
    for k in range(2 * m - 3, -1, -1):
        depth[k] = depth[parent[k]] + 1
    return depth[:m]


@njit(**_OPTS)
def code_lengths(freq, max_len):
    """Huffman code lengths within `max_len` (counts halved until they fit); 0 if absent, 1 if alone."""
    lens = np.zeros(freq.size, np.int64)
    used = np.flatnonzero(freq)
    if used.size == 1:
        lens[used[0]] = 1
    if used.size <= 1:
        return lens
    w = freq[used].copy()
    while True:
        order = np.argsort(w, kind="mergesort")      # stable: ties in symbol order
        depth = _lengths_once(w[order])
        if depth.max() <= max_len:
            for k in range(order.size):
                lens[used[order[k]]] = depth[k]
            return lens
        w = (w + 1) // 2


@njit(**_OPTS)
def canonical_codes(lens):
    """Canonical codes from lengths (shorter first, then by symbol): a stream stores only (symbol, length)."""
    codes = np.zeros(lens.size, np.int64)
    used = np.flatnonzero(lens)
    order = used[np.argsort(lens[used], kind="mergesort")]
    code = 0
    prev = 0
    for s in order:
        code <<= lens[s] - prev
        prev = lens[s]
        codes[s] = code
        code += 1
    return codes


@njit(**_OPTS)
def huff_encode(s, codes, lens, nbits):
    """Symbols -> codes, most significant bit first."""
    out = np.zeros((nbits + 7) // 8, np.uint8)
    acc = 0
    nacc = 0
    pos = 0
    for i in range(s.size):
        c = s[i]
        acc = (acc << lens[c]) | codes[c]
        nacc += lens[c]
        while nacc >= 8:
            nacc -= 8
            out[pos] = (acc >> nacc) & 0xFF
            pos += 1
        acc &= (1 << nacc) - 1
    if nacc:
        out[pos] = (acc << (8 - nacc)) & 0xFF
    return out


@njit(**_OPTS)
def _decode_table(syms, lens, codes):
    """For every HUFF_MAX_LEN-bit window, the symbol its prefix codes and that code's length."""
    tsym = np.zeros(1 << HUFF_MAX_LEN, np.uint16)
    tlen = np.zeros(1 << HUFF_MAX_LEN, np.uint8)
    for k in range(syms.size):
        sh = HUFF_MAX_LEN - lens[k]
        lo = codes[k] << sh
        for j in range(lo, lo + (1 << sh)):
            tsym[j] = syms[k]
            tlen[j] = lens[k]
    return tsym, tlen


@njit(**_OPTS)
def huff_decode(bits, syms, lens, codes, nsym, esc, n, eb, out):
    """Huffman stream -> symbols -> codes -> bins -> values in `out`, as `sz.dequantize`, in one pass."""
    tsym, tlen = _decode_table(syms, lens, codes)
    acc = 0
    nacc = 0
    pos = 0
    nb = bits.size
    ke = 0
    prev = 0
    for i in range(n):
        while nacc <= 48:
            acc = (acc << 8) | (np.int64(bits[pos]) if pos < nb else 0)
            pos += 1
            nacc += 8
        peek = (acc >> (nacc - HUFF_MAX_LEN)) & 0xFFFF
        u = np.int64(tsym[peek])
        nacc -= np.int64(tlen[peek])
        acc &= (1 << nacc) - 1
        if u == nsym:
            u = esc[ke]
            ke += 1
        q = prev + ((u >> 1) ^ -(u & 1))
        prev = q
        if q == 0:
            out[i] = 0.0
        else:
            out[i] = math.copysign((2.0 * abs(q) - 1.0) * eb, q)
    return out


@njit(**_OPTS)
def int_symbols(v, nsym):
    """Integers as Huffman symbols without prediction (`jpeg_act`): (symbols, escaped, counts)."""
    n = v.size
    s = np.empty(n, np.uint16)
    esc = np.empty(n, np.int64)
    ne = 0
    freq = np.zeros(nsym + 1, np.int64)
    for i in range(n):
        d = np.int64(v[i])
        u = (d << 1) ^ (d >> 63)
        if u < nsym:
            s[i] = u
            freq[u] += 1
        else:
            s[i] = nsym
            freq[nsym] += 1
            esc[ne] = u
            ne += 1
    return s, esc[:ne].copy(), freq


@njit(**_OPTS)
def huff_decode_ints(bits, syms, lens, codes, nsym, esc, n):
    """Inverse of `int_symbols` + `huff_encode`, as int64."""
    tsym, tlen = _decode_table(syms, lens, codes)
    out = np.empty(n, np.int64)
    acc = 0
    nacc = 0
    pos = 0
    nb = bits.size
    ke = 0
    for i in range(n):
        while nacc <= 48:
            acc = (acc << 8) | (np.int64(bits[pos]) if pos < nb else 0)
            pos += 1
            nacc += 8
        peek = (acc >> (nacc - HUFF_MAX_LEN)) & 0xFFFF
        u = np.int64(tsym[peek])
        nacc -= np.int64(tlen[peek])
        acc &= (1 << nacc) - 1
        if u == nsym:
            u = esc[ke]
            ke += 1
        out[i] = (u >> 1) ^ -(u & 1)
    return out
