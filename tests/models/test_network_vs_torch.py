"""Whole networks against their PyTorch twins (same weights): loss, every parameter gradient, BN statistics."""
import numpy as np
import pytest
import torch

from minidl.core.tensors import grad_id
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import Session
from minidl.testing.torch_twin import TorchTwin


def one_step(net, x, y, seed=0):
    sess = Session(net, SGD(lr=0.0), policy="none", seed=seed)
    before = sess.executor.state_dict()
    loss = sess.executor.train_step(x, y)
    grads = {f"{n.name}.{p}": np.array(sess.executor.views[grad_id(n.name, p)])
             for n in net.layer_nodes for p, s in n.params.items() if s.trainable}
    return before, loss, grads, sess.executor.state_dict()


# float32 where the network is well conditioned; float64 for ResNet-50 at a tiny batch and image, where
# 50 layers of batch norm over a handful of values amplify float32 rounding far beyond any fixed tolerance.
@pytest.mark.parametrize("spec,tol", [
    (dict(name="resnet", depth=20, batch=3, image_size=16, num_classes=10), 2e-3),
    (dict(name="resnet", depth=50, batch=2, image_size=64, num_classes=7, variant="imagenet", dtype="float64"), 1e-7),
    (dict(name="densenet", variant="tiny", batch=2, image_size=16, num_classes=5), 2e-3),
    (dict(name="alexnet", variant="lrn", batch=2, image_size=224, num_classes=10), 2e-3),
])
def test_network_matches_pytorch(spec, tol):
    spec = dict(spec)
    name = spec.pop("name")
    net = build_model(name, **spec)
    dt = np.dtype(spec.get("dtype", "float32"))
    for n in net.layer_nodes:  # dropout masks differ between frameworks by design: compare without dropout
        if n.type_name == "dropout":
            n.layer.p = 0.0
    rng = np.random.default_rng(0)
    x = rng.standard_normal(net.input_nodes[0].shape).astype(dt)
    y = rng.integers(0, net.logits_node.shape[1], net.input_nodes[0].shape[0]).astype(np.int64)
    before, loss, grads, after = one_step(net, x, y)
    twin = TorchTwin(net, before, dtype=torch.float64 if dt == np.float64 else torch.float32)
    tloss, _ = twin.forward(torch.tensor(x), torch.tensor(y))
    tloss.backward()
    assert loss == pytest.approx(tloss.item(), rel=tol)
    tg = twin.grads()
    assert tg.keys() == grads.keys()
    for k in grads:
        scale = max(1e-3, float(np.abs(tg[k]).max()))
        np.testing.assert_allclose(grads[k], tg[k], rtol=tol, atol=0.1 * tol * scale, err_msg=k)
    # BN running statistics were updated exactly once, like PyTorch's.
    for n in net.layer_nodes:
        if n.type_name == "batchnorm":
            for s in ("running_mean", "running_var"):
                np.testing.assert_allclose(after[f"{n.name}.{s}"], twin.params[n.name][s].numpy(),
                                           rtol=max(tol, 1e-5), atol=1e-5, err_msg=f"{n.name}.{s}")
