"""The SZ codec's promises, held on adversarial inputs: the bound on every finite element, NaN/Inf bit-exact,
zeros exact and signs kept, same bytes for the same input, never larger than raw plus the header."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minidl.codec import sz

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def _assert_promises(x: np.ndarray, eb: float, entropy: str = "none") -> np.ndarray:
    s = sz.compress(x, eb, entropy)
    y = sz.decompress(s, x.shape)
    assert y.dtype == x.dtype and y.shape == x.shape
    fin = np.isfinite(x)
    err = np.abs(x[fin].astype(np.float64) - y[fin].astype(np.float64))
    assert (err <= eb).all(), f"bound {eb} broken: max error {err.max()}"
    assert (_bits(x[~fin]) == _bits(y[~fin])).all(), "a NaN/Inf was not stored exactly"
    assert (y[x == 0] == 0).all() and (np.sign(y[fin]) == np.sign(x[fin])).all()
    assert (np.signbit(y[fin]) == np.signbit(x[fin])).all(), "a sign was lost (-0.0 came back as +0.0?)"
    assert len(s) <= x.nbytes + sz.HEADER_BYTES
    assert sz.compress(x, eb, entropy) == s, "not deterministic"
    return y


_floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
_bounds = st.sampled_from([1e-40, 1e-30, 1e-7, 1e-3, 0.5, 1.0, 3.0, 1e6, 1e30, 3e38])


_entropy = st.sampled_from(sz.ENTROPY)


@_SETTINGS
@given(hnp.arrays(np.float32, hnp.array_shapes(max_dims=2, max_side=300), elements=_floats32), _bounds, _entropy)
def test_bound_on_arbitrary_float32(x, eb, entropy):
    _assert_promises(x, eb, entropy)


@_SETTINGS
@given(hnp.arrays(np.float64, st.integers(0, 700),
                  elements=st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True)),
       st.sampled_from([1e-300, 1e-9, 0.25, 7.0, 1e200]), _entropy)
def test_bound_on_arbitrary_float64(x, eb, entropy):
    _assert_promises(x, eb, entropy)


@_SETTINGS
@given(hnp.arrays(np.float32, st.integers(0, 3000), elements=_floats32), _bounds)
def test_compiled_quantize_is_the_numpy_reference(x, eb):
    """The compiled quantizer every encoding uses gives the numpy reference's bins and outliers exactly."""
    p, out = sz.quantize(x, eb)
    pj, outj = sz._jit().quantize(x, float(eb), float(sz.P_MAX))
    assert (p == pj).all() and (out == outj).all()


@_SETTINGS
@given(st.integers(1, 5000), st.floats(0.01, 3.0), st.integers(0, 2**31), st.sampled_from([0, 30, 1000, 10**9]))
def test_huffman_on_skewed_codes(n, scale, seed, jump):
    """Smooth data with rare jumps: long codes (the length limit), escaped codes beyond `HUFF_SYMBOLS`, single-
    symbol streams (constant data) all decode within the bound, and the stream is the same bytes each time."""
    rng = np.random.default_rng(seed)
    x = np.cumsum(rng.standard_normal(n) * scale).astype(np.float32)
    x[rng.random(n) < 0.01] += jump
    x[rng.random(n) < 0.5] = 0.0
    _assert_promises(x, 0.05, "huffman")


def test_huffman_code_lengths_are_limited_and_complete():
    """Fibonacci counts make the unlimited Huffman code ~40 bits deep: the limited one stays within
    HUFF_MAX_LEN and still satisfies Kraft's equality (a complete prefix code, so every 16-bit peek decodes)."""
    k = sz._jit()
    fib = [1, 1]
    while len(fib) < 40:
        fib.append(fib[-1] + fib[-2])
    lens = k.code_lengths(np.array(fib, np.int64), k.HUFF_MAX_LEN)
    assert lens.max() == k.HUFF_MAX_LEN and (lens > 0).all()
    assert sum(2.0 ** -int(v) for v in lens) == 1.0
    assert list(k.code_lengths(np.array([0, 7, 0], np.int64), k.HUFF_MAX_LEN)) == [0, 1, 0]


@pytest.mark.parametrize("x, eb", [(np.array([1.73604885e-263]), 1e200), (np.zeros(0), 1e-300)])
def test_found_by_hypothesis(x, eb):
    """An element whose |x| / 2eb underflows to 0 must still land in the first bin (sign kept); empty input."""
    _assert_promises(x, eb)


@_SETTINGS
@given(st.floats(min_value=1e-6, max_value=1e3), st.integers(1, 2000), st.integers(-5, 5))
def test_values_on_bin_edges(eb, n, shift):
    """Elements at k * 2eb (a bin's edge), nudged by a few ulps: where float32 rounding of the midpoint would
    cross the bound, the element must become an outlier, not a violation."""
    k = np.arange(-n // 2, n - n // 2, dtype=np.float64)
    x = (k * 2 * eb).astype(np.float32)
    x = np.nextafter(x, np.float32(np.inf) if shift > 0 else np.float32(-np.inf)) if shift else x
    _assert_promises(x, eb)


@pytest.mark.parametrize("x", [
    np.zeros(1000, np.float32),
    np.full(1000, 3.25, np.float32),
    np.full(777, -1e-42, np.float32),                       # denormals
    np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, np.finfo(np.float32).tiny] * 100, np.float32),
    np.linspace(-1e30, 1e30, 5000).astype(np.float32),      # a huge range: bins beyond P_MAX are outliers
    np.array([np.nan] * 300 + [np.inf, -np.inf] * 10, np.float32),
    np.frombuffer(np.array([0x7FC00001, 0xFFC12345, 0x7F800001], np.uint32).tobytes(), np.float32),  # NaN payloads
    np.zeros(0, np.float32),
])
@pytest.mark.parametrize("eb", [1e-4, 1.0])
@pytest.mark.parametrize("entropy", sz.ENTROPY)
def test_adversarial(x, eb, entropy):
    _assert_promises(x, eb, entropy)


def test_huffman_stage_keeps_promises_and_shrinks_relu_maps():
    rng = np.random.default_rng(0)
    smooth = np.cumsum(rng.standard_normal((8, 16, 32, 32)), axis=-1).astype(np.float32)
    x = np.maximum(smooth, 0)
    _assert_promises(x, 1e-2, "huffman")
    assert len(sz.compress(x, 1e-2, "huffman")) < len(sz.compress(x, 1e-2))


def test_compresses_smooth_data_and_larger_bound_compresses_more():
    rng = np.random.default_rng(1)
    x = np.cumsum(rng.standard_normal((4, 8, 32, 32)) * 0.01, axis=-1).astype(np.float32)
    sizes = [len(sz.compress(x, eb)) for eb in (1e-4, 1e-3, 1e-2)]
    assert sizes[0] > sizes[1] > sizes[2]
    assert x.nbytes / sizes[1] > 4


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("eb", [1e-6, 1e-3, 0.5, 10.0, 1e6])
def test_negative_zeros_keep_their_sign(dtype, eb):
    """-0.0 among smooth values, +0.0 and tiny negatives, compressed (not the raw fallback) at bounds below and
    far above the data: every -0.0 comes back as -0.0, every +0.0 as +0.0."""
    rng = np.random.default_rng(3)
    x = np.cumsum(rng.standard_normal(6000) * 0.01).astype(dtype)
    x[::9], x[4::9], x[7::90] = -0.0, 0.0, -1e-30
    s = sz.compress(x, eb)
    assert len(s) < x.nbytes  # the SZ stream, not raw
    y = _assert_promises(x, eb)
    assert (_bits(y[::9]) == _bits(np.array(-0.0, dtype))).all() and not np.signbit(y[4::9]).any()


def test_incompressible_falls_back_to_raw():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(4096).astype(np.float32) * 1e20
    s = sz.compress(x, 1e-30)
    assert len(s) == x.nbytes + sz.HEADER_BYTES
    assert (sz.decompress(s) == x).all()


@pytest.mark.parametrize("eb", [0.0, -1.0, float("nan"), float("inf"), "1"])
def test_bad_bound_is_refused(eb):
    with pytest.raises(sz.CodecError, match="error bound"):
        sz.compress(np.ones(4, np.float32), eb)


def test_bad_dtype_and_stream_are_refused():
    with pytest.raises(sz.CodecError, match="int32"):
        sz.compress(np.ones(4, np.int32), 0.1)
    with pytest.raises(sz.CodecError, match="not an sz stream"):
        sz.decompress(b"x" * 100)
    with pytest.raises(sz.CodecError, match="header"):
        sz.decompress(b"MSZ1")


@_SETTINGS
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 40)),
                  elements=st.floats(-1e6, 1e6, width=32) | st.sampled_from([np.nan, np.inf, -np.inf])))
def test_bound_statistics_match_numpy(x):
    """The compiled statistics the error bound is chosen from (max |x|, rms, per-channel variance, over the
    finite values) agree with numpy's reductions on the same values."""
    k = sz._jit()
    fin = x[np.isfinite(x)].astype(np.float64)
    top, sq, cnt = k.finite_stats(x.ravel())
    assert cnt == fin.size and top == (np.abs(fin).max() if fin.size else 0.0)
    assert np.isclose(sq, (fin * fin).sum(), rtol=1e-12, atol=0)
    var = k.channel_variances(x)
    xs = np.where(np.isfinite(x), x, np.nan).astype(np.float64)
    for c in range(x.shape[1]):
        col = xs[:, c][~np.isnan(xs[:, c])]
        assert (np.isnan(var[c]) if not col.size else np.isclose(var[c], col.var(), rtol=1e-9, atol=1e-300))
