"""LayerNorm, GELU, per-token Linear, Embedding, PositionEmbedding, Softmax, per-token cross-entropy and causal
self-attention against PyTorch (float32 and float64, forward and backward) and finite differences (float64)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minidl as dl
from minidl import layers as L
from minidl.testing import directional_gradcheck, run_layer
from minidl.testing.torch_twin import causal_attention

RNG = np.random.default_rng(0)
DTYPES = [np.float32, np.float64]


def tol(dtype):
    return dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-12)


def t(a, grad=True):
    return torch.tensor(a, requires_grad=grad)


def close(a, b, dtype):
    np.testing.assert_allclose(a, b.detach().numpy() if torch.is_tensor(b) else b, **tol(dtype))


def randn(shape, dtype, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,affine,bias", [((2, 5, 8), True, True), ((3, 7), True, False),
                                               ((2, 3, 4, 16), False, False), ((1, 1, 1), True, True)])
def test_layernorm_vs_torch(dtype, shape, affine, bias):
    x = randn(shape, dtype, 3) + dtype(2)
    c = shape[-1]
    w, b = randn(c, dtype) + dtype(1), randn(c, dtype)
    dy = randn(shape, dtype)
    params = {"weight": w, **({"bias": b} if bias else {})} if affine else {}
    r = run_layer(L.LayerNorm(elementwise_affine=affine, bias=bias), [x], params, dout=dy)
    tx, tw, tb = t(x), t(w), t(b)
    ty = F.layer_norm(tx, (c,), tw if affine else None, tb if affine and bias else None, 1e-5)
    ty.backward(torch.tensor(dy))
    close(r.out, ty, dtype)
    close(r.dinputs[0], tx.grad, dtype)
    if affine:
        close(r.grads["weight"], tw.grad, dtype)
    if affine and bias:
        close(r.grads["bias"], tb.grad, dtype)
    ev = run_layer(L.LayerNorm(elementwise_affine=affine, bias=bias), [x], params, training=False)
    np.testing.assert_array_equal(ev.out, r.out)  # evaluation computes the same thing, bit for bit


def test_layernorm_recompute_applies_saved_statistics_bit_identically():
    """A recomputed forward (`ctx.recompute`) reads the saved mean and 1/std and writes the very same output."""
    from minidl.backend.cpu.backend import CPUBackend
    from minidl.layers.base import LayerContext

    x = randn((4, 9, 33), np.float32, 5)
    params = {"weight": randn(33, np.float32), "bias": randn(33, np.float32)}
    r = run_layer(L.LayerNorm(), [x], params)
    again = np.empty_like(r.out)
    saved = {k: v.copy() for k, v in r.aux.items()}
    L.LayerNorm().forward(CPUBackend(), [x], again, params, LayerContext(aux=r.aux, recompute=True))
    np.testing.assert_array_equal(again, r.out)
    for k in saved:
        np.testing.assert_array_equal(r.aux[k], saved[k])


@pytest.mark.parametrize("affine", [True, False])
def test_layernorm_numpy_fallback_matches_compiled(affine, monkeypatch):
    """Where numba cannot be imported the numpy passes run: the same values to float32's rounding."""
    from minidl.backend.cpu import seq as cpu_seq

    x = randn((5, 70, 48), np.float32, 3) + np.float32(10)
    dy = randn(x.shape, np.float32)
    params = {"weight": randn(48, np.float32), "bias": randn(48, np.float32)} if affine else {}
    make = lambda: L.LayerNorm(elementwise_affine=affine)  # noqa: E731
    jit = run_layer(make(), [x], params, dout=dy)
    monkeypatch.setattr(cpu_seq, "seq_kernels", lambda: None)
    plain = run_layer(make(), [x], params, dout=dy)
    for a, b in [(plain.out, jit.out), (plain.dinputs[0], jit.dinputs[0])] + [
            (plain.grads[k], jit.grads[k]) for k in params]:
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(2, 5, 8), (3, 70001), (1,)])
def test_gelu_vs_torch(dtype, approximate, shape):
    x = randn(shape, dtype, 3)
    dy = randn(shape, dtype)
    r = run_layer(L.GELU(approximate), [x], dout=dy)
    tx = t(x)
    ty = F.gelu(tx, approximate=approximate)
    ty.backward(torch.tensor(dy))
    close(r.out, ty, dtype)
    close(r.dinputs[0], tx.grad, dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_numpy_fallback_matches_compiled(approximate, monkeypatch):
    """Where numba cannot be imported the numpy twin of exact GELU runs: the same values to a rounding of float64
    (the tanh form is numpy either way)."""
    from minidl.backend.cpu import seq as cpu_seq

    x = randn((3, 50), np.float64, 3)
    dy = randn(x.shape, np.float64)
    jit = run_layer(L.GELU(approximate), [x], dout=dy)
    monkeypatch.setattr(cpu_seq, "seq_kernels", lambda: None)
    plain = run_layer(L.GELU(approximate), [x], dout=dy)
    np.testing.assert_allclose(plain.out, jit.out, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(plain.dinputs[0], jit.dinputs[0], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,out,bias", [((2, 5, 8), 6, True), ((3, 1, 4), 2, False), ((4, 7), 3, True)])
def test_linear_on_the_last_axis_vs_torch(dtype, shape, out, bias):
    x = randn(shape, dtype)
    w, b = randn((out, shape[-1]), dtype), randn(out, dtype)
    dy = randn(shape[:-1] + (out,), dtype)
    params = {"weight": w, **({"bias": b} if bias else {})}
    r = run_layer(L.Linear(out, bias=bias, flatten=False), [x], params, dout=dy)
    assert r.out.shape == shape[:-1] + (out,)
    tx, tw, tb = t(x), t(w), t(b)
    ty = F.linear(tx, tw, tb if bias else None)
    ty.backward(torch.tensor(dy))
    close(r.out, ty, dtype)
    close(r.dinputs[0], tx.grad, dtype)
    close(r.grads["weight"], tw.grad, dtype)
    if bias:
        close(r.grads["bias"], tb.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sa,sb,tb", [((2, 3, 4, 5), (2, 3, 5, 6), False), ((3, 4, 5), (3, 6, 5), True),
                                      ((4, 5), (5, 1), False)])
def test_batched_matmul_vs_torch(dtype, sa, sb, tb):
    a, b = randn(sa, dtype), randn(sb, dtype)
    r0 = run_layer(L.MatMul(transpose_b=tb), [a, b])
    dy = randn(r0.out.shape, dtype)
    r = run_layer(L.MatMul(transpose_b=tb), [a, b], dout=dy)
    ta, tb_ = t(a), t(b)
    ty = torch.matmul(ta, tb_.transpose(-1, -2) if tb else tb_)
    ty.backward(torch.tensor(dy))
    close(r.out, ty, dtype)
    close(r.dinputs[0], ta.grad, dtype)
    close(r.dinputs[1], tb_.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("idx_shape", [(2, 7), (5,), (2, 3, 4)])
def test_embedding_vs_torch_accumulates_repeated_indices(dtype, idx_shape):
    v, c = 6, 5
    idx = RNG.integers(0, v, idx_shape).astype(np.int64)
    idx.reshape(-1)[:3] = 2  # a repeated index: its rows' gradients add up
    w = randn((v, c), dtype)
    dy = randn(idx_shape + (c,), dtype)
    r = run_layer(L.Embedding(v, c), [idx], {"weight": w}, dout=dy, dtype=dtype)  # no float input: say it
    tw = t(w)
    ty = F.embedding(torch.tensor(idx), tw)
    ty.backward(torch.tensor(dy))
    close(r.out, ty, dtype)
    close(r.grads["weight"], tw.grad, dtype)
    assert r.dinputs[0] is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_position_embedding_vs_torch(dtype):
    x = randn((3, 4, 5), dtype)
    w = randn((7, 5), dtype)
    dy = randn(x.shape, dtype)
    r = run_layer(L.PositionEmbedding(7), [x], {"weight": w}, dout=dy)
    tx, tw = t(x), t(w)
    ty = tx + F.embedding(torch.arange(4), tw)
    ty.backward(torch.tensor(dy))
    close(r.out, ty, dtype)
    close(r.dinputs[0], tx.grad, dtype)
    close(r.grads["weight"], tw.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 9), (4, 1), (2, 2, 2, 40000)])
def test_softmax_last_axis_vs_torch(dtype, shape):
    x = randn(shape, dtype, 4)
    dy = randn(shape, dtype)
    r = run_layer(L.Softmax(), [x], dout=dy)
    tx = t(x)
    ty = F.softmax(tx, dim=-1)
    ty.backward(torch.tensor(dy))
    close(r.out, ty, dtype)
    close(r.dinputs[0], tx.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ignore", [None, -100, 3])
def test_per_token_cross_entropy_vs_torch(dtype, ignore):
    b, tt, v = 3, 5, 7
    x = randn((b, tt, v), dtype, 3)
    y = RNG.integers(0, v, (b, tt)).astype(np.int64)
    if ignore is not None:
        y[0, :2] = ignore
        y[2, 4] = ignore
    r = run_layer(L.SoftmaxCrossEntropy(ignore_index=ignore), [x, y], dout=np.array(1.5, dtype))
    tx = t(x)
    loss = F.cross_entropy(tx.reshape(-1, v), torch.tensor(y.reshape(-1)),
                           ignore_index=-100 if ignore is None else ignore)
    (loss * 1.5).backward()
    close(r.out, loss, dtype)
    close(r.dinputs[0], tx.grad, dtype)


def test_cross_entropy_refuses_labels_outside_classes_unless_ignored():
    x = randn((2, 3, 4), np.float32)
    y = np.array([[0, 1, -100], [3, 2, 1]])
    run_layer(L.SoftmaxCrossEntropy(ignore_index=-100), [x, y], dout=np.float32(1))
    with pytest.raises(dl.DataError, match=r"'loss' \(softmax_xent\): labels: label -100 is outside \[0, 4\)"):
        run_layer(L.SoftmaxCrossEntropy(name="loss"), [x, y], dout=np.float32(1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,tt,heads,d", [(2, 5, 2, 3), (1, 1, 1, 4), (2, 9, 3, 2)])
def test_causal_attention_vs_torch(dtype, b, tt, heads, d):
    c = heads * d
    qkv = randn((b, tt, 3 * c), dtype)
    dy = randn((b, tt, c), dtype)
    r = run_layer(L.CausalSelfAttention(heads), [qkv], dout=dy)
    tq = t(qkv)
    ty = causal_attention(tq, heads)
    ty.backward(torch.tensor(dy))
    close(r.out, ty, dtype)
    close(r.dinputs[0], tq.grad, dtype)
    p = r.aux["probs"]
    assert p.shape == (b, heads, tt, tt)
    assert np.all(p[..., np.triu_indices(tt, 1)[0], np.triu_indices(tt, 1)[1]] == 0)  # the causal mask
    ev = run_layer(L.CausalSelfAttention(heads), [qkv], training=False)
    np.testing.assert_array_equal(ev.out, r.out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keep", [True, False])
def test_bidirectional_attention_vs_torch(dtype, keep):
    """BERT's attention: every position attends to every position (no mask), scores kept or rebuilt."""
    qkv = randn((2, 6, 12), dtype)
    dy = randn((2, 6, 4), dtype)
    r = run_layer(L.SelfAttention(2, keep_scores=keep), [qkv], dout=dy)
    tq = t(qkv)
    ty = causal_attention(tq, 2, causal=False)
    ty.backward(torch.tensor(dy))
    close(r.out, ty, dtype)
    close(r.dinputs[0], tq.grad, dtype)
    if keep:
        assert np.all(r.aux["probs"] > 0)  # nothing masked


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_without_kept_scores_gives_the_same_bits(dtype):
    """keep_scores=False keeps no (B, H, T, T) tensor: backward rebuilds the probabilities from q and k, with the
    bits of the saved ones, so output and gradient are bit-identical to the default's."""
    qkv = randn((3, 7, 12), dtype)
    dy = randn((3, 7, 4), dtype)
    kept = run_layer(L.CausalSelfAttention(2), [qkv], dout=dy)
    rebuilt = run_layer(L.CausalSelfAttention(2, keep_scores=False), [qkv], dout=dy)
    assert rebuilt.aux == {}
    np.testing.assert_array_equal(rebuilt.out, kept.out)
    np.testing.assert_array_equal(rebuilt.dinputs[0], kept.dinputs[0])


@pytest.mark.parametrize("keep", [True, False])
def test_attention_asks_for_a_fused_attention_only_where_it_keeps_scores_in_no_plan(keep):
    """A backend may run a fused attention (cuDNN's SDPA in half on CUDA) only for a layer built without kept
    scores: a plan that drops kept scores gets them rebuilt with the kernels' bits, so no policy changes which
    attention runs."""
    calls = []

    class Recorder:
        def attention_forward(self, *args, **kw):
            calls.append(("forward", args[3], kw))

        def attention_backward(self, *args, **kw):
            calls.append(("backward", args[3], kw))

    layer = L.CausalSelfAttention(2, keep_scores=keep)
    qkv, y = np.zeros((1, 3, 12), np.float32), np.zeros((1, 3, 4), np.float32)
    ctx = type("Ctx", (), {"aux": {}})()   # a plan that drops (or never had) the scores
    layer.forward(Recorder(), [qkv], y, {}, ctx)
    layer.backward(Recorder(), [qkv], y, y, [np.zeros_like(qkv)], {}, {}, ctx)
    assert calls == [("forward", None, {"fused": not keep}), ("backward", None, {"fused": not keep})]


def test_gradchecks_float64():
    x = RNG.standard_normal((2, 3, 6)) * 2 + 1
    directional_gradcheck(L.LayerNorm, [x], {"weight": RNG.standard_normal(6), "bias": RNG.standard_normal(6)})
    directional_gradcheck(lambda: L.LayerNorm(elementwise_affine=False), [x], {})
    directional_gradcheck(lambda: L.GELU("none"), [x], {})
    directional_gradcheck(lambda: L.GELU("tanh"), [x], {})
    directional_gradcheck(lambda: L.Linear(4, flatten=False), [x],
                          {"weight": RNG.standard_normal((4, 6)), "bias": RNG.standard_normal(4)})
    directional_gradcheck(L.Softmax, [x], {})
    directional_gradcheck(L.MatMul, [x, RNG.standard_normal((2, 6, 4))], {})
    directional_gradcheck(lambda: L.MatMul(transpose_b=True), [x, RNG.standard_normal((2, 5, 6))], {})
    idx = RNG.integers(0, 5, (2, 3))
    idx[0, 0] = idx[1, 2]
    directional_gradcheck(lambda: L.Embedding(5, 6), [idx], {"weight": RNG.standard_normal((5, 6))},
                          dtype=np.float64)
    directional_gradcheck(lambda: L.PositionEmbedding(4), [x], {"weight": RNG.standard_normal((4, 6))})
    labels = RNG.integers(0, 6, (2, 3))
    labels[1, 1] = -1
    directional_gradcheck(lambda: L.SoftmaxCrossEntropy(ignore_index=-1), [x, labels], {})
    directional_gradcheck(lambda: L.CausalSelfAttention(2), [x], {})
    directional_gradcheck(lambda: L.CausalSelfAttention(2, keep_scores=False), [x], {})
    directional_gradcheck(lambda: L.SelfAttention(2), [x], {})
    directional_gradcheck(lambda: L.SelfAttention(2, keep_scores=False), [x], {})
    directional_gradcheck(lambda: L.Dropout(0.3), [x], {}, rng_key=5)  # any shape


@pytest.mark.parametrize("make,shapes,match", [
    (lambda: L.LayerNorm(name="ln"), [(5,)], r"layer 'ln' \(layernorm\).*\(N, \.\.\., C\)"),
    (lambda: L.PositionEmbedding(4, name="pos"), [(2, 5, 3)], r"layer 'pos' \(pos_embedding\).*max_positions"),
    (lambda: L.PositionEmbedding(4, name="pos"), [(2, 3)], r"layer 'pos' \(pos_embedding\).*\(B, T, C\)"),
    (lambda: L.CausalSelfAttention(2, name="att"), [(2, 3, 9)], r"layer 'att' \(attention\).*multiple of"),
    (lambda: L.CausalSelfAttention(2, name="att"), [(2, 12)], r"layer 'att' \(attention\).*\(B, T, 3C\)"),
    (lambda: L.Linear(3, flatten=False, name="fc"), [(4,)], r"layer 'fc' \(linear\)"),
    (lambda: L.MatMul(name="mm"), [(2, 3, 4), (2, 5, 6)], r"layer 'mm' \(matmul\).*inner sizes differ"),
    (lambda: L.MatMul(name="mm"), [(2, 3, 4), (3, 4, 6)], r"layer 'mm' \(matmul\).*same batch axes"),
])
def test_bad_shapes_raise_graph_error_naming_the_layer(make, shapes, match):
    net = dl.Network()
    xs = [net.input(s) for s in shapes]
    with pytest.raises(dl.GraphError, match=match):
        make()(*xs)


def test_embedding_and_cross_entropy_refuse_wrong_dtypes_and_shapes_at_build():
    net = dl.Network()
    f = net.input((2, 3))
    with pytest.raises(dl.GraphError, match=r"layer 'emb' \(embedding\).*indices must be integers"):
        L.Embedding(5, 4, name="emb")(f)
    logits = net.input((2, 3, 5))
    labels = net.input((2, 4), dtype="int64")
    with pytest.raises(dl.GraphError, match=r"layer 'loss' \(softmax_xent\).*labels must be \(2, 3\)"):
        L.SoftmaxCrossEntropy(name="loss")(logits, labels)


def test_embedding_refuses_indices_outside_the_table():
    with pytest.raises(dl.DataError, match=r"'emb' \(embedding\): indices: index 5 is outside \[0, 5\)"):
        run_layer(L.Embedding(5, 2, name="emb"), [np.array([[0, 5]])], {"weight": np.zeros((5, 2), np.float32)},
                  dtype=np.float32)


@pytest.mark.parametrize("make,arg", [(lambda: L.GELU("exact"), "approximate"), (lambda: L.Embedding(0, 3), "num_"),
                                      (lambda: L.CausalSelfAttention(2.0), "num_heads"),
                                      (lambda: L.Linear(3, flatten="no"), "flatten")])
def test_bad_hyper_parameters_raise_option_error(make, arg):
    with pytest.raises(dl.OptionError, match=arg):
        make()
