"""The CPU's half conversions (`cpu.half_jit`, `cpu.half`) against numpy's and ml_dtypes' own casts, bit for bit:
every one of the 65536 half values widened; float32 values rounded to nearest even from random bit patterns and
the edges (ties, the largest finite halves, overflow, subnormals, signed zeros, infinities); a NaN stays a NaN.
On the flat, strided and numpy (numba missing) paths alike.
"""
from __future__ import annotations

import numpy as np
import pytest

from minidl.backend.cpu import half
from minidl.backend.precision import HALF_DTYPES

MODES = tuple(HALF_DTYPES)


def _edges(mode) -> np.ndarray:
    h = HALF_DTYPES[mode]
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(h).astype(np.float32)
    finite = every[np.isfinite(every)]
    ties = (finite[:-1].astype(np.float64) + np.diff(finite.astype(np.float64)) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf)])
    big = np.float32(65504 if mode == "fp16" else 3.3895314e38)
    extra = np.array([0.0, -0.0, np.inf, -np.inf, big, -big, big * 1.0001, 65520, 65519.99, 1e-8, -1e-8, 2.0 ** -25,
                      2.0 ** -24, 2.0 ** -24 * 1.5, 2.0 ** -24 * 2.5, 6.1e-5, 1e-45, -1e-45, 3e38], np.float32)
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([every, ties, near, extra, random_bits])


def _same(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bits, except that a NaN need only be a NaN (its payload is not part of the contract)."""
    g, w = got.astype(np.float32), want.astype(np.float32)
    nan = np.isnan(w)
    np.testing.assert_array_equal(np.isnan(g), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


@pytest.fixture(params=["compiled", "numpy"])
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(half, "half_kernels", lambda: None)
    return request.param


@pytest.mark.bits
@pytest.mark.parametrize("mode", MODES)
def test_widen_every_half_value(mode, path):
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(HALF_DTYPES[mode])
    f = np.empty(h.shape, np.float32)
    half.widen_into(f, h)
    want = h.astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(f), nan)
    np.testing.assert_array_equal(f.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


@pytest.mark.bits
@pytest.mark.parametrize("mode", MODES)
def test_narrow_rounds_to_nearest_even(mode, path):
    f = _edges(mode)
    h = np.empty(f.shape, HALF_DTYPES[mode])
    half.narrow_into(h, f)
    with np.errstate(over="ignore", invalid="ignore"):
        _same(h, f.astype(HALF_DTYPES[mode]))


@pytest.mark.bits
@pytest.mark.parametrize("mode", MODES)
def test_strided_views(mode, path):
    """Views with any strides (attention's heads: a transposed slice of the last axis) convert as their values."""
    rng = np.random.default_rng(1)
    base = (rng.standard_normal((3, 7, 24)) * 100).astype(np.float32)
    view = base[:, :, 8:16].reshape(3, 7, 2, 4).transpose(0, 2, 1, 3)
    hb = np.zeros(base.shape, HALF_DTYPES[mode])
    hv = hb[:, :, 8:16].reshape(3, 7, 2, 4).transpose(0, 2, 1, 3)
    half.narrow_into(hv, view)
    _same(hv, view.astype(HALF_DTYPES[mode]))
    assert not hb[:, :, :8].astype(np.float32).any() and not hb[:, :, 16:].astype(np.float32).any()
    back = np.empty(view.shape, np.float32)
    half.widen_into(back, hv)
    np.testing.assert_array_equal(back, hv.astype(np.float32))


@pytest.mark.bits
@pytest.mark.parametrize("mode", MODES)
def test_quantize_keeps_the_rounded_values_in_float32(mode, path):
    f = _edges(mode)
    f = f[np.isfinite(f)].copy()
    with np.errstate(over="ignore", invalid="ignore"):
        want = f.astype(HALF_DTYPES[mode]).astype(np.float32)
    half.quantize(f, HALF_DTYPES[mode])
    np.testing.assert_array_equal(f.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("mode", MODES)
def test_cast_into_both_ways(mode):
    src = np.array([1.0, 1 + 2.0 ** -9, -3.5, 1e30], np.float32)
    h = np.empty(4, HALF_DTYPES[mode])
    with np.errstate(over="ignore", invalid="ignore"):
        half.cast_into(h, src)
        _same(h, src.astype(HALF_DTYPES[mode]))
    f = np.empty(4, np.float32)
    half.cast_into(f, h)
    np.testing.assert_array_equal(f, h.astype(np.float32))


def _digests() -> dict:
    """Digests of the compiled conversions' results on the edge values (narrowed, widened back, quantized)."""
    import hashlib

    out = {}
    for mode in MODES:
        f = _edges(mode)
        h = np.empty(f.shape, HALF_DTYPES[mode])
        half.narrow_into(h, f)
        w = np.empty(f.shape, np.float32)
        half.widen_into(w, h)
        q = f[np.isfinite(f)].copy()
        half.quantize(q, HALF_DTYPES[mode])
        out[mode] = [hashlib.sha256(a.tobytes()).hexdigest()[:16] for a in (h, w, q)]
    return out


@pytest.mark.slow
@pytest.mark.skipif(__import__("platform").machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")
def test_same_bits_when_compiled_for_a_generic_x86_64_cpu():
    """Integer operations and one IEEE addition per value: numba's code for a generic x86-64 CPU (no AVX, no
    F16C; compiled in a cache folder of its own) gives the bits of the code for this one."""
    from tests.backend.generic_cpu import digests_on_generic_cpu

    assert digests_on_generic_cpu("tests.backend.test_half_cast") == _digests()
