"""The compiled sequence-model kernels of the CPU backend (minidl/backend/cpu/seq_jit.py, loss_jit.py,
rowmath_jit.py): layer norm, GELU, the embedding gradient and softmax cross-entropy give the same bits on any
thread count, agree with their numpy twins, keep their scratch small; the float32 exp the loss uses is within
2 ulp of the true value, the float32 tanh the GELU uses within a few ulp of 1.
(Layer-level checks against PyTorch are in tests/layers/test_sequence_layers.py.)"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from minidl.backend.cpu import backend as cpu_backend
from minidl.backend.cpu import jit as cpu_jit
from minidl.backend.cpu import lanes as cpu_lanes
from minidl.backend.cpu.backend import CPUBackend

pytest.importorskip("numba")


def _layernorm(x, w, b, dy):
    be, r, c = CPUBackend(), x.shape[0], x.shape[1]
    out = {"y": np.empty_like(x), "mean": np.empty(r, x.dtype), "rstd": np.empty(r, x.dtype),
           "dx": np.empty_like(x), "dw": np.empty(c, x.dtype), "db": np.empty(c, x.dtype), "apply": np.empty_like(x)}
    be.layernorm_forward(x, w, b, out["y"], out["mean"], out["rstd"], 1e-5)
    be.layernorm_forward_apply(x, w, b, out["mean"], out["rstd"], out["apply"])
    be.layernorm_backward(x, w, dy, out["mean"], out["rstd"], out["dx"], out["dw"], out["db"])
    return out


def _xent(logits, labels, ignore):
    be, dt = CPUBackend(), logits.dtype
    loss, dlogits = np.empty((), dt), np.empty_like(logits)
    if ignore is None:
        be.softmax_xent_forward(logits, labels, loss)
        be.softmax_xent_backward(logits, labels, np.array(1.5, dt), dlogits)
    else:
        be.softmax_xent_ignore_forward(logits, labels, loss, ignore)
        be.softmax_xent_ignore_backward(logits, labels, np.array(1.5, dt), dlogits, ignore)
    return {"loss": loss, "dlogits": dlogits}


def _on_threads(run):
    """run() on 1, 2 and 3 threads (each large enough to split: `cpu.jit.workers_for`): {threads: outputs}."""
    got = {}
    for threads in (1, 2, 3):
        with cpu_lanes.using(threads):
            got[threads] = run()
    return got


def _same_bits(got):
    for threads, out in got.items():
        for k in out:
            assert out[k].tobytes() == got[1][k].tobytes(), (threads, k)


@pytest.mark.bits
@pytest.mark.parametrize("shape", [(512, 768), (600, 131), (129, 1000)])
def test_layernorm_same_bits_on_any_threads(shape, monkeypatch):
    """Rows to the threads for the statistics and dx, columns for the weight and bias sums: each computed by one
    thread in one order, so 1, 2 or 3 threads give the same bits; the recomputing apply gives forward's y."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3 + 5).astype(np.float32)
    w, b = rng.standard_normal(shape[1]).astype(np.float32), rng.standard_normal(shape[1]).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    assert x.size >= cpu_jit.PARALLEL_MIN
    got = _on_threads(lambda: _layernorm(x, w, b, dy))
    _same_bits(got)
    assert got[1]["apply"].tobytes() == got[1]["y"].tobytes()


@pytest.mark.bits
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_embedding_gradient_is_numpy_add_at_bit_for_bit_on_any_threads(dtype, monkeypatch):
    """The compiled gradient sums each table row's deltas in row order from zero, as `np.add.at` does: the same
    bits, on any thread count, with many repeats of some indices and rows never picked (zeros, whatever was
    in the gradient before)."""
    from minidl.backend.cpu import seq_jit

    rng = np.random.default_rng(1)
    v, c, r = 1000, 96, 700
    idx = rng.integers(0, v, r).astype(np.int64)
    idx[::7] = 3  # a token repeated 100 times
    idx[-1] = v - 1  # the last table row (the last thread's range)
    dy = rng.standard_normal((r, c)).astype(dtype)
    expect = np.zeros((v, c), dtype)
    np.add.at(expect, idx, dy)
    assert seq_jit.embedding_backward_parallel is not None  # the compiled twin runs below

    def run():
        dw = np.full((v, c), np.nan, dtype)
        CPUBackend().embedding_backward(idx, dy, dw)
        return {"dw": dw}
    got = _on_threads(run)
    _same_bits(got)
    assert got[1]["dw"].tobytes() == expect.tobytes()


@pytest.mark.bits
@pytest.mark.parametrize("ignore", [None, -100])
def test_cross_entropy_same_bits_on_any_threads(ignore, monkeypatch):
    """Rows to the threads, each row's sums in one thread, the mean over rows summed after them in row order."""
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((96, 5003)) * 4).astype(np.float32)
    labels = rng.integers(0, 5003, 96).astype(np.int64)
    if ignore is not None:
        labels[::5] = ignore
    got = _on_threads(lambda: _xent(logits, labels, ignore))
    _same_bits(got)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ignore", [None, -100])
def test_cross_entropy_compiled_matches_the_numpy_passes(dtype, ignore, monkeypatch):
    """The numpy fallback (numba missing) and the compiled kernels compute the same loss and gradient, to a few
    roundings; with a row whose logits span past float32's exp range (its small probabilities underflow to 0)."""
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((40, 777)) * 5).astype(dtype)
    logits[3, :10] = -200  # exp(-200 - max) is 0 in float32 (subnormal or less)
    labels = rng.integers(0, 777, 40).astype(np.int64)
    if ignore is not None:
        labels[1::4] = ignore
    jit = _xent(logits, labels, ignore)
    monkeypatch.setattr(cpu_backend, "loss_kernels", lambda: None)
    plain = _xent(logits, labels, ignore)
    tol = dict(rtol=2e-6, atol=1e-9) if dtype == np.float32 else dict(rtol=1e-13, atol=1e-16)
    for k in jit:
        np.testing.assert_allclose(jit[k], plain[k], **tol)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_cross_entropy_row_with_nan_or_inf_gives_nan(bad):
    """A NaN or +inf logit makes its row's loss NaN, hence the mean (PyTorch's result), and its gradient NaN:
    what the divergence guard looks for. Other rows' gradients stay finite."""
    logits = np.random.default_rng(4).standard_normal((6, 300)).astype(np.float32)
    logits[2, 17] = bad
    labels = np.arange(6, dtype=np.int64)
    out = _xent(logits, labels, None)
    assert np.isnan(out["loss"])
    assert np.isnan(out["dlogits"][2]).all()
    assert np.isfinite(np.delete(out["dlogits"], 2, axis=0)).all()


def test_cross_entropy_keeps_its_scratch_small():
    """The backend's rule: kernels allocate only a small bounded scratch outside the pool. The loss over a
    (512, 8192) float32 logits tensor (16 MiB) allocates a row or two per thread, not tensor-sized temporaries
    (the numpy passes made two or three)."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((512, 8192)).astype(np.float32)
    labels = rng.integers(0, 8192, 512).astype(np.int64)
    loss, dlogits = np.empty((), np.float32), np.empty_like(logits)
    be = CPUBackend()
    be.softmax_xent_ignore_forward(logits, labels, loss, -100)  # compiled before measuring
    tracemalloc.start()
    try:
        be.softmax_xent_ignore_forward(logits, labels, loss, -100)
        be.softmax_xent_ignore_backward(logits, labels, np.array(1.0, np.float32), dlogits, -100)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < logits.nbytes // 16, peak


def test_exp32_within_two_ulp_and_zero_below_its_range():
    """The loss's float32 exp against float64's exp rounded to float32, on every 97th float32 in [-87.3, 0]
    (~11M values) and at the ends: within 2 ulp; exp(0) = 1 exactly; 0 below the range, for -inf too."""
    from minidl.backend.cpu import loss_jit, rowmath_jit

    lo = np.float32(rowmath_jit._EXP_LO)
    # float32 values in [lo, 0]: negative floats' bit patterns run from -0.0 (0x80000000) up to lo's
    bits = np.arange(np.float32(-0.0).view(np.uint32), lo.view(np.uint32) + 1, 97, dtype=np.uint32)
    a = np.concatenate([bits.view(np.float32), [lo, np.float32(-0.0), np.float32(0.0)]])
    got = np.empty_like(a)
    loss_jit._exp_shifted(a, np.float32(0.0), got)
    want = np.exp(a.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - want) / ulp) <= 2.0
    assert got[-1] == 1.0 and got[-2] == 1.0
    below = np.array([np.nextafter(lo, np.float32(-np.inf)), -100, -1e30, -np.inf], np.float32)
    out = np.empty_like(below)
    loss_jit._exp_shifted(below, np.float32(0.0), out)
    assert (out == 0).all()


@pytest.mark.bits
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_same_bits_on_any_threads(approximate, monkeypatch):
    """Elementwise, cut into one piece per thread: the same bits on 1, 2 or 3 threads."""
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((300, 1001)) * 4).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)

    def run():
        be, y, dx = CPUBackend(), np.empty_like(x), np.empty_like(x)
        be.gelu_forward(x, y, approximate)
        be.gelu_backward(x, dy, dx, approximate)
        return {"y": y, "dx": dx}
    _same_bits(_on_threads(run))


def test_tanh32_within_a_few_ulp_of_one_and_odd():
    """The GELU's float32 tanh against float64's on ~3300 float32s spread over [0, 20] (every 2^18-th) and their
    negatives: within 3 float32 ulps of 1 (the GELU reads 1 + tanh), exactly odd, 0 at 0, +-1 far out."""
    from minidl.backend.cpu import seq_jit

    pos = np.arange(0, np.float32(20).view(np.uint32), 1 << 18, dtype=np.uint32).view(np.float32)
    got = np.array([seq_jit._tanh32(v) for v in pos], np.float32)
    neg = np.array([seq_jit._tanh32(-v) for v in pos], np.float32)
    assert np.max(np.abs(got - np.tanh(pos.astype(np.float64)))) <= 3 * np.spacing(np.float32(1))
    assert (neg == -got).all()
    assert seq_jit._tanh32(np.float32(0)) == 0
    assert seq_jit._tanh32(np.float32(50)) == 1 and seq_jit._tanh32(np.float32(-np.inf)) == -1


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_of_nan_is_nan(approximate):
    """A NaN input stays NaN through forward and backward (the divergence guard looks for it)."""
    x = np.full(70000, np.nan, np.float32)  # large enough for the threaded twin
    x[::2] = 1.0
    y, dx = np.empty_like(x), np.empty_like(x)
    be = CPUBackend()
    be.gelu_forward(x, y, approximate)
    be.gelu_backward(x, np.ones_like(x), dx, approximate)
    assert np.isnan(y[1::2]).all() and np.isnan(dx[1::2]).all()
    assert np.isfinite(y[::2]).all() and np.isfinite(dx[::2]).all()


@pytest.mark.bits
def test_softmax_same_bits_on_any_threads_and_nan_rows(monkeypatch):
    """Rows to the threads, each row's max and sum in one thread: the same bits on 1, 2 or 3 threads; a row
    with a NaN or +inf gets NaNs (numpy's result), the other rows do not."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((700, 130)) * 3).astype(np.float32)
    x[5, 7], x[9, 0] = np.nan, np.inf
    dy = rng.standard_normal(x.shape).astype(np.float32)

    def run():
        be, y, dx = CPUBackend(), np.empty_like(x), np.empty_like(x)
        be.softmax_forward(x, y)
        be.softmax_backward(y, dy, dx)
        return {"y": y, "dx": dx}
    got = _on_threads(run)
    _same_bits(got)
    y = got[1]["y"]
    assert np.isnan(y[[5, 9]]).all() and np.isfinite(np.delete(y, [5, 9], axis=0)).all()


def _digests() -> dict[str, str]:
    """sha256 prefixes of every compiled sequence kernel's outputs on fixed inputs (float32)."""
    import hashlib

    be, rng, f = CPUBackend(), np.random.default_rng(9), np.float32
    x = (rng.standard_normal((300, 200)) * 3 + 1).astype(f)
    w, b = rng.standard_normal(200).astype(f), rng.standard_normal(200).astype(f)
    out = _layernorm(x, w, b, rng.standard_normal(x.shape).astype(f))
    logits = (rng.standard_normal((64, 3001)) * 4).astype(f)
    labels = rng.integers(0, 3001, 64).astype(np.int64)
    labels[::7] = -100
    out.update(_xent(logits, labels, -100))
    g = (rng.standard_normal((100, 999)) * 4).astype(f)
    out["gelu"], out["gelu_dx"] = np.empty_like(g), np.empty_like(g)
    be.gelu_forward(g, out["gelu"], "tanh")
    be.gelu_backward(g, g, out["gelu_dx"], "tanh")
    s = rng.standard_normal((200, 130)).astype(f)
    out["softmax"], out["softmax_dx"] = np.empty_like(s), np.empty_like(s)
    be.softmax_forward(s, out["softmax"])
    be.softmax_backward(out["softmax"], s, out["softmax_dx"])
    return {k: hashlib.sha256(v.tobytes()).hexdigest()[:16] for k, v in out.items()}


@pytest.mark.slow
@pytest.mark.skipif(__import__("platform").machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")
def test_same_bits_when_compiled_for_a_generic_x86_64_cpu():
    """The kernels' sums run in orders fixed by the shapes, their exp and tanh in plain IEEE operations, nothing
    fastmath: so numba's code for a generic x86-64 CPU (no AVX, no FMA; compiled in a cache folder of its own)
    gives the bits of the code for this one. ~1 min: numba compiles the kernels for that CPU."""
    from tests.backend.generic_cpu import digests_on_generic_cpu

    assert digests_on_generic_cpu("tests.backend.test_cpu_seq_jit") == _digests()


@pytest.mark.bits
@pytest.mark.parametrize("keep", [True, False])
def test_attention_same_bits_on_any_lanes(keep, monkeypatch):
    """The samples go to the lanes, each running the numpy calls one lane would: the same bits on 1, 2 or 3
    lanes (3 lanes: shares of 2, 2 and 1 of the 5 samples), with the scores kept or rebuilt in backward."""
    rng = np.random.default_rng(7)
    b, h, t, d = 5, 3, 33, 8
    q, k, v, dy = (rng.standard_normal((b, h, t, d)).astype(np.float32) for _ in range(4))

    def run():
        be = CPUBackend()
        probs = np.empty((b, h, t, t), np.float32) if keep else None
        out = {"y": np.empty_like(q), "dq": np.empty_like(q), "dk": np.empty_like(q), "dv": np.empty_like(q)}
        with be.step_scope():
            be.attention_forward(q, k, v, probs, out["y"], 0.3, True)
            be.attention_backward(q, k, v, probs, dy, out["dq"], out["dk"], out["dv"], 0.3, True)
        return out
    _same_bits(_on_threads(run))
