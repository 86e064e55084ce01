"""The JPEG-ACT-style comparator codec: it round-trips (errors shrink as quality rises, exact tables at 100 keep
smooth planes close), is deterministic, handles odd shapes and non-finite values, and refuses bad input."""
from __future__ import annotations

import numpy as np
import pytest

from minidl.codec import jpeg_act


def _rel(x, y):
    return float(np.sqrt(np.mean((x.astype(np.float64) - y) ** 2)) / np.sqrt(np.mean(x.astype(np.float64) ** 2)))


@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (1, 4, 13, 7), (5, 33), (40,), (2, 1, 1, 1)])
def test_round_trip_improves_with_quality(shape):
    rng = np.random.default_rng(0)
    x = np.cumsum(np.cumsum(rng.standard_normal(shape), axis=-1), axis=0).astype(np.float32) + 0.5
    errs, sizes = [], []
    for q in (50, 90, 100):
        s = jpeg_act.compress(x, q)
        y = jpeg_act.decompress(s, x.shape)
        assert y.shape == x.shape and y.dtype == np.float32
        assert jpeg_act.compress(x, q) == s
        errs.append(_rel(x, y))
        sizes.append(len(s))
    assert errs[0] >= errs[1] >= errs[2] and errs[2] < 0.02
    assert sizes[0] <= sizes[1] <= sizes[2]


def test_smooth_maps_compress_and_non_finite_values_do_not_break_it():
    rng = np.random.default_rng(1)
    x = np.maximum(np.cumsum(rng.standard_normal((4, 8, 32, 32)) * 0.1, axis=-1), 0).astype(np.float32)
    s = jpeg_act.compress(x, 90)
    assert x.nbytes / len(s) > 4 and _rel(x, jpeg_act.decompress(s, x.shape)) < 0.2
    x[0, 0, 0, :3] = [np.nan, np.inf, -np.inf]
    assert np.isfinite(jpeg_act.decompress(jpeg_act.compress(x, 90), x.shape)).all()


@pytest.mark.parametrize("quality", [0, 101, 2.5])
def test_bad_quality_is_refused(quality):
    with pytest.raises(jpeg_act.CodecError, match="quality"):
        jpeg_act.compress(np.ones((8, 8), np.float32), quality)


def test_bad_dtype_and_stream_are_refused():
    with pytest.raises(jpeg_act.CodecError, match="int32"):
        jpeg_act.compress(np.ones((8, 8), np.int32))
    with pytest.raises(jpeg_act.CodecError, match="not a jpeg_act stream"):
        jpeg_act.decompress(b"x" * 64, (8, 8))
