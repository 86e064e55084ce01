"""The SZ codec's compiled (numba) kernels: quantization with its bound check, the Huffman stage, the decoder
that turns a Huffman stream back into values in one pass, and the statistics an error bound is chosen from
(`memory.errorbound`).

Why compiled: the numpy codec makes ~15 full passes over each tensor (float64 copies, `where`s, the bound
check in float64, bit-planes one by one) and took most of a training step that compresses its activations
(`benchmarks/compression.py`, codec time). One loop per stage does the same arithmetic element by element in
the same order, in float64 then one rounding to the tensor's dtype, so the bins, the outliers and every decoded
value are the numpy path's, bit for bit (tests/codec/test_sz.py compares the two).

Imported on first use by `sz` (importing numba costs ~0.3 s that planning never needs). Cached on disk like
the CPU backend's kernels (`core.jit_cache`).
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
    """(bin, kept) of one value read as float64: `sz.quantize` for one element. `rt` is a 1-element array of the
    tensor's dtype, through which the decoded value is rounded as the decoder will store it."""
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
    """(bin per element, outlier indices) for a flat float array: `sz.quantize`, element by element."""
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
    """Quantization and Lorenzo prediction in one pass, for the Huffman stage: the bins `quantize` gives (an
    outlier's bin 0), their codes p[i] - p[i-1] zigzagged, a code u < nsym as symbol u and a larger one as the
    escape symbol nsym with u kept apart. Returns (symbols as uint16, escaped codes, symbol counts, outlier
    indices); the bins themselves are never stored (8 bytes an element of memory traffic saved)."""
    n = x.size
    s = np.empty(n, np.uint16)
    esc = np.empty(n, np.int64)   # pages never written are never committed: these cost what they hold
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
    """(max |x|, sum of x^2, count) over the finite values of a flat array, in float64: the error bound's cap and
    rule B0's rms in one pass instead of a boolean-indexed copy each."""
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
    """Variance per channel of x seen as (N, C, M) over its finite values (the mean first, then the mean squared
    deviation, in float64, as numpy's nanvar), NaN for a channel with none: rule N's sigma_c in two compiled
    passes instead of a float64 copy and five numpy reductions."""
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
    """Huffman code lengths of weights `w` (> 0, ascending), by the two-queue method: leaves and merged nodes
    are each taken in ascending weight order, a leaf first on a tie (so the lengths are deterministic)."""
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
    """Length-limited Huffman code length per symbol (0: the symbol never occurs; a lone symbol gets 1).
    Counts are halved (never to zero) until the longest code fits in `max_len` bits: it costs a fraction of a
    percent on activations and keeps the decoder's table at 2**max_len entries."""
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
    """The canonical code of each symbol from its length (shorter codes first, then by symbol): a stream stores
    only (symbol, length) pairs and the decoder rebuilds the same codes."""
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
    """Symbols -> their codes, most significant bit first, in ceil(nbits / 8) bytes."""
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
    """The canonical code's lookup table: for every HUFF_MAX_LEN-bit window, the symbol its prefix codes and that
    code's length, so a decoder reads one symbol per table lookup (both decoders share it)."""
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
    """Huffman stream -> symbols -> Lorenzo codes -> bins (a running sum) -> values in `out` (length n, the
    tensor's dtype), in one pass. The values are `sz.dequantize`'s: float64, then one rounding to out's dtype."""
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
    """Integers as Huffman symbols without prediction: v zigzagged, a code u < nsym as symbol u, a larger one
    the escape symbol nsym with u kept apart (`jpeg_act`'s quantized coefficients). Returns (symbols, escaped
    codes, counts)."""
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
    """Inverse of `int_symbols` + `huff_encode`: the integers back, as int64."""
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
