"""The network: a static layer graph built with a functional API.

    net = dl.Network()
    x = net.input((8, 3, 32, 32))
    y = net.input((8,), dtype="int64", name="label")
    h = dl.layers.ReLU()(dl.layers.Conv2d(16, 3, padding=1)(x))
    ...
    net.set_loss(dl.layers.SoftmaxCrossEntropy()(logits, y))

Rules: each call infers its output shape at once (a wrong one fails there, naming the layer and shapes); call
order is a topological order, since a layer consumes only existing symbols; a planned graph is frozen.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..backend.base import menu_of
from ..backend.cpu.menu import CPU_MENU
from ..backend.precision import precision
from ..core.errors import GraphError
from ..core.symbol import Symbol
from ..core.tensors import grad_id, param_id
from ..layers import args
from ..layers.base import Layer, ParamSpec, Shape
from .route import Route
from .summary import NetworkSummary, summarize

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


def _dtype(dtype, who: str) -> np.dtype:
    """np.dtype(dtype), its TypeError as a GraphError naming `who`."""
    try:
        return np.dtype(dtype)
    except TypeError:
        raise GraphError(f"{who}: dtype {dtype!r} is not a numpy dtype (e.g. 'float32', 'int64')") from None


@dataclass(slots=True)
class Node:
    """One vertex of the graph: a network input (layer is None) or a layer applied to earlier nodes."""

    index: int
    name: str
    layer: Layer | None
    inputs: list[int]
    shape: Shape
    dtype: np.dtype
    params: dict[str, ParamSpec] = field(default_factory=dict)
    consumers: list[int] = field(default_factory=list)
    tied: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Parameters this layer reads but another, earlier layer owns (`Network.tie`): name -> (owner layer, its
    parameter). They are not in `params`: counted, initialized, saved and updated once, by their owner."""

    def param_ids(self) -> dict[str, str]:
        """Parameter name -> tensor id (a tied one is its owner's)."""
        ids = {p: param_id(self.name, p) for p in self.params}
        ids.update({p: param_id(*owner) for p, owner in self.tied.items()})
        return ids

    def grad_ids(self) -> dict[str, str]:
        """Parameter name -> the gradient id backward writes (a tied one's own contribution, added by the route)."""
        return {p: grad_id(self.name, p) for p, s in self.params.items() if s.trainable} | {
            p: grad_id(self.name, p) for p in self.tied}

    @property
    def is_input(self) -> bool:
        return self.layer is None

    @property
    def type_name(self) -> str:
        return "input" if self.layer is None else self.layer.type_name


class Network:
    """A layer graph. Build it with `input()` and layer calls, then `set_loss()`."""

    def __init__(self, name: str = "net", dtype="float32"):
        self.name = name
        self.dtype = _dtype(dtype, f"network '{name}'")
        if self.dtype not in (np.float32, np.float64):
            raise GraphError(f"network '{name}': dtype must be float32 or float64, got {self.dtype}")
        self.nodes: list[Node] = []
        self._by_name: dict[str, int] = {}
        self._type_counts: dict[str, int] = {}
        self.loss_index: int | None = None
        self._route_cache: dict = {}
        self.frozen_by: str | None = None   # who planned the graph
        # {"model": a zoo name, "options": its keyword arguments}; None built by hand
        self.recipe: dict | None = None

    # -- building
    def input(self, shape: Sequence[int], dtype=None, name: str | None = None) -> Symbol:
        """Declare an input (an integer dtype: labels, never differentiated); dimensions are integers >= 1."""
        if name is None:
            name = "data" if not any(n.is_input for n in self.nodes) else f"input{len(self.nodes)}"
        shape = args.shape("input", name, "shape", shape)
        dt = self.dtype if dtype is None else _dtype(dtype, f"input '{name}'")
        if dt == np.bool_ or not (np.issubdtype(dt, np.floating) or np.issubdtype(dt, np.integer)):
            raise GraphError(f"input '{name}': dtype must be a float (data) or an integer (labels), got {dt}")
        return self._append(Node(len(self.nodes), self._claim_name(name), None, [], shape, dt))

    def _claim_name(self, name: str) -> str:
        if not _NAME_RE.match(name):
            raise GraphError(f"name {name!r} is not valid: use letters, digits, '_', '.', '-'")
        if name in self._by_name:
            other = self.nodes[self._by_name[name]]
            raise GraphError(f"duplicate name '{name}': already used by a {other.type_name} node")
        return name

    def _auto_name(self, type_name: str) -> str:
        while True:
            k = self._type_counts.get(type_name, 0) + 1
            self._type_counts[type_name] = k
            cand = f"{type_name}{k}"
            if cand not in self._by_name:
                return cand

    def freeze(self, by: str) -> None:
        """Refuse later changes: `by` planned this graph and would train it while checkpoints followed another."""
        self.frozen_by = self.frozen_by or by

    def _check_mutable(self, what: str) -> None:
        if self.frozen_by is not None:
            raise GraphError(f"network '{self.name}': {what} after {self.frozen_by} planned it; the graph a session "
                             f"trains cannot change under it: change the network first, then make the Session")

    def _append(self, node: Node) -> Symbol:
        self._check_mutable(f"adding '{node.name}' ({node.type_name})")
        self.nodes.append(node)
        self._by_name[node.name] = node.index
        for i in node.inputs:
            self.nodes[i].consumers.append(node.index)
        self._route_cache.clear()
        return Symbol(self, node.index)

    def _add_layer(self, layer: Layer, inputs: list[Symbol]) -> Symbol:
        name = layer.name if layer.name is not None else self._auto_name(layer.type_name)
        layer.name = name
        name = self._claim_name(name)
        in_nodes = [s.node for s in inputs]
        in_shapes = [n.shape for n in in_nodes]
        in_dtypes = [n.dtype for n in in_nodes]
        where = (f"layer '{name}' ({layer.type_name}) with input shapes "
                 + ", ".join(f"{n.name}{n.shape}" for n in in_nodes))
        try:
            layer.check_input_dtypes(in_dtypes)
            shape = tuple(int(s) for s in layer.infer_shape(in_shapes))
            if any(s <= 0 for s in shape):
                raise ValueError(f"output shape {shape} has a non-positive dimension")
            params = layer.param_specs(in_shapes)
            dtype = np.dtype(layer.infer_dtype(in_dtypes, self.dtype))
        except GraphError:
            raise
        except ValueError as e:
            raise GraphError(f"{where}: {e}") from None
        if layer.is_loss and shape != ():
            raise GraphError(f"{where}: a loss layer must produce a scalar, got {shape}")
        node = Node(len(self.nodes), name, layer, [s.index for s in inputs], shape, dtype, params)
        return self._append(node)

    def set_loss(self, loss: Symbol) -> None:
        """Mark `loss` (a loss layer's output) as what training minimizes; its first input is what predict returns."""
        if not isinstance(loss, Symbol) or loss.network is not self:
            raise GraphError("set_loss() takes a Symbol of this network")
        node = loss.node
        self._check_mutable("set_loss()")
        if node.layer is None or not node.layer.is_loss:
            raise GraphError(f"set_loss(): '{node.name}' ({node.type_name}) is not a loss layer "
                             f"(e.g. SoftmaxCrossEntropy)")
        self.loss_index = node.index
        self._route_cache.clear()

    def tie(self, param: str, to: str) -> None:
        """Make `param` ("head.weight") one tensor with `to` ("wte.weight"), as a shared `nn.Parameter`: stored
        once, its gradient the sum of both. `to`'s layer comes first and is trainable, not itself tied."""
        user, pname = self._param_ref(param, "param")
        owner, oname = self._param_ref(to, "to")
        where = f"tie({param!r}, to={to!r})"
        self._check_mutable(where)
        if owner.index >= user.index:
            raise GraphError(f"{where}: the owner '{owner.name}' must come before '{user.name}' in the network "
                             f"(its backward adds the contributions up, so it must run last)")
        spec, ospec = user.params[pname], owner.params[oname]
        if tuple(spec.shape) != tuple(ospec.shape):
            raise GraphError(f"{where}: shapes differ: {param} is {tuple(spec.shape)}, {to} is "
                             f"{tuple(ospec.shape)}")
        if not (spec.trainable and ospec.trainable):
            raise GraphError(f"{where}: only trainable parameters can be tied")
        del user.params[pname]
        user.tied[pname] = (owner.name, oname)
        self._route_cache.clear()

    def _param_ref(self, ref, arg: str) -> tuple[Node, str]:
        layer, _, pname = ref.rpartition(".") if isinstance(ref, str) else ("", "", "")
        node = self.nodes[self._by_name[layer]] if layer in self._by_name else None
        if node is None or node.layer is None:
            raise GraphError(f"tie(): {arg}={ref!r} names no layer of network '{self.name}' (write 'layer.param', "
                             f"e.g. 'wte.weight')")
        if pname not in node.params:
            have = sorted(node.params) + [f"{p} (tied)" for p in sorted(node.tied)]
            raise GraphError(f"tie(): {arg}={ref!r}: layer '{layer}' ({node.type_name}) has no own parameter "
                             f"{pname!r} (it has: {', '.join(have) or 'none'})")
        return node, pname

    # -- queries
    def node(self, name: str) -> Node:
        """The node named `name`, else a GraphError."""
        try:
            return self.nodes[self._by_name[name]]
        except KeyError:
            raise GraphError(f"no node named {name!r} in network '{self.name}'") from None

    @property
    def layer_nodes(self) -> list[Node]:
        """Nodes applying a layer, in call order."""
        return [n for n in self.nodes if n.layer is not None]

    @property
    def input_nodes(self) -> list[Node]:
        """The inputs in declaration order."""
        return [n for n in self.nodes if n.layer is None]

    @property
    def loss_node(self) -> Node:
        """The node `set_loss` marked, else a GraphError."""
        if self.loss_index is None:
            raise GraphError(f"network '{self.name}' has no loss: call net.set_loss(...)")
        return self.nodes[self.loss_index]

    @property
    def logits_node(self) -> Node:
        """The loss layer's first input."""
        return self.nodes[self.loss_node.inputs[0]]

    def num_params(self, trainable_only: bool = True) -> int:
        """Parameter count (`trainable_only=False`: buffers too)."""
        return sum(int(math.prod(p.shape)) for n in self.nodes for p in n.params.values()
                   if p.trainable or not trainable_only)

    def summary(self) -> NetworkSummary:
        """The layer table `minidl info` prints (its repr); `.rows` and `.to_json()` give the numbers."""
        return summarize(self)

    def forward_flops(self) -> int:
        """Floating-point operations of one forward pass."""
        return sum(n.layer.flops([self.nodes[i].shape for i in n.inputs], n.shape) for n in self.layer_nodes)

    def validate(self) -> None:
        """Reject graphs that cannot be trained: no loss, dangling inputs, branches that reach no loss."""
        loss = self.loss_node
        reach = [False] * len(self.nodes)
        reach[loss.index] = True
        for n in reversed(self.nodes):  # topological order: one reverse sweep
            if reach[n.index]:
                for i in n.inputs:
                    if i >= n.index:
                        raise GraphError(f"cycle: node '{n.name}' consumes '{self.nodes[i].name}', "
                                         f"which is not computed before it")
                    reach[i] = True
        for n in self.nodes:
            if reach[n.index]:
                continue
            if n.is_input:
                raise GraphError(f"input '{n.name}' {n.shape} is dangling: no path from it to the loss")
            raise GraphError(f"layer '{n.name}' ({n.type_name}) output {n.shape} is an unused branch: "
                             f"it does not reach the loss '{loss.name}'")

    def route(self, training: bool = True, optimizer_slots: Sequence[str] = (), menu=CPU_MENU,
              fused_update: bool = False, micro_batches: int = 1, packs=None, math: str = "fp32") -> "Route":
        """The execution order every plan is expressed on (cached until the graph changes).

        `optimizer_slots` names the per-parameter state the optimizer keeps (e.g. ("momentum",)), so that
        optimizer state is planned like every other tensor. `menu` supplies the convolution algorithms each step
        may run and their workspace sizes: the CPU's menu (`CPUMenu`, by default), the cuDNN model, or a live
        backend; a CPU backend's menu is its `CPUMenu`, so it shares that menu's route. `fused_update`: each
        layer's optimizer update right after its backward (see `route.py`). `packs` (lists of layer names):
        Harmony's route of layer packs and micro-batches (see `packs.py`; always fused); `micro_batches` > 1
        without packs: gradient accumulation, each micro-batch's forward then its backward (`route.py`; always
        fused). `math`: the math mode whose storage dtypes the tensors get (`backend.precision`; fp32 and tf32
        store alike and share a route).
        """
        menu = menu_of(menu)
        math = math if precision(math).half is not None else "fp32"
        key = (bool(training), tuple(optimizer_slots), menu, bool(fused_update) and bool(training), math)
        if training and (micro_batches != 1 or packs is not None):
            from .packs import build_packed

            pkey = key + (int(micro_batches), tuple(map(tuple, packs)) if packs is not None else None)
            if pkey not in self._route_cache:
                self.validate()
                self._route_cache[pkey] = build_packed(self, micro_batches, packs, key[1], menu, math)
            return self._route_cache[pkey]
        if key not in self._route_cache:
            self.validate()
            self._route_cache[key] = Route.build(self, training=training, optimizer_slots=key[1], menu=menu,
                                                 fused_update=key[3], math=math)
        return self._route_cache[key]

    def __repr__(self) -> str:
        return (f"Network({self.name!r}, {len(self.layer_nodes)} layers, "
                f"{self.num_params():,} params)")
