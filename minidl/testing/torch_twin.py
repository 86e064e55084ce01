"""A minidl network rebuilt in PyTorch with the same weights, one functional call per node: the oracle of
whole-network tests and the benchmarks' peer. Imports torch: only tests and benchmarks import it."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..graph.network import Network

#: (aten op name fragment, minidl layer kind), first match wins; approximate (a mean lands under `gap`)
ATEN_KINDS = [
    ("convolution", "conv"), ("conv", "conv"),
    ("batch_norm", "batchnorm"),
    ("threshold_backward", "relu"), ("relu", "relu"), ("clamp_min", "relu"),
    ("max_pool", "maxpool"), ("avg_pool", "avgpool"),
    ("addmm", "linear"), ("aten::mm", "linear"), ("aten::t", "linear"),
    ("mean", "gap"), ("aten::sum", "gap"), ("expand", "gap"), ("div", "gap"),
    ("aten::add", "add"), ("aten::cat", "concat"),
    ("native_layer_norm", "layernorm"), ("layer_norm", "layernorm"), ("gelu", "gelu"),
    ("scaled_dot_product", "attention"), ("_flash_attention", "attention"), ("bmm", "attention"),
    ("embedding", "embedding"), ("aten::matmul", "linear"), ("aten::linear", "linear"),
    ("softmax", "softmax_xent"), ("nll_loss", "softmax_xent"),
    ("sgd", "update"), ("add_", "update"), ("_foreach", "update"),
]


def aten_kind(op: str) -> str:
    """The minidl layer kind of aten op `op` (`ATEN_KINDS`), or 'other'."""
    for fragment, kind in ATEN_KINDS:
        if fragment in op:
            return kind
    return "other"


def _node_fn(node) -> Callable:
    L = node.layer
    t = L.type_name
    if t == "conv":
        return lambda xs, p: F.conv2d(xs[0], p["weight"], p.get("bias"), L.stride, L.padding, L.dilation, L.groups)
    if t == "batchnorm":
        return lambda xs, p, training=True: F.batch_norm(
            xs[0], p["running_mean"], p["running_var"], p.get("weight"), p.get("bias"), training, L.momentum, L.eps)
    if t == "relu":
        return lambda xs, p: F.relu(xs[0])
    if t == "maxpool":
        return lambda xs, p: F.max_pool2d(xs[0], L.kernel_size, L.stride, L.padding, L.dilation, L.ceil_mode)
    if t == "avgpool":
        return lambda xs, p: F.avg_pool2d(xs[0], L.kernel_size, L.stride, L.padding, L.ceil_mode,
                                          L.count_include_pad)
    if t == "gap":
        return lambda xs, p: xs[0].mean(dim=(2, 3))
    if t == "linear":
        if not L.flatten:
            return lambda xs, p: F.linear(xs[0], p["weight"], p.get("bias"))
        return lambda xs, p: F.linear(xs[0].reshape(xs[0].shape[0], -1), p["weight"], p.get("bias"))
    if t == "matmul":
        return lambda xs, p: torch.matmul(xs[0], xs[1].transpose(-1, -2) if L.transpose_b else xs[1])
    if t == "layernorm":
        return lambda xs, p: F.layer_norm(xs[0], xs[0].shape[-1:], p.get("weight"), p.get("bias"), L.eps)
    if t == "gelu":
        return lambda xs, p: F.gelu(xs[0], approximate=L.approximate)
    if t == "softmax":
        return lambda xs, p: F.softmax(xs[0], dim=-1)
    if t == "embedding":
        return lambda xs, p: F.embedding(xs[0], p["weight"])
    if t == "pos_embedding":
        return lambda xs, p: xs[0] + p["weight"][:xs[0].shape[1]]
    if t == "attention":
        return lambda xs, p: causal_attention(xs[0], L.num_heads, L.causal)
    if t == "dropout":
        return lambda xs, p: xs[0] if L.p == 0 else F.dropout(xs[0], L.p, True)
    if t == "add":
        def add(xs, p):
            out = xs[0]
            for x in xs[1:]:
                out = out + x
            return out
        return add
    if t == "concat":
        return lambda xs, p: torch.cat(xs, dim=1)
    if t == "flatten":
        return lambda xs, p: xs[0].reshape(xs[0].shape[0], -1)
    if t == "lrn":
        return lambda xs, p: F.local_response_norm(xs[0], L.size, L.alpha, L.beta, L.k)
    if t == "softmax_xent":
        ignore = -100 if L.ignore_index is None else L.ignore_index
        return lambda xs, p: F.cross_entropy(xs[0].reshape(-1, xs[0].shape[-1]), xs[1].reshape(-1),
                                             ignore_index=ignore)
    raise NotImplementedError(f"no PyTorch translation for layer type {t!r}")


def causal_attention(qkv: torch.Tensor, num_heads: int, causal: bool = True) -> torch.Tensor:
    """`CausalSelfAttention` (or not causal) through torch's scaled_dot_product_attention."""
    b, t, c3 = qkv.shape
    c = c3 // 3
    q, k, v = (a.reshape(b, t, num_heads, c // num_heads).transpose(1, 2) for a in qkv.split(c, dim=2))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return y.transpose(1, 2).reshape(b, t, c)


class TorchTwin:
    """A PyTorch replica of a minidl network: parameters as leaf tensors, one functional call per node."""

    def __init__(self, net: Network, state: dict[str, np.ndarray], dtype=torch.float32):
        self.net = net
        self.params: dict[str, dict[str, torch.Tensor]] = {}
        for n in net.layer_nodes:
            ps = {}
            for pname, spec in n.params.items():
                tensor = torch.tensor(np.array(state[f"{n.name}.{pname}"]), dtype=dtype)
                ps[pname] = tensor.requires_grad_(spec.trainable)
            self.params[n.name] = ps
        self.tied = {n.name: {p: self.params[o][op] for p, (o, op) in n.tied.items()} for n in net.layer_nodes}
        self.fns = {n.index: _node_fn(n) for n in net.layer_nodes}

    def parameters(self) -> list[torch.Tensor]:
        return [p for ps in self.params.values() for p in ps.values() if p.requires_grad]

    def forward(self, x, y, training: bool = True, keep: bool = False):
        vals: dict[int, torch.Tensor] = {}
        inputs = self.net.input_nodes
        vals[inputs[0].index] = x if torch.is_tensor(x) else torch.tensor(x)
        if len(inputs) > 1:
            vals[inputs[1].index] = y if torch.is_tensor(y) else torch.tensor(y)
        for n in self.net.layer_nodes:
            xs = [vals[i] for i in n.inputs]
            fn = self.fns[n.index]
            params = self.params[n.name] | self.tied[n.name]  # a tied parameter is its owner's tensor
            if n.layer.type_name == "batchnorm":
                vals[n.index] = fn(xs, params, training)
            else:
                vals[n.index] = fn(xs, params)
            if keep:
                vals[n.index].retain_grad()
        return vals[self.net.loss_index], vals

    def grads(self) -> dict[str, np.ndarray]:
        return {f"{layer}.{p}": t.grad.detach().numpy() for layer, ps in self.params.items()
                for p, t in ps.items() if t.requires_grad and t.grad is not None}
