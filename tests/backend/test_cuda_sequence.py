"""The CUDA backend's sequence family (backend/cuda/sequence.py, kernels/seq.cu, the ignore-index loss of
kernels/loss.cu) against the CPU backend, op by op, on random data.

Two backends run the same checks:
  * "emulated" (always): the CUDA backend's own methods on numpy arrays, each kernel launch executed by a numpy
    twin of the kernel (`KERNEL_TWINS`, written from the .cu source: the same arguments, read as flat memory
    through the packed sizes, the same order of operations). It checks what runs without a GPU: the dispatch,
    which kernel gets which pointer and size, the scratch, the products' operands and their transposes, and
    the kernels' algorithms; not the CUDA C itself (tests/backend/test_kernels.py compiles it with nvcc and
    checks its signatures);
  * "cuda" (marked `gpu`): the real backend on a device, the numerics of the CUDA C.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.cuda import cudnn_specs, launches
from minidl.backend.cuda import kernel_specs as ks
from minidl.backend.cuda.backend import CUDABackend, CudnnGraphs

from .test_cuda_host import LIMITS, FakeCudnn, _HostSide, _NullStream

# ---------------------------------------------------------------------------------------------------------
# numpy twins of the kernels, by name: each takes the packed launch arguments (pointers as numpy arrays)
# ---------------------------------------------------------------------------------------------------------

_f32 = np.float32


def _flat(a):
    return None if a is None else a.reshape(-1)


def _ln_fwd(y, mean, rstd, x, w, b, R, C, eps):
    xs = _flat(x).reshape(R, C)
    m = xs.mean(axis=1, dtype=_f32)
    d = xs - m[:, None]
    r = _f32(1) / np.sqrt((d * d).mean(axis=1, dtype=_f32) + _f32(eps))
    _flat(mean)[:], _flat(rstd)[:] = m, r
    _ln_apply(y, x, w, b, mean, rstd, R, C)


def _ln_apply(y, x, w, b, mean, rstd, R, C):
    v = (_flat(x).reshape(R, C) - _flat(mean)[:, None]) * _flat(rstd)[:, None]
    if w is not None:
        v = v * _flat(w)
    if b is not None:
        v = v + _flat(b)
    _flat(y)[:] = v.reshape(-1)


def _xhat(x, mean, rstd, R, C):
    return (_flat(x).reshape(R, C) - _flat(mean)[:, None]) * _flat(rstd)[:, None]


def _ln_dx(dx, x, w, dy, mean, rstd, R, C):
    g = _flat(dy).reshape(R, C) * (_flat(w) if w is not None else _f32(1))
    xh = _xhat(x, mean, rstd, R, C)
    c1, c2 = g.mean(axis=1, dtype=_f32), (g * xh).mean(axis=1, dtype=_f32)
    _flat(dx)[:] = (_flat(rstd)[:, None] * (g - c1[:, None] - xh * c2[:, None])).reshape(-1)


def _ln_partials(pw, pb, x, dy, mean, rstd, R, C, chunk):
    g, xh = _flat(dy).reshape(R, C).astype(np.float64), _xhat(x, mean, rstd, R, C)
    gx = (_flat(dy).reshape(R, C) * xh).astype(np.float64)
    for k, s in enumerate(range(0, R, chunk)):
        pw.reshape(-1, C)[k] = gx[s:s + chunk].sum(axis=0)
        pb.reshape(-1, C)[k] = g[s:s + chunk].sum(axis=0)


def _ln_params(dw, db, pw, pb, nchunks, C):
    if dw is not None:
        _flat(dw)[:] = pw.reshape(-1, C)[:nchunks].sum(axis=0)
    if db is not None:
        _flat(db)[:] = pb.reshape(-1, C)[:nchunks].sum(axis=0)


def _erf(a):
    return np.vectorize(math.erf, otypes=[np.float64])(a)


def _gelu_fwd(y, x, n, exact):
    a = _flat(x).astype(np.float64)
    if exact:
        v = 0.5 * a * (1 + _erf(a / math.sqrt(2)))
    else:
        v = 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * a * (1 + 0.044715 * a * a)))
    _flat(y)[:] = v


def _gelu_bwd(dx, x, dy, n, exact):
    a = _flat(x).astype(np.float64)
    if exact:
        slope = 0.5 * (1 + _erf(a / math.sqrt(2))) + a * np.exp(-0.5 * a * a) / math.sqrt(2 * math.pi)
    else:
        k = math.sqrt(2 / math.pi)
        t = np.tanh(k * a * (1 + 0.044715 * a * a))
        slope = 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * k * (1 + 3 * 0.044715 * a * a)
    _flat(dx)[:] = _flat(dy) * slope


def _softmax_fwd(y, x, R, C, scale, causal_t):
    s = _flat(x).reshape(R, C) * _f32(scale)
    if causal_t:
        keys = np.arange(C)[None, :]
        s = np.where(keys <= (np.arange(R) % causal_t)[:, None], s, -np.inf)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    _flat(y)[:] = (e / e.sum(axis=1, keepdims=True)).reshape(-1)


def _softmax_bwd(dx, y, dy, R, C, scale):
    ys, dys = _flat(y).reshape(R, C), _flat(dy).reshape(R, C)
    dot = np.sum(dys * ys, axis=1, keepdims=True, dtype=_f32)
    _flat(dx)[:] = (_f32(scale) * (ys * (dys - dot))).reshape(-1)


def _emb_fwd(y, w, idx, R, C, V):
    _flat(y)[:] = w.reshape(V, C)[_flat(idx)].reshape(-1)


def _emb_bwd(dw, dy, idx, R, C, V, groups):
    table, rows, ids = dw.reshape(V, C), _flat(dy).reshape(R, C), _flat(idx)
    for g in range(groups):          # thread (g, j) owns table rows [g V / groups, (g + 1) V / groups)
        lo, hi = g * V // groups, (g + 1) * V // groups
        for r in np.flatnonzero((ids >= lo) & (ids < hi)):
            table[ids[r]] += rows[r]


def _pos_fwd(y, x, w, B, TC):
    _flat(y)[:] = (_flat(x).reshape(B, TC) + _flat(w)[:TC]).reshape(-1)


def _pos_bwd(dw, dy, B, TC):
    s = np.zeros(TC, _f32)
    for row in _flat(dy).reshape(B, TC):      # batch order, in float32
        s += row
    _flat(dw)[:TC] = s


def _xent_rows(logits, labels, N, K):
    z = _flat(logits).reshape(N, K)
    z = z - z.max(axis=1, keepdims=True)
    return z, np.log(np.exp(z).sum(axis=1))


def _xent_ignore_fwd(loss, logits, labels, N, K, ignore):
    z, lse = _xent_rows(logits, labels, N, K)
    lab = _flat(labels)
    keep = lab != ignore
    _flat(loss)[:N] = np.where(keep, lse - z[np.arange(N), np.where(keep, lab, 0)], 0)


def _kept(labels, N, ignore):
    return _f32(np.count_nonzero(_flat(labels)[:N] != ignore))


def _xent_ignore_mean(out, loss, labels, N, ignore):
    with np.errstate(invalid="ignore", divide="ignore"):
        _flat(out)[0] = np.sum(_flat(loss)[:N], dtype=_f32) / _kept(labels, N, ignore)


def _xent_ignore_scale(scale, dloss, labels, N, ignore):
    with np.errstate(invalid="ignore", divide="ignore"):
        _flat(scale)[0] = _flat(dloss)[0] / _kept(labels, N, ignore)


def _xent_ignore_bwd(dlogits, logits, labels, scale, N, K, ignore):
    z, lse = _xent_rows(logits, labels, N, K)
    p = np.exp(z - lse[:, None])
    lab = _flat(labels)
    keep = lab != ignore
    p[np.flatnonzero(keep), lab[keep]] -= 1
    p[~keep] = 0
    _flat(dlogits)[:] = (p * _flat(scale)[0]).reshape(-1)


KERNEL_TWINS = {
    "layernorm_forward": _ln_fwd, "layernorm_forward_apply": _ln_apply, "layernorm_backward_dx": _ln_dx,
    "layernorm_backward_partials": _ln_partials, "layernorm_backward_params": _ln_params,
    "gelu_forward": _gelu_fwd, "gelu_backward": _gelu_bwd, "softmax_forward": _softmax_fwd,
    "softmax_backward": _softmax_bwd, "embedding_forward": _emb_fwd, "embedding_backward": _emb_bwd,
    "position_embedding_forward": _pos_fwd, "position_embedding_backward": _pos_bwd,
    "softmax_xent_ignore_forward": _xent_ignore_fwd, "softmax_xent_ignore_mean": _xent_ignore_mean,
    "softmax_xent_ignore_scale": _xent_ignore_scale, "softmax_xent_ignore_backward": _xent_ignore_bwd,
}


def _unpack(launch):
    """The launch's arguments as the twin takes them: numpy scalars as Python numbers."""
    return [a.item() if isinstance(a, np.generic) else a for a in launch.args]


class EmulatedSequenceCUDA(CUDABackend):
    """The CUDA backend with numpy arrays as device arrays; each launch runs its kernel's numpy twin."""

    def _launch(self, launch):
        self.launches.append(launch)
        KERNEL_TWINS[launch.name](*_unpack(launch))


def _emulated_backend() -> EmulatedSequenceCUDA:
    cp_ns = SimpleNamespace(ndarray=np.ndarray, add=np.add, multiply=np.multiply, copyto=np.copyto,
                            matmul=np.matmul, sum=np.sum)
    fake = FakeCudnn()
    be = EmulatedSequenceCUDA.from_parts(cupy=cp_ns, cupyx=None, cudnn=fake, cublas=None, compute=_NullStream(),
                                         transfer=_NullStream(), graphs=CudnnGraphs(fake, handle=5),
                                         side=_HostSide(), limits=LIMITS, filters=cudnn_specs.EngineFilters())
    be.launches = []
    return be


class _Device:
    """Calls a backend on numpy arguments: the emulated one directly, a device one through copies (the
    conformance tests' `OnDevice`)."""

    def __init__(self, be, wrap=None):
        self.be, self.call = be, (wrap or be)


@pytest.fixture(scope="module", params=["emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
def cuda(request):
    if request.param == "emulated":
        be = _emulated_backend()
        yield _Device(be)
        return
    from .test_conformance import OnDevice, _cuda_backend_or_skip

    be = _cuda_backend_or_skip()
    yield _Device(be, OnDevice(be))


def test_every_sequence_kernel_has_a_twin():
    assert set(KERNEL_TWINS) == {s.name for s in ks.kernels_in_file("seq.cu") if not s.half} | {
        n for n, s in ks.KERNELS.items() if n.startswith("softmax_xent_ignore") and not s.half}


# ---------------------------------------------------------------------------------------------------------
# The ops against the CPU backend
# ---------------------------------------------------------------------------------------------------------

CPU = CPUBackend()
RTOL = 2e-5


def _rng(seed=0):
    return np.random.default_rng(seed)


def _randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _both(fn_name, make_args, cuda, outputs, rtol=RTOL, atol=1e-6):
    """Run `fn_name` on the CPU backend and on `cuda` with the same inputs (fresh copies each); compare the
    arguments at `outputs` (positions)."""
    ref_args, got_args = make_args(), make_args()
    getattr(CPU, fn_name)(*ref_args)
    getattr(cuda.call, fn_name)(*got_args)
    for i in outputs:
        if ref_args[i] is None:
            continue
        np.testing.assert_allclose(got_args[i], ref_args[i], rtol=rtol, atol=atol, err_msg=f"{fn_name} arg {i}")
    return ref_args, got_args


@pytest.mark.parametrize("affine", [True, False])
def test_layernorm(cuda, affine):
    rng = _rng(1)
    r, c = 2100, 48   # more rows than LN_CHUNKS chunks of LN_MIN_CHUNK: the sums run in several chunks
    x, w, b = _randn(rng, r, c, scale=3.0) + 1.5, _randn(rng, c), _randn(rng, c)
    dy = _randn(rng, r, c)

    def fwd():
        return [x.copy(), w.copy() if affine else None, b.copy() if affine else None, np.zeros((r, c), _f32),
                np.zeros(r, _f32), np.zeros(r, _f32), 1e-5]

    ref, got = _both("layernorm_forward", fwd, cuda, outputs=(3, 4, 5), rtol=1e-4, atol=1e-5)
    mean, rstd = ref[4], ref[5]

    def apply():
        return [x.copy(), w.copy() if affine else None, b.copy() if affine else None, mean.copy(), rstd.copy(),
                np.zeros((r, c), _f32)]

    _both("layernorm_forward_apply", apply, cuda, outputs=(5,), rtol=1e-4, atol=1e-5)
    again = np.zeros((r, c), _f32)   # from the backend's own statistics: the bits its forward gave
    cuda.call.layernorm_forward_apply(x.copy(), *(got[1:3]), got[4], got[5], again)
    np.testing.assert_array_equal(again, got[3])

    def evaluation():
        return [x.copy(), w.copy() if affine else None, b.copy() if affine else None, np.zeros((r, c), _f32),
                None, None, 1e-5]

    _both("layernorm_forward", evaluation, cuda, outputs=(3,), rtol=1e-4, atol=1e-5)

    def bwd():
        return [x.copy(), w.copy() if affine else None, dy.copy(), mean.copy(), rstd.copy(), np.zeros((r, c), _f32),
                np.zeros(c, _f32) if affine else None, np.zeros(c, _f32) if affine else None]

    _both("layernorm_backward", bwd, cuda, outputs=(5, 6, 7), rtol=1e-4, atol=1e-4)

    def params_only():
        return [x.copy(), w.copy() if affine else None, dy.copy(), mean.copy(), rstd.copy(), None,
                np.zeros(c, _f32) if affine else None, np.zeros(c, _f32) if affine else None]

    _both("layernorm_backward", params_only, cuda, outputs=(6, 7), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(cuda, approximate):
    rng = _rng(2)
    x, dy = _randn(rng, 3, 5, 67, scale=3.0), _randn(rng, 3, 5, 67)
    _both("gelu_forward", lambda: [x.copy(), np.zeros_like(x), approximate], cuda, outputs=(1,), rtol=1e-5)
    _both("gelu_backward", lambda: [x.copy(), dy.copy(), np.zeros_like(x), approximate], cuda, outputs=(2,),
          rtol=1e-5, atol=1e-5)


def test_gelu_refuses_an_unknown_form():
    with pytest.raises(ValueError, match="approximate"):
        launches.gelu_forward(np.zeros(3, _f32), np.zeros(3, _f32), "erf")


def test_softmax(cuda):
    rng = _rng(3)
    x, dy = _randn(rng, 29, 131, scale=4.0), _randn(rng, 29, 131)
    ref, _ = _both("softmax_forward", lambda: [x.copy(), np.zeros_like(x)], cuda, outputs=(1,))
    y = ref[1]
    _both("softmax_backward", lambda: [y.copy(), dy.copy(), np.zeros_like(x)], cuda, outputs=(2,))


def test_embedding(cuda):
    rng = _rng(4)
    v, c = 11, 6
    idx = rng.integers(0, v, size=(3, 9)).astype(np.int64)   # repeated indices: the gradient accumulates
    w, dy = _randn(rng, v, c), _randn(rng, 27, c)
    _both("embedding_forward", lambda: [idx.reshape(-1).copy(), w.copy(), np.zeros((27, c), _f32)], cuda,
          outputs=(2,), rtol=0, atol=0)
    _both("embedding_backward", lambda: [idx.reshape(-1).copy(), dy.copy(), np.full((v, c), np.nan, _f32)], cuda,
          outputs=(2,), rtol=1e-6)


def test_position_embedding(cuda):
    rng = _rng(5)
    x, w, dy = _randn(rng, 3, 7, 5), _randn(rng, 10, 5), _randn(rng, 3, 7, 5)
    _both("position_embedding_forward", lambda: [x.copy(), w.copy(), np.zeros_like(x)], cuda, outputs=(2,))
    _both("position_embedding_backward", lambda: [dy.copy(), np.zeros_like(dy), np.full((10, 5), np.nan, _f32)],
          cuda, outputs=(1, 2), rtol=1e-6)


@pytest.mark.parametrize("transpose_b", [False, True])
def test_matmul(cuda, transpose_b):
    rng = _rng(6)
    a, dy = _randn(rng, 2, 3, 5, 4), _randn(rng, 2, 3, 5, 6)
    b_store = _randn(rng, 2, 3, 6, 4) if transpose_b else _randn(rng, 2, 3, 4, 6)

    def view(m):
        return m.swapaxes(-1, -2) if transpose_b else m

    _both("matmul_forward", lambda: [a.copy(), view(b_store.copy()), np.zeros((2, 3, 5, 6), _f32)], cuda,
          outputs=(2,), rtol=1e-5, atol=1e-5)

    def bwd():
        return [a.copy(), view(b_store.copy()), dy.copy(), np.zeros_like(a), view(np.zeros_like(b_store))]

    ref, got = _both("matmul_backward", bwd, cuda, outputs=(3, 4), rtol=1e-5, atol=1e-5)
    assert np.abs(ref[4]).max() > 0  # the transposed gradient was written through its view


def _qkv(rng, b, t, h, d):
    """q, k, v as the attention layer hands them: (B, H, T, D) views of one (B, T, 3 H D) tensor."""
    qkv = _randn(rng, b, t, 3 * h * d)
    c = h * d
    return qkv, [qkv[:, :, i * c:(i + 1) * c].reshape(b, t, h, d).transpose(0, 2, 1, 3) for i in range(3)]


def _heads(a, h):
    b, t, c = a.shape
    return a.reshape(b, t, h, c // h).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("keep", [True, False])
def test_attention(cuda, causal, keep):
    rng = _rng(7)
    b, t, h, d = 2, 9, 3, 4
    qkv, _ = _qkv(rng, b, t, h, d)
    dy = _randn(rng, b, t, h * d)
    scale = 1 / math.sqrt(d)

    def split(a):
        c = h * d
        return [_heads(a[:, :, i * c:(i + 1) * c], h) for i in range(3)]

    def fwd():
        q, k, v = split(qkv.copy())
        return [q, k, v, np.zeros((b, h, t, t), _f32) if keep else None, _heads(np.zeros((b, t, h * d), _f32), h),
                scale, causal]

    ref, got = _both("attention_forward", fwd, cuda, outputs=(3, 4), rtol=1e-5, atol=1e-5)
    if keep and causal:
        assert np.all(got[3][..., np.triu_indices(t, 1)[0], np.triu_indices(t, 1)[1]] == 0)  # masked: exactly 0
    probs = ref[3]

    def bwd():
        q, k, v = split(qkv.copy())
        dq, dk, dv = split(np.zeros_like(qkv))
        return [q, k, v, probs.copy() if keep else None, _heads(dy.copy(), h), dq, dk, dv, scale, causal]

    _both("attention_backward", bwd, cuda, outputs=(5, 6, 7), rtol=1e-4, atol=1e-5)


def test_attention_rebuilt_scores_give_the_saved_bits(cuda):
    """Backward from P rebuilt in scratch and from P saved by forward: the same gradients, bit for bit (the
    same products on the same shapes, the same softmax), so a policy that drops the scores changes nothing."""
    rng = _rng(8)
    b, t, h, d = 2, 8, 2, 4
    qkv, _ = _qkv(rng, b, t, h, d)
    dy = _randn(rng, b, t, h * d)
    c = h * d

    def split(a):
        return [_heads(a[:, :, i * c:(i + 1) * c], h) for i in range(3)]

    q, k, v = split(qkv)
    probs, y = np.zeros((b, h, t, t), _f32), np.zeros((b, t, c), _f32)
    cuda.call.attention_forward(q, k, v, probs, _heads(y, h), 0.5, True)
    grads = []
    for p in (probs, None):
        g = np.zeros_like(qkv)
        cuda.call.attention_backward(q, k, v, p, _heads(dy, h), *split(g), 0.5, True)
        grads.append(g)
    np.testing.assert_array_equal(grads[0], grads[1])


@pytest.mark.parametrize("ignored", ["some", "all", "none"])
def test_cross_entropy_with_ignore_index(cuda, ignored):
    rng = _rng(9)
    n, k = 23, 17
    logits = _randn(rng, n, k, scale=2.0)
    labels = rng.integers(0, k, size=n).astype(np.int64)
    if ignored == "some":
        labels[::3] = -100
    elif ignored == "all":
        labels[:] = -100
    dloss = np.array(1.7, _f32)
    with np.errstate(invalid="ignore", divide="ignore"):
        ref, got = _both("softmax_xent_ignore_forward",
                         lambda: [logits.copy(), labels.copy(), np.zeros((), _f32), -100], cuda, outputs=())
        _both("softmax_xent_ignore_backward",
              lambda: [logits.copy(), labels.copy(), dloss.copy(), np.full((n, k), 5.0, _f32), -100], cuda,
              outputs=() if ignored == "all" else (3,), rtol=1e-5, atol=1e-6)
    if ignored == "all":
        assert np.isnan(got[2]) and np.isnan(ref[2])     # 0 / 0, as PyTorch's mean over no token
    else:
        np.testing.assert_allclose(got[2], ref[2], rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Dispatch details the comparisons do not show
# ---------------------------------------------------------------------------------------------------------

def test_embedding_backward_zeroes_the_table_before_adding():
    be = _emulated_backend()
    dw = np.full((4, 2), np.nan, _f32)
    be.embedding_backward(np.array([1, 1], np.int64), np.ones((2, 2), _f32), dw)
    np.testing.assert_array_equal(dw, [[0, 0], [2, 2], [0, 0], [0, 0]])
    assert [launch.name for launch in be.launches] == ["embedding_backward"]


def test_index_dtypes_and_strides_are_checked():
    be = _emulated_backend()
    with pytest.raises(TypeError, match="int64"):
        be.embedding_forward(np.zeros(3, np.int32), np.zeros((4, 2), _f32), np.zeros((3, 2), _f32))
    with pytest.raises(ValueError, match="C-contiguous"):
        be.gelu_forward(np.zeros((4, 4), _f32)[:, ::2], np.zeros((4, 2), _f32), "tanh")
    with pytest.raises(TypeError, match="float32"):
        be.matmul_forward(np.zeros((2, 2)), np.zeros((2, 2), _f32), np.zeros((2, 2), _f32))


def test_attention_scratch_is_one_sample():
    """Without saved scores, forward's scratch is one sample's (H, T, T), not the batch's."""
    be = _emulated_backend()
    rng = _rng(10)
    qkv, (q, k, v) = _qkv(rng, 3, 5, 2, 4)
    be.attention_forward(q, k, v, None, _heads(np.zeros((3, 5, 8), _f32), 2), 0.5, True)
    assert be.side.bufs["attn_probs"].shape == (2, 5, 5)
    assert [launch.name for launch in be.launches] == ["softmax_forward"] * 3
    assert all(int(launch.args[-1]) == 5 for launch in be.launches)   # the causal mask over T keys


def test_attention_products_read_and_write_plain_matrices():
    """Every product attention hands cuBLAS has a C-contiguous output and operands that are C-contiguous or the
    transpose of a C-contiguous array (what cuBLAS takes with a transpose flag): the strided heads are staged in
    side buffers, so cupy has nothing to copy outside the arena (a captured step refuses such an allocation)."""
    be = _emulated_backend()
    calls = []

    def matmul(a, b, out):
        calls.append((a, b, out))
        return np.matmul(a, b, out=out)

    be.cp.matmul = matmul

    def plain(m):
        return m.flags.c_contiguous or m.swapaxes(-1, -2).flags.c_contiguous

    rng = _rng(11)
    qkv, (q, k, v) = _qkv(rng, 2, 6, 2, 4)
    dqkv = np.zeros_like(qkv)
    dq, dk, dv = (_heads(dqkv[:, :, i * 8:(i + 1) * 8], 2) for i in range(3))
    y, dy = np.zeros((2, 6, 8), _f32), _randn(rng, 2, 6, 8)
    for probs in (np.zeros((2, 2, 6, 6), _f32), None):
        be.attention_forward(q, k, v, probs, _heads(y, 2), 0.5, True)
        be.attention_backward(q, k, v, probs, _heads(dy, 2), dq, dk, dv, 0.5, True)
    assert calls and all(out.flags.c_contiguous and plain(a) and plain(b) for a, b, out in calls)


@pytest.mark.parametrize("c, v", [(6, 11), (768, 50257), (1600, 50257), (70000, 5), (1, 1)])
def test_the_work_splits_cover_every_value_once(c, v):
    groups = launches.embedding_groups(c, v)
    owned = np.concatenate([np.arange(g * v // groups, (g + 1) * v // groups) for g in range(groups)])
    np.testing.assert_array_equal(owned, np.arange(v))          # each table row: one owner, none left out
    assert groups * c >= min(launches.EMBEDDING_THREADS, v * c) or groups == v
    for rows in (1, 31, 32, 33, 2048, 65536, 10**6):
        chunk, n = launches.layernorm_chunks(rows)
        assert (n - 1) * chunk < rows <= n * chunk and n <= launches.LN_CHUNKS
