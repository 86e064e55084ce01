"""BatchNorm2d against PyTorch (train and eval, running statistics), finite differences, and recomputation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minidl as dl
from minidl.backend.cpu.backend import CPUBackend
from minidl.layers import BatchNorm2d, LayerContext
from minidl.testing import directional_gradcheck, run_layer

SHAPES = [
    (4, 3, 5, 5),
    (2, 16, 7, 9),
    (16, 8, 4, 4),      # several samples per block
    (2, 5, 100, 90),    # several blocks per sample
    (1, 3, 200, 190),   # planes larger than a block
    (3, 7, 1, 1),
    (1, 4, 1, 2),       # two values per channel: the smallest batch training accepts
]


def _params(c, rng, dtype=np.float32, affine=True):
    p = {"running_mean": rng.standard_normal(c).astype(dtype),
         "running_var": rng.uniform(0.5, 2.0, c).astype(dtype)}
    if affine:
        p["weight"] = rng.uniform(0.5, 1.5, c).astype(dtype)
        p["bias"] = rng.standard_normal(c).astype(dtype)
    return p


def _torch_bn(x, p, dy, training, momentum, eps):
    xt = torch.tensor(x, requires_grad=True)
    w = torch.tensor(p["weight"], requires_grad=True) if "weight" in p else None
    b = torch.tensor(p["bias"], requires_grad=True) if "bias" in p else None
    rm, rv = torch.tensor(p["running_mean"]), torch.tensor(p["running_var"])
    y = F.batch_norm(xt, rm, rv, w, b, training=training, momentum=momentum, eps=eps)
    y.backward(torch.tensor(dy))
    grads = {"weight": w.grad.numpy(), "bias": b.grad.numpy()} if w is not None else {}
    return y.detach().numpy(), xt.grad.numpy(), grads, rm.numpy(), rv.numpy()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("training", [True, False])
def test_matches_torch(shape, training):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    p = _params(shape[1], rng)
    ty, tdx, tgrads, trm, trv = _torch_bn(x, p, dy, training, 0.1, 1e-5)
    mine = {k: v.copy() for k, v in p.items()}
    run = run_layer(BatchNorm2d(), [x], mine, dout=dy, training=training)
    np.testing.assert_allclose(run.out, ty, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(run.dinputs[0], tdx, rtol=1e-3, atol=1e-4)
    for k in ("weight", "bias"):
        np.testing.assert_allclose(run.grads[k], tgrads[k], rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(mine["running_mean"], trm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mine["running_var"], trv, rtol=1e-5, atol=1e-6)
    if training:
        np.testing.assert_allclose(run.aux["mean"], x.astype(np.float64).mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-6)
        var = x.astype(np.float64).var(axis=(0, 2, 3))
        np.testing.assert_allclose(run.aux["invstd"], 1 / np.sqrt(var + 1e-5), rtol=1e-5)
    else:
        assert run.aux == {}


@pytest.mark.parametrize("momentum,eps", [(0.5, 1e-3), (1.0, 1e-5), (0.0, 1e-5)])
def test_running_stats_and_options_match_torch(momentum, eps):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 6, 5, 4)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    p = _params(6, rng, affine=False)
    ty, tdx, _, trm, trv = _torch_bn(x, p, dy, True, momentum, eps)
    mine = {k: v.copy() for k, v in p.items()}
    run = run_layer(BatchNorm2d(momentum=momentum, eps=eps, affine=False), [x], mine, dout=dy)
    assert run.grads == {}
    np.testing.assert_allclose(run.out, ty, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(run.dinputs[0], tdx, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(mine["running_mean"], trm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mine["running_var"], trv, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", [(3, 4, 5, 3), (2, 3, 1, 1), (6, 2, 40, 40)])
def test_gradcheck_float64(training, shape):
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape) * 1.5 + 0.3
    p = _params(shape[1], rng, dtype=np.float64)
    directional_gradcheck(BatchNorm2d, [x], p, training=training, directions=2)


def test_large_mean_keeps_an_accurate_variance():
    rng = np.random.default_rng(3)
    x = (1000.0 + rng.standard_normal((8, 4, 16, 16))).astype(np.float32)
    p = _params(4, rng)
    run = run_layer(BatchNorm2d(), [x], p)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(run.aux["invstd"], 1 / np.sqrt(x64.var(axis=(0, 2, 3)) + 1e-5), rtol=1e-5)


def test_recompute_is_bit_identical_and_side_effect_free():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 6, 9, 7)).astype(np.float32)
    p = _params(6, rng)
    layer = BatchNorm2d()
    first = run_layer(layer, [x], p)
    rm, rv = p["running_mean"].copy(), p["running_var"].copy()
    aux = {k: v.copy() for k, v in first.aux.items()}
    again = np.full_like(first.out, np.nan)
    layer.forward(CPUBackend(), [x], again, p, LayerContext(training=True, aux=aux, recompute=True))
    assert again.tobytes() == first.out.tobytes()
    assert p["running_mean"].tobytes() == rm.tobytes() and p["running_var"].tobytes() == rv.tobytes()
    assert all(aux[k].tobytes() == first.aux[k].tobytes() for k in aux)
    # a second non-recompute forward does update the running statistics again
    layer.forward(CPUBackend(), [x], again, p, LayerContext(training=True, aux=aux))
    assert not np.array_equal(p["running_mean"], rm)


def test_declarations():
    bn = BatchNorm2d()
    specs = bn.param_specs([(2, 5, 3, 3)])
    assert {k: (s.shape, s.init, s.trainable) for k, s in specs.items()} == {
        "weight": ((5,), "ones", True), "bias": ((5,), "zeros", True),
        "running_mean": ((5,), "zeros", False), "running_var": ((5,), "ones", False)}
    assert set(BatchNorm2d(affine=False).param_specs([(2, 5, 3, 3)])) == {"running_mean", "running_var"}
    assert bn.aux_specs([(2, 5, 3, 3)], training=True) == {"mean": (5,), "invstd": (5,)}
    assert bn.aux_specs([(2, 5, 3, 3)], training=False) == {}
    assert BatchNorm2d.needs_inputs == (0,) and not BatchNorm2d.needs_output
    assert bn.config() == {"momentum": 0.1, "eps": 1e-5, "affine": True}
    assert bn.flops([(2, 5, 3, 3)], (2, 5, 3, 3)) > 0


def test_build_error_names_the_layer():
    net = dl.Network()
    x = net.input((4, 10), name="x")
    with pytest.raises(dl.GraphError, match=r"'bn1' \(batchnorm\).*\(4, 10\).*4-D"):
        BatchNorm2d(name="bn1")(x)


def test_single_value_per_channel_in_training_is_an_error():
    x = np.ones((1, 3, 1, 1), np.float32)
    p = _params(3, np.random.default_rng(0))
    with pytest.raises(dl.GraphError, match=r"layer 'batchnorm1' \(batchnorm\) with input \(1, 3, 1, 1\): expected "
                                            r"more than one value per channel when training"):
        run_layer(BatchNorm2d(), [x], p)  # the layer's shape check, before forward: not the kernel's ValueError
    run_layer(BatchNorm2d(), [x], p, training=False)  # evaluation is fine
