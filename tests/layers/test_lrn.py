"""LRN against torch's local_response_norm (float32) and finite differences (float64)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import minidl as dl
from minidl.layers import LRN
from minidl.testing import directional_gradcheck, run_layer

# (input shape, size, alpha, beta, k)
CONFIGS = [
    ((2, 8, 5, 5), 5, 1e-4, 0.75, 1.0),       # AlexNet's setting
    ((2, 7, 3, 4), 5, 0.5, 0.75, 2.0),        # a strong alpha so the cross-channel terms matter
    ((2, 6, 4, 3), 4, 0.3, 0.75, 1.0),        # even size: asymmetric window
    ((1, 5, 3, 3), 2, 0.8, 0.5, 1.5),
    ((3, 3, 2, 5), 7, 0.4, 1.0, 1.0),         # window wider than the channel count
    ((2, 9, 3, 3), 3, 0.2, 0.6, 0.5),         # a general beta (pow)
    ((2, 1, 4, 4), 1, 0.9, 0.75, 1.0),
    ((2, 96, 27, 27), 5, 1e-4, 0.75, 2.0),    # AlexNet conv1 scale; planes split into blocks
]


def _torch(x, dy, size, alpha, beta, k):
    xt = torch.tensor(x, requires_grad=True)
    y = F.local_response_norm(xt, size, alpha, beta, k)
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), xt.grad.numpy()


@pytest.mark.parametrize("shape,size,alpha,beta,k", CONFIGS)
def test_matches_torch(shape, size, alpha, beta, k):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    run = run_layer(LRN(size, alpha, beta, k), [x], dout=dy)
    ty, tdx = _torch(x, dy, size, alpha, beta, k)
    np.testing.assert_allclose(run.out, ty, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run.dinputs[0], tdx, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape,size,alpha,beta,k", CONFIGS[:7])
def test_gradcheck_float64(shape, size, alpha, beta, k):
    x = np.random.default_rng(1).standard_normal(shape) * 2
    directional_gradcheck(lambda: LRN(size, alpha, beta, k), [x], {}, directions=3)


def test_declarations_and_errors():
    assert LRN.needs_inputs == (0,) and LRN.needs_output is True
    lrn = LRN()
    assert lrn.config() == {"size": 5, "alpha": 1e-4, "beta": 0.75, "k": 1.0}
    assert lrn.flops([(2, 8, 4, 4)], (2, 8, 4, 4)) > 2 * 8 * 4 * 4
    net = dl.Network()
    x = net.input((2, 16), name="x")
    with pytest.raises(dl.GraphError, match=r"'norm1' \(lrn\).*\(2, 16\).*4-D"):
        LRN(name="norm1")(x)
    with pytest.raises(ValueError):
        LRN(size=0)
