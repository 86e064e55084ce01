"""The compiled batch-norm kernels (minidl/backend/cpu/norm_jit.py) against the numpy passes they replace.

Both implement the same corrected two-pass statistics with the mean subtracted first; they differ only in
rounding (the compiled kernels sum and evaluate in float64, round once), so they agree to a few float32 roundings.
The compiled path must also be deterministic and give recomputation the first forward's output bit for bit, and
the numpy fallback (numba missing) must keep its numerics: both are checked here.
"""
from __future__ import annotations

import numpy as np
import pytest

from minidl.backend.cpu import norm as cpu_norm
from minidl.backend.cpu.backend import CPUBackend

pytest.importorskip("numba")

# planes: 1x1, 8x8 (one lane row), 7x7 (49 lanes), 14x14 (3 rows of 64 and a tail of 4), 32x32 (16 rows)
SHAPES = [(3, 4, 1, 1), (1, 5, 8, 8), (2, 3, 7, 7), (2, 3, 14, 14), (2, 2, 32, 32), (5, 3)]


@pytest.fixture
def numpy_only(monkeypatch):
    """Run the numpy passes (what a machine without numba runs)."""
    monkeypatch.setattr(cpu_norm, "jit_kernels", lambda: None)


def _run_all(x, w, b, dy, seed_stats=None):
    """Every batch-norm phase on the CPU backend: a dict of named outputs."""
    be, c, dt = CPUBackend(), x.shape[1], x.dtype
    out = {"rm": np.full(c, 0.5, dt), "rv": np.full(c, 2.0, dt), "y": np.empty_like(x), "mean": np.empty(c, dt),
           "invstd": np.empty(c, dt)}
    be.batchnorm_forward_train(x, w, b, out["rm"], out["rv"], out["y"], out["mean"], out["invstd"], 0.1, 1e-5)
    out["dx"] = np.empty_like(x)
    out["dw"], out["db"] = np.empty(c, dt), np.empty(c, dt)
    be.batchnorm_backward(x, w, dy, out["mean"], out["invstd"], out["dx"], out["dw"] if w is not None else None,
                          out["db"] if b is not None else None)
    out["y_eval"] = np.empty_like(x)
    be.batchnorm_forward_eval(x, w, b, out["rm"], out["rv"], out["y_eval"], 1e-5)
    out["dx_eval"], out["dw_eval"], out["db_eval"] = np.empty_like(x), np.empty(c, dt), np.empty(c, dt)
    be.batchnorm_backward_eval(x, w, dy, out["rm"], out["rv"], 1e-5, out["dx_eval"], out["dw_eval"], out["db_eval"])
    if w is None:
        for k in ("dw", "db"):
            out.pop(k)
    return out


def _inputs(shape, dtype, affine=True, seed=0):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = (rng.standard_normal(shape) * 3 + 7).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    w = rng.uniform(0.5, 1.5, c).astype(dtype) if affine else None
    b = rng.standard_normal(c).astype(dtype) if affine else None
    return x, w, b, dy


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("affine", [True, False])
def test_compiled_matches_the_numpy_passes(shape, dtype, affine, monkeypatch):
    assert cpu_norm.jit_kernels() is not None
    x, w, b, dy = _inputs(shape, dtype, affine)
    got = _run_all(x, w, b, dy)
    monkeypatch.setattr(cpu_norm, "jit_kernels", lambda: None)
    ref = _run_all(x, w, b, dy)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for k in ref:
        scale = max(1.0, float(np.abs(ref[k]).max()))
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=tol * scale, err_msg=k)


@pytest.mark.parametrize("shape", [(2, 3, 14, 14), (1, 4, 8, 8)])
def test_compiled_is_deterministic_and_recompute_is_bit_identical(shape):
    x, w, b, dy = _inputs(shape, np.float32)
    first, again = _run_all(x, w, b, dy), _run_all(x, w, b, dy)
    assert all(first[k].tobytes() == again[k].tobytes() for k in first)
    y = np.full_like(x, np.nan)
    CPUBackend().batchnorm_forward_apply(x, w, b, first["mean"], first["invstd"], y)  # what recomputation runs
    assert y.tobytes() == first["y"].tobytes()


def test_compiled_without_running_update_and_without_dx():
    x, w, b, dy = _inputs((2, 3, 5, 5), np.float32)
    be, c = CPUBackend(), 3
    rm, rv = np.zeros(c, np.float32), np.ones(c, np.float32)
    y, mean, invstd = np.empty_like(x), np.empty(c, np.float32), np.empty(c, np.float32)
    be.batchnorm_forward_train(x, w, b, rm, rv, y, mean, invstd, 0.1, 1e-5, update_running=False)
    assert (rm == 0).all() and (rv == 1).all()
    dw, db = np.empty(c, np.float32), np.empty(c, np.float32)
    be.batchnorm_backward(x, w, dy, mean, invstd, None, dw, db)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    xhat = (x64 - x64.mean(axis=(0, 2, 3), keepdims=True)) / np.sqrt(x64.var(axis=(0, 2, 3), keepdims=True) + 1e-5)
    np.testing.assert_allclose(db, dy64.sum(axis=(0, 2, 3)), rtol=1e-5)
    np.testing.assert_allclose(dw, (dy64 * xhat).sum(axis=(0, 2, 3)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 3, 1, 1), (4, 3, 5, 5), (2, 4, 16, 16)])
@pytest.mark.parametrize("ratio", [0.0, 1e4])
def test_numpy_fallback_keeps_its_numerics(shape, ratio, numpy_only):
    from tests.layers.test_batchnorm_numerics import test_float32_error_within_twice_torch

    assert cpu_norm.jit_kernels() is None
    test_float32_error_within_twice_torch(shape, ratio)


@pytest.mark.bits
@pytest.mark.parametrize("shape", [(8, 16, 32, 32), (4, 5, 60, 60), (32, 64, 8, 8)])
def test_same_bits_on_any_threads(shape, monkeypatch, lanes):
    """Large enough to split (`cpu.jit.workers_for`), the channels go to the threads, each channel computed as
    on one thread: the same bits with 1, 2, 3 or 5 threads, and `apply` (recomputation) still the forward's y."""
    from minidl.backend.cpu import jit as cpu_jit
    x, w, b, dy = _inputs(shape, np.float32)
    assert x.size >= cpu_jit.PARALLEL_MIN
    results = {}
    for threads in (1, 2, 3, 5):
        lanes(threads)
        results[threads] = _run_all(x, w, b, dy)
        y = np.full_like(x, np.nan)
        CPUBackend().batchnorm_forward_apply(x, w, b, results[1]["mean"], results[1]["invstd"], y)
        assert y.tobytes() == results[1]["y"].tobytes()
    for threads, got in results.items():
        assert all(got[k].tobytes() == results[1][k].tobytes() for k in got), threads


@pytest.mark.parametrize("path", ["compiled", "numpy"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (8, 16, 32, 32), (5, 3)])
def test_relu_out_is_the_relu_of_the_same_y(shape, dtype, path, monkeypatch, lanes):
    """The compiled step's BN+ReLU (`relu_out`): y, the statistics and the running ones exactly as without it,
    and relu_out exactly `relu_forward(y)`, including where y is 0, negative zero or NaN; on 1 and 2 threads."""
    if path == "numpy":
        monkeypatch.setattr(cpu_norm, "jit_kernels", lambda: None)
    x, w, b, _ = _inputs(shape, dtype)
    x = x.copy()
    x[(0, 0) + (0,) * (x.ndim - 2)] = np.nan  # channel 0's statistics, so its y and ReLU, are NaN
    be, c = CPUBackend(), x.shape[1]
    for threads in ("1", "2"):
        lanes(threads)
        outs = []
        for relu in (False, True):
            o = {"rm": np.full(c, 0.5, dtype), "rv": np.full(c, 2.0, dtype), "y": np.full_like(x, 7.0),
                 "mean": np.empty(c, dtype), "invstd": np.empty(c, dtype), "z": np.full_like(x, 7.0)}
            be.batchnorm_forward_train(x, w, b, o["rm"], o["rv"], o["y"], o["mean"], o["invstd"], 0.1, 1e-5,
                                       relu_out=o["z"] if relu else None)
            if not relu:
                be.relu_forward(o["y"], o["z"])
            outs.append(o)
        for k in outs[0]:
            assert outs[0][k].tobytes() == outs[1][k].tobytes(), (threads, k)
        z = outs[1]["z"]
        assert np.isnan(z).any() and (z == 0).any() and not (np.signbit(z) & (z == 0)).any()
        # keep_y=False (nothing reads y): the same statistics and relu_out; y left unwritten where compiled
        o = {"rm": np.full(c, 0.5, dtype), "rv": np.full(c, 2.0, dtype), "y": np.full_like(x, 7.0),
             "mean": np.empty(c, dtype), "invstd": np.empty(c, dtype), "z": np.full_like(x, 7.0)}
        be.batchnorm_forward_train(x, w, b, o["rm"], o["rv"], o["y"], o["mean"], o["invstd"], 0.1, 1e-5,
                                   relu_out=o["z"], keep_y=False)
        for k in o:
            expect = np.full_like(x, 7.0) if k == "y" and path == "compiled" else outs[1][k]
            assert o[k].tobytes() == expect.tobytes(), (threads, k)


@pytest.mark.parametrize("path", ["compiled", "numpy"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (8, 16, 32, 32)])
def test_backward_through_a_relu_is_the_two_backwards(shape, dtype, path, monkeypatch, lanes):
    """The compiled step's BN+ReLU backward (`relu=(r, dr)`): dx, dW, dB exactly those of the batch norm's
    backward from the dy `relu_backward(r, dr, dy)` gives; on 1 and 2 threads; and the gradient
    may be written over the ReLU's gradient or output (the plan may place dx there)."""
    if path == "numpy":
        monkeypatch.setattr(cpu_norm, "jit_kernels", lambda: None)
    x, w, b, dr = _inputs(shape, dtype)
    be, c = CPUBackend(), x.shape[1]
    y, mean, invstd = np.empty_like(x), np.empty(c, dtype), np.empty(c, dtype)
    be.batchnorm_forward_train(x, w, b, np.zeros(c, dtype), np.ones(c, dtype), y, mean, invstd, 0.1, 1e-5)
    r = np.empty_like(y)
    be.relu_forward(y, r)
    for threads in ("1", "2"):
        lanes(threads)
        ref = {"dy": np.full_like(x, 7.0), "dx": np.full_like(x, 7.0), "dw": np.full(c, 7.0, dtype),
               "db": np.full(c, 7.0, dtype)}
        be.relu_backward(r, dr, ref["dy"])
        be.batchnorm_backward(x, w, ref["dy"], mean, invstd, ref["dx"], ref["dw"], ref["db"])
        got = {k: np.full_like(v, 7.0) for k, v in ref.items()}
        be.batchnorm_backward(x, w, got["dy"], mean, invstd, got["dx"], got["dw"], got["db"], relu=(r, dr))
        for k in ("dx", "dw", "db"):
            assert got[k].tobytes() == ref[k].tobytes(), (threads, k)
        # dy: the compiled kernel keeps it in a channel's scratch and leaves dy unwritten (only this batch norm
        # reads it where the compiled step fuses); the numpy path writes it first
        untouched = np.full_like(x, 7.0).tobytes()
        assert got["dy"].tobytes() == (untouched if path == "compiled" else ref["dy"].tobytes())
        for over in ("dr", "r"):  # dx written exactly over the ReLU's gradient or output
            rr, ddr = r.copy(), dr.copy()
            target = ddr if over == "dr" else rr
            dy, dw, db = np.empty_like(x), np.empty(c, dtype), np.empty(c, dtype)
            be.batchnorm_backward(x, w, dy, mean, invstd, target, dw, db, relu=(rr, ddr))
            assert target.tobytes() == ref["dx"].tobytes() and dw.tobytes() == ref["dw"].tobytes(), over
