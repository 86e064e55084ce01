"""The CPU's elementwise kernels on half arrays: one pass over the bits (`half_jit`) stores what the chunked path
(float32 copies, the float32 kernel, rounding) stores, bit for bit, and what numpy computes in float32 from the
stored values, rounded by ml_dtypes' / numpy's casts; infinities, NaNs and signed zeros included, an output that
is exactly an input included (the compiled step's placements), on one and two threads."""
from __future__ import annotations

import numpy as np
import pytest

from minidl.backend.cpu import half, lanes
from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.precision import HALF_DTYPES

MODES = tuple(HALF_DTYPES)
N = 3 * half.CHUNK + 17   # several chunks, a ragged last one; above PARALLEL_MIN: two workers where allowed


def _values(rng, mode, shift):
    """Random values after specials that meet other specials in the other operands (each array shifts them)."""
    v = (rng.standard_normal(N) * 3).astype(np.float32)
    v[:16] = np.roll([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-9, -1e-9, 70000.0, 1.5, -2.0, 0.0, -0.0, 3.0, -0.5,
                      np.inf, 1.0], shift)
    return v.astype(HALF_DTYPES[mode])


def _wide(a):
    return a.astype(np.float32)


def _rounded(f, mode):
    with np.errstate(over="ignore", invalid="ignore"):
        return f.astype(HALF_DTYPES[mode])


@np.errstate(invalid="ignore", over="ignore")
def _cases(rng, mode):
    """(name, call(be, arrays), arrays, the expected outputs as {index: float32 values}) for each variant."""
    x0, x1, dy = (_values(rng, mode, shift) for shift in (0, 3, 7))
    e = lambda: np.empty(N, HALF_DTYPES[mode])  # noqa: E731
    relu = lambda f: np.where(f <= 0, np.float32(0), f)  # noqa: E731  (as the kernels: NaN stays, -0 -> +0)
    mask = lambda y: (_wide(y) > 0).astype(np.float32)  # noqa: E731
    s = _wide(x0) + _wide(x1)
    return [
        ("relu_forward", lambda be, a: be.relu_forward(a[0], a[1]), [x0, e()], {1: relu(_wide(x0))}),
        ("relu_backward", lambda be, a: be.relu_backward(a[0], a[1], a[2]), [x0, dy, e()],
         {2: _wide(dy) * mask(x0)}),
        ("add", lambda be, a: be.add_forward([a[0], a[1]], a[2]), [x0, x1, e()], {2: s}),
        ("add_relu", lambda be, a: be.add_forward([a[0], a[1]], a[2], relu_out=a[3]), [x0, x1, e(), e()],
         {2: s, 3: relu(s)}),
        ("add_relu_only_in_place", lambda be, a: be.add_forward([a[0], a[1]], a[2], relu_out=a[0], keep_y=False),
         [x0.copy(), x1, e()], {0: relu(s)}),
        ("add_relu_backward", lambda be, a: be.add_relu_backward(a[0], a[1], a[2], [a[3], a[4]]),
         [x0, dy, e(), e(), e()], {3: _wide(dy) * mask(x0), 4: _wide(dy) * mask(x0)}),
        ("add_relu_backward_in_place", lambda be, a: be.add_relu_backward(a[0], a[1], a[2], [a[1], a[3]]),
         [x0, dy.copy(), e(), e()], {1: _wide(dy) * mask(x0), 3: _wide(dy) * mask(x0)}),
        ("accumulate", lambda be, a: be.accumulate(a[0], a[1]), [x0.copy(), x1], {0: s}),
    ]


def _bits(a):
    return a.view(np.uint16)


@pytest.mark.bits
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("threads", ["1", "2"])
def test_one_pass_is_the_chunked_path_and_numpy(mode, threads, monkeypatch):
    monkeypatch.setattr(lanes, "_threads", [int(threads)])   # as lanes.using(threads) inside the test
    be = CPUBackend()
    names = [c[0] for c in _cases(np.random.default_rng(0), mode)]
    for k, name in enumerate(names):
        one = _cases(np.random.default_rng(0), mode)[k]
        chunked = _cases(np.random.default_rng(0), mode)[k]
        one[1](be, one[2])
        with monkeypatch.context() as m:
            m.setattr(half, "_one_pass", lambda *a: False)
            chunked[1](be, chunked[2])
        for i, want in one[3].items():
            np.testing.assert_array_equal(_bits(one[2][i]), _bits(chunked[2][i]), err_msg=name)
            got, ref = one[2][i], _rounded(want, mode)
            nan = np.isnan(_wide(ref))
            np.testing.assert_array_equal(np.isnan(_wide(got)), nan, err_msg=name)
            np.testing.assert_array_equal(_bits(got)[~nan], _bits(ref)[~nan], err_msg=name)
