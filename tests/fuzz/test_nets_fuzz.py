"""Property tests over whole things: small random networks against their PyTorch twins (float64 loss and every
gradient, BN running statistics), and randomly damaged checkpoints, which must be refused with a
`CheckpointError` or load exactly the values written (a flip in a zip field that carries no data)."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minidl as dl
from minidl.core.errors import CheckpointError, GraphError
from minidl.layers import (
    LRN,
    AvgPool2d,
    BatchNorm2d,
    Conv2d,
    Dropout,
    Flatten,
    Linear,
    MaxPool2d,
    ReLU,
    SoftmaxCrossEntropy,
)
from minidl.runtime import checkpoint as ck
from minidl.testing.torch_twin import TorchTwin

FUZZ = settings.get_profile("minidl-fuzz")

_BLOCKS = st.sampled_from(["conv", "conv_s2", "bn", "relu", "maxpool", "avgpool", "lrn", "dropout0"])


def _build(blocks, n, c, hw, classes):
    net = dl.Network("fz", dtype="float64")
    x = net.input((n, c, hw, hw), name="data")
    y = net.input((n,), dtype="int64", name="label")
    h = x
    for i, b in enumerate(blocks):
        name = f"{b}{i}"
        if b == "conv":
            h = Conv2d(3, 3, padding=1, name=name)(h)
        elif b == "conv_s2":
            h = Conv2d(2, 2, stride=2, name=name)(h)
        elif b == "bn":
            h = BatchNorm2d(name=name)(h)
        elif b == "relu":
            h = ReLU(name=name)(h)
        elif b == "maxpool":
            h = MaxPool2d(2, name=name)(h)
        elif b == "avgpool":
            h = AvgPool2d(3, stride=1, padding=1, name=name)(h)
        elif b == "lrn":
            h = LRN(3, name=name)(h)
        else:
            h = Dropout(0.0, name=name)(h)
    h = Linear(classes, name="fc")(Flatten(name="flat")(h))
    net.set_loss(SoftmaxCrossEntropy(name="loss")(h, y))
    return net


@FUZZ
@given(blocks=st.lists(_BLOCKS, min_size=1, max_size=5), n=st.integers(2, 3), c=st.integers(1, 3),
       hw=st.integers(2, 8), classes=st.integers(2, 4), seed=st.integers(0, 2**16),
       policy=st.sampled_from(["none", "liveness", "recompute", "offload"]))
def test_random_networks_match_their_torch_twin(blocks, n, c, hw, classes, seed, policy):
    try:
        net = _build(blocks, n, c, hw, classes)
        sess = dl.Session(net, dl.SGD(1.0), policy=policy, seed=seed)
    except GraphError:
        return  # an image too small for its pooling: refused at build, by name
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(net.input_nodes[0].shape)
    y = rng.integers(0, classes, n)
    before = sess.executor.state_dict()
    loss = sess.executor.train_step(x, y)
    twin = TorchTwin(net, before, dtype=torch.float64)
    tloss, _ = twin.forward(torch.tensor(x), torch.tensor(y))
    tloss.backward()
    assert abs(loss - tloss.item()) <= 1e-10 * max(1.0, abs(tloss.item()))
    tg = twin.grads()
    after = sess.executor.state_dict()
    for nd in net.layer_nodes:  # SGD with lr 1: before - after is the gradient, whatever the policy freed
        for p, spec in nd.params.items():
            if spec.trainable:
                k = f"{nd.name}.{p}"
                scale = max(1.0, float(np.abs(tg[k]).max()), float(np.abs(before[k]).max()))
                np.testing.assert_allclose(before[k] - after[k], tg[k], rtol=1e-8, atol=1e-12 * scale, err_msg=k)
    for nd in net.layer_nodes:
        if nd.type_name == "batchnorm":
            for s in ("running_mean", "running_var"):
                np.testing.assert_allclose(after[f"{nd.name}.{s}"], twin.params[nd.name][s].detach().numpy(),
                                           rtol=1e-10, atol=1e-12)


_GOOD = {}


def _good_checkpoint(tmp_dir) -> bytes:
    if "blob" not in _GOOD:
        p = tmp_dir / "good.npz"
        ck.save_checkpoint(p, {"a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
                               "a.bias": np.ones(3, np.float64)}, {"a.weight.momentum": np.zeros((3, 4), np.float32)},
                           {"iteration": 2, "batches_consumed": 2})
        _GOOD["blob"] = p.read_bytes()
    return _GOOD["blob"]


@FUZZ
@given(ops=st.lists(st.tuples(st.sampled_from(["flip", "truncate", "insert", "delete", "zero"]),
                              st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_damaged_checkpoints_are_refused_or_load_exactly(tmp_path_factory, ops):
    tmp = tmp_path_factory.getbasetemp()
    good = _good_checkpoint(tmp)
    ref = ck.load_checkpoint(tmp / "good.npz")
    b = bytearray(good)
    for op, where, val in ops:
        if not b:
            break
        i = min(int(where * len(b)), len(b) - 1)
        if op == "flip":
            b[i] ^= 1 << (val % 8)
        elif op == "truncate":
            del b[i:]
        elif op == "insert":
            b[i:i] = bytes([val])
        elif op == "delete":
            del b[i:i + 1 + val % 16]
        else:
            b[i:i + 1 + val % 64] = bytes(len(b[i:i + 1 + val % 64]))
    p = tmp / "fuzzed.npz"
    p.write_bytes(bytes(b))
    try:
        params, opt, meta = ck.load_checkpoint(p)
    except CheckpointError:
        return
    assert meta == ref[2]
    for mine, theirs in ((params, ref[0]), (opt, ref[1])):
        assert mine.keys() == theirs.keys()
        for k in mine:
            assert mine[k].dtype == theirs[k].dtype and np.array_equal(mine[k], theirs[k]), k
