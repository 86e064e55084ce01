"""ReLU, Linear, Flatten, Add, Concat, Dropout, SoftmaxCrossEntropy against PyTorch and finite differences."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minidl import layers as L
from minidl.backend.common import dropout_keep_mask
from minidl.testing import directional_gradcheck, run_layer

RNG = np.random.default_rng(0)


def t(a, grad=True):
    return torch.tensor(a, requires_grad=grad)


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(a, b.detach().numpy() if torch.is_tensor(b) else b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (4, 17), (1, 1, 1, 1)])
def test_relu(shape):
    x = RNG.standard_normal(shape).astype(np.float32)
    dy = RNG.standard_normal(shape).astype(np.float32)
    r = run_layer(L.ReLU(), [x], dout=dy)
    tx = t(x)
    ty = F.relu(tx)
    ty.backward(torch.tensor(dy))
    close(r.out, ty)
    close(r.dinputs[0], tx.grad)


@pytest.mark.parametrize("shape,out,bias", [((3, 10), 4, True), ((2, 3, 4, 5), 7, False), ((1, 1), 1, True)])
def test_linear(shape, out, bias):
    x = RNG.standard_normal(shape).astype(np.float32)
    fin = int(np.prod(shape[1:]))
    w = RNG.standard_normal((out, fin)).astype(np.float32)
    b = RNG.standard_normal(out).astype(np.float32)
    dy = RNG.standard_normal((shape[0], out)).astype(np.float32)
    params = {"weight": w, **({"bias": b} if bias else {})}
    r = run_layer(L.Linear(out, bias=bias), [x], params, dout=dy)
    tx, tw, tb = t(x), t(w), t(b)
    ty = F.linear(tx.reshape(shape[0], -1), tw, tb if bias else None)
    ty.backward(torch.tensor(dy))
    close(r.out, ty, 1e-5, 1e-5)
    close(r.dinputs[0], tx.grad, 1e-5, 1e-5)
    close(r.grads["weight"], tw.grad, 1e-5, 1e-5)
    if bias:
        close(r.grads["bias"], tb.grad, 1e-5, 1e-5)


def test_flatten_add_concat():
    a = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    b = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    c = RNG.standard_normal((2, 1, 4, 5)).astype(np.float32)
    r = run_layer(L.Flatten(), [a], dout=np.ones((2, 60), np.float32))
    close(r.out, a.reshape(2, 60))
    close(r.dinputs[0], np.ones_like(a))
    dy = RNG.standard_normal(a.shape).astype(np.float32)
    r = run_layer(L.Add(), [a, b, a], dout=dy)
    close(r.out, a + b + a)
    for d in r.dinputs:
        close(d, dy)
    dy = RNG.standard_normal((2, 7, 4, 5)).astype(np.float32)
    r = run_layer(L.Concat(), [a, c, b], dout=dy)
    close(r.out, torch.cat([torch.tensor(a), torch.tensor(c), torch.tensor(b)], 1))
    close(r.dinputs[0], dy[:, :3])
    close(r.dinputs[1], dy[:, 3:4])
    close(r.dinputs[2], dy[:, 4:])


@pytest.mark.parametrize("n,k", [(4, 10), (1, 3), (7, 1000)])
def test_softmax_cross_entropy(n, k):
    x = (RNG.standard_normal((n, k)) * 3).astype(np.float32)
    y = RNG.integers(0, k, n).astype(np.int64)
    r = run_layer(L.SoftmaxCrossEntropy(), [x, y], dout=np.array(1.0, np.float32))
    tx = t(x)
    loss = F.cross_entropy(tx, torch.tensor(y))
    loss.backward()
    close(r.out, loss, 1e-5, 1e-6)
    close(r.dinputs[0], tx.grad, 1e-5, 1e-7)
    assert r.dinputs[1] is None


def test_dropout_replays_mask_and_scales():
    x = RNG.standard_normal((3, 4, 5, 6)).astype(np.float32)
    dy = RNG.standard_normal(x.shape).astype(np.float32)
    r = run_layer(L.Dropout(0.3), [x], dout=dy, rng_key=1234)
    keep = dropout_keep_mask(1234, x.size, 0.3).reshape(x.shape)
    scale = np.float32(1 / 0.7)
    np.testing.assert_array_equal(r.out, x * (keep * scale))
    np.testing.assert_array_equal(r.dinputs[0], dy * (keep * scale))
    again = run_layer(L.Dropout(0.3), [x], rng_key=1234)
    np.testing.assert_array_equal(again.out, r.out)
    other = run_layer(L.Dropout(0.3), [x], rng_key=1235)
    assert not np.array_equal(other.out, r.out)
    assert 0.6 < keep.mean() < 0.8
    ev = run_layer(L.Dropout(0.3), [x], training=False)
    np.testing.assert_array_equal(ev.out, x)


@pytest.mark.parametrize("p", [0.0, 0.3, 0.9])
def test_dropout_in_evaluation_is_the_identity_both_ways(p):
    """PyTorch's F.dropout(training=False) is the identity, forward and backward: so is ours (backward must not
    apply the training mask and scale)."""
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    dy = RNG.standard_normal(x.shape).astype(np.float32)
    r = run_layer(L.Dropout(p), [x], dout=dy, training=False, rng_key=99)
    tx = torch.tensor(x, requires_grad=True)
    ty = F.dropout(tx, p, training=False)
    ty.backward(torch.tensor(dy))
    np.testing.assert_array_equal(r.out, ty.detach().numpy())
    np.testing.assert_array_equal(r.dinputs[0], tx.grad.numpy())


def test_gradchecks_float64():
    x = RNG.standard_normal((3, 2, 3, 3))
    x[np.abs(x) < 1e-2] = 0.5  # keep away from the ReLU kink
    directional_gradcheck(L.ReLU, [x], {})
    w = RNG.standard_normal((4, 18))
    b = RNG.standard_normal(4)
    directional_gradcheck(lambda: L.Linear(4), [x], {"weight": w, "bias": b})
    directional_gradcheck(L.Add, [x, x * 2], {})
    directional_gradcheck(L.Concat, [x, x[:, :1] * 3], {})
    directional_gradcheck(lambda: L.Dropout(0.4), [x], {}, rng_key=7)
    logits = RNG.standard_normal((5, 6))
    labels = RNG.integers(0, 6, 5)
    directional_gradcheck(L.SoftmaxCrossEntropy, [logits, labels], {})


@pytest.mark.parametrize("bad", [-1, 3, 7])
def test_run_layer_refuses_labels_outside_the_classes(bad):
    """numpy reads label -1 as the last class and label K as an IndexError: both are a DataError naming the
    layer, the range and the label."""
    import minidl as dl

    logits = RNG.standard_normal((2, 3)).astype(np.float32)
    with pytest.raises(dl.DataError, match=rf"'loss' \(softmax_xent\): labels: label {bad} is outside \[0, 3\)"):
        run_layer(L.SoftmaxCrossEntropy(name="loss"), [logits, np.array([0, bad])], dout=np.float32(1))
