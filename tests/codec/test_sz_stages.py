"""The SZ codec's stages on their own (`codec/sz.py`): quantization, Lorenzo prediction, the fixed-length blocks and
the Huffman entropy stage, each by its round trip, its bound and its size, exactly.

Why apart from the whole: a broken stage can keep every promise of the whole and only cost bytes. A Huffman table
whose lengths are a valid prefix code but not the optimal one decodes every stream right, within the bound, and
test_sz.py's properties all hold; only the stage's size shows it. So the Huffman stage's bits are held to the
optimal code's (a reference built here with a heap), the blocks' bytes to their layout, and the whole stream's
length to the sum of its parts; `test_a_planted_suboptimal_table_is_caught` plants such a table and requires the
check to fail."""
from __future__ import annotations

import heapq
import math

import numpy as np
import pytest

from minidl.codec import sz

EB = 1e-2


def _relu_map(seed: int = 0, shape=(4, 8, 32, 32), step: float = 1.0) -> np.ndarray:
    """A ReLU's output over a random walk of `step`: runs of zeros, smooth positives (what the store compresses)."""
    rng = np.random.default_rng(seed)
    return np.maximum(np.cumsum(rng.standard_normal(shape) * step, axis=-1), 0).astype(np.float32)


def _zigzag(d: np.ndarray) -> np.ndarray:
    return ((d << 1) ^ (d >> 63)).astype(np.uint64)


def _optimal_bits(freq: np.ndarray) -> tuple[int, int]:
    """(total bits, longest code) of an optimal prefix code for counts `freq`: Huffman's merge with a heap. The
    total (the sum of the merged weights) is the same for every optimal code, whatever its ties."""
    heap = [(int(f), 0) for f in freq if f > 0]
    if len(heap) == 1:
        return int(heap[0][0]), 1
    heapq.heapify(heap)
    total = 0
    while len(heap) > 1:
        (a, da), (b, db) = heapq.heappop(heap), heapq.heappop(heap)
        total += a + b
        heapq.heappush(heap, (a + b, max(da, db) + 1))
    return total, heap[0][1]


def _entropy_bits(freq: np.ndarray) -> float:
    p = freq[freq > 0] / freq.sum()
    return float(-(p * np.log2(p)).sum() * freq.sum())


# -- quantization --------------------------------------------------------------------------------------------------
def test_quantization_alone_keeps_the_bound_and_lists_exactly_the_outliers():
    x = _relu_map().ravel()
    x[[5, 77, 901]] = [np.nan, np.inf, -0.0]
    x[1000] = 1e30                                 # a bin beyond P_MAX: an outlier
    p, out = sz.quantize(x, EB)
    y = sz.dequantize(p, EB, x.dtype)
    kept = np.ones(x.size, bool)
    kept[out] = False
    assert list(out) == [5, 77, 901, 1000]
    assert (np.abs(x[kept].astype(np.float64) - y[kept]) <= EB).all()
    assert ((p == 0) == ((x == 0) | ~kept)).all(), "bin 0 is for zeros and outliers only"
    assert (np.sign(p[kept]) == np.sign(x[kept])).all()


# -- prediction ----------------------------------------------------------------------------------------------------
def test_lorenzo_symbols_are_the_differences_of_the_bins():
    """The Huffman stage's symbols (quantization and prediction in one compiled pass) are the zigzagged
    differences of `quantize`'s bins, codes past `HUFF_SYMBOLS` escaped in order; their counts are the histogram."""
    x = _relu_map(1).ravel()
    x[::997] *= 1e4                                 # jumps past HUFF_SYMBOLS bins: escaped codes
    p, out = sz.quantize(x, EB)
    s, esc, freq, out_j = sz._jit().quantize_symbols(x, EB, float(sz.P_MAX), sz.HUFF_SYMBOLS)
    u = _zigzag(np.diff(p, prepend=0))
    big = u >= sz.HUFF_SYMBOLS
    assert big.any() and (out_j == out).all()
    assert (s[~big] == u[~big]).all() and (s[big] == sz.HUFF_SYMBOLS).all() and (esc == u[big]).all()
    assert (freq == np.bincount(s, minlength=sz.HUFF_SYMBOLS + 1)).all()


def test_prediction_shrinks_what_is_left_to_encode():
    """On smooth data the Lorenzo codes carry fewer bits (their entropy) than the bins they predict."""
    walk = np.cumsum(np.random.default_rng(2).standard_normal(30_000) * 0.05).astype(np.float32)
    p, _ = sz.quantize(walk, EB)
    bins = np.unique(p, return_counts=True)[1]
    codes = np.unique(np.diff(p, prepend=0), return_counts=True)[1]
    assert _entropy_bits(codes) < 0.5 * _entropy_bits(bins)


# -- Huffman -------------------------------------------------------------------------------------------------------
def _check_huffman_stage(x: np.ndarray, eb: float) -> None:
    """The Huffman stage of `x`: a complete prefix code no longer than `HUFF_MAX_LEN` bits, whose bits are exactly
    the optimal code's (where the optimal code fits the length limit), packed in exactly the layout's bytes."""
    k = sz._jit()
    s, esc, freq, _ = k.quantize_symbols(x.ravel(), eb, float(sz.P_MAX), sz.HUFF_SYMBOLS)
    body = sz.huffman_pack(s, esc, freq)
    bits, syms, lens, codes, esc_back, end = sz.huffman_unpack(body)
    used = np.flatnonzero(freq)
    assert end == len(body) and (syms == used).all() and (esc_back == esc).all()
    assert lens.max() <= k.HUFF_MAX_LEN and math.fsum(2.0 ** -lens.astype(float)) == 1.0, "not a complete code"
    words = sorted(format(int(c), f"0{int(n)}b") for c, n in zip(codes, lens))
    assert not any(b.startswith(a) for a, b in zip(words, words[1:])), "not a prefix code"
    coded = int((freq[used] * lens).sum())
    optimal, depth = _optimal_bits(freq)
    assert depth <= k.HUFF_MAX_LEN, "the optimal code needs more than the length limit: pick other data"
    assert coded == optimal, f"the Huffman stage codes {coded} bits, the optimal code {optimal}"
    assert _entropy_bits(freq) <= coded < _entropy_bits(freq) + freq.sum()
    layout = 20 + 3 * used.size + 8 * esc.size + -(-coded // 8)   # counts, (symbol, length) pairs, escapes, bits
    assert len(body) == layout


@pytest.mark.parametrize("seed, eb", [(0, 1e-2), (3, 1e-3), (4, 0.5)])
def test_huffman_stage_is_the_optimal_code(seed, eb):
    x = _relu_map(seed)
    x[0, 0, 0, ::7] += 1e4                          # escaped codes too
    _check_huffman_stage(x, eb)


def test_huffman_stage_round_trips_integers_alone():
    """The entropy stage without quantization (`int_symbols`, the JPEG-ACT codec's use): skewed integers, long
    codes and escapes come back exactly."""
    k = sz._jit()
    rng = np.random.default_rng(5)
    v = np.round(rng.laplace(0, 3, 20000)).astype(np.int64)
    v[::1000] = rng.integers(-10**9, 10**9, 20)
    s, esc, freq = k.int_symbols(v, sz.HUFF_SYMBOLS)
    bits, syms, lens, codes, esc_back, _ = sz.huffman_unpack(sz.huffman_pack(s, esc, freq))
    back = k.huff_decode_ints(bits, syms, lens, codes, sz.HUFF_SYMBOLS, esc_back, v.size)
    assert (back == v).all()


def test_a_planted_suboptimal_table_is_caught(monkeypatch):
    """A table of equal lengths (a valid, decodable prefix code, so every stream still round-trips within the
    bound) must fail the stage's check: it is what a broken table looks like from outside."""
    k = sz._jit()
    x = _relu_map(0)
    real = k.code_lengths

    def flat(freq, max_len):
        lens = real(freq, max_len)
        used = np.flatnonzero(lens)
        lens[used] = max(1, math.ceil(math.log2(used.size)))
        return lens

    monkeypatch.setattr(k, "code_lengths", flat)
    s = sz.compress(x, EB, "huffman")
    assert np.abs(sz.decompress(s, x.shape).astype(np.float64) - x).max() <= EB   # the whole keeps its promises
    with pytest.raises(AssertionError):
        _check_huffman_stage(x, EB)


# -- the blocks, and the whole -------------------------------------------------------------------------------------
def test_block_stage_is_its_layout():
    """The fixed-length blocks of `entropy="none"`: one width byte a block, w bit-planes of BLOCK bits for a block
    whose largest zigzagged code has w bits, the anchors as planes of their own; decoded back to the bins."""
    x = _relu_map(6).ravel()[:10_000]
    p, _ = sz.quantize(x, EB)
    body, aw = sz._encode_blocks(p)
    nb = -(-p.size // sz.BLOCK)
    P = np.zeros(nb * sz.BLOCK, np.int64)
    P[:p.size] = p
    P = P.reshape(nb, sz.BLOCK)
    d = np.diff(P, axis=1)
    widths = [int(_zigzag(row).max()).bit_length() for row in d]
    anchor_w = int(_zigzag(P[:, 0]).max()).bit_length()
    assert aw == anchor_w
    assert len(body) == -(-nb // sz.BLOCK) * anchor_w * sz.BLOCK // 8 + nb + sum(widths) * sz.BLOCK // 8
    assert (sz._decode_blocks(memoryview(body), p.size, aw) == p).all()


@pytest.mark.parametrize("entropy", sz.ENTROPY)
def test_the_stream_is_the_sum_of_its_stages(entropy):
    """Header + the entropy stage's body + each outlier's index (4 bytes) and value: nothing else, nothing lost."""
    x = _relu_map(7)
    x.ravel()[[3, 4000]] = np.nan
    flat = x.ravel()
    p, out = sz.quantize(flat, EB)
    if entropy == "huffman":
        s, esc, freq, _ = sz._jit().quantize_symbols(flat, EB, float(sz.P_MAX), sz.HUFF_SYMBOLS)
        body = sz.huffman_pack(s, esc, freq)
    else:
        body = sz._encode_blocks(p)[0]
    stream = sz.compress(x, EB, entropy)
    assert len(stream) == sz.HEADER_BYTES + len(body) + out.size * (4 + 4)
    assert x.nbytes / len(stream) > 3
