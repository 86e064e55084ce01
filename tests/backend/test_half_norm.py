"""Batch norm's compiled kernels on half arrays read and write the half bits themselves: they stage nothing and
store what the staged path (float32 copies, the float32 kernel, rounding) stores, bit for bit: with the ReLU folded
in forward and backward, y kept or not, an output that is exactly an input, one and two threads, bf16 and fp16, on
values that round to ties, to subnormals and past the largest half value, with infinities and NaNs in a channel."""
from __future__ import annotations

import numpy as np
import pytest

from minidl.backend.cpu import half, lanes
from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.precision import HALF_DTYPES

MODES = tuple(HALF_DTYPES)
SHAPE = (4, 6, 40, 48)   # 46080 values: two workers at two threads (channels split)


@np.errstate(over="ignore")
def _values(rng, mode, scale):
    v = (rng.standard_normal(SHAPE) * scale).astype(np.float32)
    v[0, 0, 0, :8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, 70000.0, 1 + 2 ** -8]   # channel 0: NaN
    v[:, 1] = v[:, 1] * 1e-6    # channel 1: fp16 subnormals, bf16 ties
    v[:, 2] = v[:, 2] * 3e4     # channel 2: fp16 overflows
    return v.astype(HALF_DTYPES[mode])


def _params(rng):
    c = SHAPE[1]
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return f(c), f(c), f(c), np.abs(f(c)) + 0.5


def _calls(rng, mode):
    """(name, call(be, arrays), arrays): the arrays the call writes are compared."""
    x, dy, r = (_values(rng, mode, s) for s in (1.0, 2.0, 1.5))
    w, b, rm, rv = _params(rng)
    e = lambda: np.zeros(SHAPE, HALF_DTYPES[mode])  # noqa: E731
    stats = lambda: [np.zeros(SHAPE[1], np.float32) for _ in range(4)]  # noqa: E731  mean, invstd, dw, db
    with np.errstate(invalid="ignore"):
        mean = np.nan_to_num(x.astype(np.float32).mean(axis=(0, 2, 3))).astype(np.float32)
    inv = (1.0 / (np.abs(mean) + 0.7)).astype(np.float32)

    def train(keep, z_is_x):
        def call(be, a):
            be.batchnorm_forward_train(a[0], w, b, rm.copy(), rv.copy(), a[1], a[3], a[4], 0.1, 1e-5,
                                       relu_out=a[0] if z_is_x else a[2], keep_y=keep)
        return call
    return [
        ("train_relu", train(True, False), [x.copy(), e(), e(), *stats()]),
        ("train_relu_only", train(False, False), [x.copy(), e(), e(), *stats()]),
        ("train_relu_over_x", train(True, True), [x.copy(), e(), e(), *stats()]),
        ("train", lambda be, a: be.batchnorm_forward_train(a[0], w, None, rm.copy(), rv.copy(), a[1], a[3], a[4],
                                                           0.1, 1e-5), [x.copy(), e(), e(), *stats()]),
        ("apply", lambda be, a: be.batchnorm_forward_apply(a[0], w, b, mean, inv, a[1]), [x.copy(), e()]),
        ("eval", lambda be, a: be.batchnorm_forward_eval(a[0], w, b, rm, rv, a[1], 1e-5), [x.copy(), e()]),
        ("backward", lambda be, a: be.batchnorm_backward(a[0], w, a[1], mean, inv, a[2], a[3], a[4]),
         [x.copy(), dy.copy(), e(), *stats()[2:]]),
        ("backward_relu", lambda be, a: be.batchnorm_backward(a[0], w, a[1], mean, inv, a[2], a[3], a[4],
                                                              relu=(a[5], a[6])),
         [x.copy(), dy.copy(), e(), *stats()[2:], r.copy(), dy.copy()]),
        ("backward_in_place", lambda be, a: be.batchnorm_backward(a[0], None, a[1], mean, inv, a[1], a[2], a[3]),
         [x.copy(), dy.copy(), *stats()[2:]]),
        ("backward_eval", lambda be, a: be.batchnorm_backward_eval(a[0], w, a[1], rm, rv, 1e-5, a[2], a[3], a[4]),
         [x.copy(), dy.copy(), e(), *stats()[2:]]),
    ]


@pytest.mark.bits
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_half_batchnorm_is_the_staged_path_and_stages_nothing(mode, threads, monkeypatch):
    monkeypatch.setattr(lanes, "_threads", [threads])
    for k, name in enumerate(c[0] for c in _calls(np.random.default_rng(0), mode)):
        be, staged_be = CPUBackend(), CPUBackend()
        _, call, got = _calls(np.random.default_rng(0), mode)[k]
        _, _, want = _calls(np.random.default_rng(0), mode)[k]
        with np.errstate(all="ignore"):
            call(be, got)
            with monkeypatch.context() as m:
                m.setattr(half, "_compiled", lambda kernel: False)
                call(staged_be, want)
        assert be.staging.high_water == 0, name
        assert staged_be.staging.high_water > 0, name
        for i, (g, h) in enumerate(zip(got, want)):
            if name == "train_relu_only" and i == 1:
                continue   # y left unwritten (keep_y=False)
            np.testing.assert_array_equal(g.view(np.uint8), h.view(np.uint8), err_msg=f"{name}: array {i}")
