"""The route: the execution order that every memory decision is expressed on.

A training route is: one forward step per layer in topological order, then one backward step per layer that
has something to differentiate, in reverse order, then one update step (the optimizer). With a *fused update*
(`fused_update=True`) there is no final update step: each layer's update runs right after its own backward, so a
gradient lives only between the two (ZeRO-Offload, Harmony). The arithmetic is the same: an update touches only
its own parameter, gradient and optimizer slots, and no later step reads that parameter (backward reads only its
own layer's parameters, and a layer is backwarded once), so the parameters come out bit-identical. Each step lists the
tensors it reads and writes, derived from the layers' declared backward needs; from those lists alone, the
liveness analysis can tell when every tensor is born and when it dies, and a plan can attach events
(allocate, free, offload, prefetch, recompute...) to steps.

Forks need no special layer: when a tensor feeds several layers, its delta receives several contributions in
backward. The first consumer to run backward writes the delta directly; each later one writes a *partial
delta* that is added into it and freed at once. Partials are planned tensors like any other, so the memory
this costs is visible in every plan.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..backend import backend_name
from ..core.tensors import (
    Role,
    TensorSpec,
    act_id,
    aux_id,
    delta_id,
    grad_id,
    opt_state_id,
    param_id,
    partial_delta_id,
    workspace_id,
)

if TYPE_CHECKING:  # pragma: no cover
    from .network import Network


class Phase(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


@dataclass(slots=True)
class Accumulation:
    """After a backward step: `into += partial`, then `partial` is dead."""

    partial: str
    into: str


@dataclass(slots=True)
class Step:
    """One step of the route: a layer's forward, a layer's backward, or the optimizer update."""

    index: int
    phase: Phase
    node: int | None               # graph node index (None for the whole-network update step)
    name: str                      # the layer name ("" for the whole-network update)
    reads: list[str]
    writes: list[str]
    workspace: str | None = None   # workspace tensor id, if the layer offers algorithms for this phase
    workspace_options: list = field(default_factory=list)  # those algorithms (WorkspaceOption), as listed
    dinputs: list[str | None] = field(default_factory=list)   # backward: where each input's delta goes
    accumulate: list[Accumulation] = field(default_factory=list)
    seed_delta: str | None = None  # backward of the loss: the delta set to 1.0 (1/M with M micro-batches)
    micro: int = 0                 # the micro-batch this step runs (packs.py); 0 without micro-batching
    recompute: bool = False        # a pack's re-forward in backward (packs.py): no running-statistics update
    rename: dict[str, str] = field(default_factory=dict)  # canonical tensor id -> this step's (packs.py)

    @property
    def label(self) -> str:
        if self.phase is Phase.UPDATE:
            return f"update {self.name}" if self.name else "update"
        kind = "bwd" if self.phase is Phase.BACKWARD else ("refwd" if self.recompute else "fwd")
        return f"{kind} {self.name}" + (f" [{self.micro}]" if self.rename else "")


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """How a plan of a route is placed, beyond the route itself: `paged_chunk` (`--paged`), the chunk every
    placement pass places tensors by (None: the contiguous pool).

    A value, attached to a route only by `Route.with_options`, which returns a copy: `Network.route` caches one
    route per configuration and every plan of the network shares it, so writing an option into that route
    would change the plans made before (and the next one made without the option)."""

    paged_chunk: int | None = None
    max_micro_batches: int | None = None
    """The most micro-batches a policy may split the batch into by itself (`auto`, when no single-batch plan fits;
    None: as many as divide the batch; 1: never). A route already cut into micro-batches keeps its count."""
    host_weights: bool = True   # a search may home weights and optimizer state on the host (auto's last resort)


@dataclass(slots=True)
class Route:
    network: "Network"
    training: bool
    steps: list[Step]
    tensors: dict[str, TensorSpec]
    optimizer_slots: tuple[str, ...] = ()
    requires_grad: list[bool] = field(default_factory=list)
    backend_name: str = "cpu"  # whose algorithm menu the steps' workspace options are (see `build`)
    fused_update: bool = False  # one update step per layer, right after its backward (see the module doc)
    options: PlanOptions = field(default_factory=PlanOptions)  # how plans of it are placed (`with_options`)
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    """Analyses derived from the route alone (liveness, per-step cost estimates), computed once: a plan of a deep
    network asks for them a dozen times, and a route does not change after `build`."""
    packing: object = None      # packs.Packing for a route of layer packs and micro-batches, else None
    backend: object = field(default=None, repr=False, compare=False)  # whose menu (None: the CPU's); rebuilds keep it

    @property
    def micro_batches(self) -> int:
        return self.packing.micro_batches if self.packing is not None else 1

    def shapes_of(self, node_index: int) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
        """(input shapes, output shape) of a node as this route's steps run it (a micro-batch's, if any)."""
        if self.packing is not None:
            return self.packing.shapes[node_index]
        node = self.network.nodes[node_index]
        return [self.network.nodes[i].shape for i in node.inputs], node.shape

    @property
    def turn(self) -> int:
        """The first step of the backward half (a packed route's first re-forward counts as backward)."""
        return next((s.index for s in self.steps if s.phase is not Phase.FORWARD or s.recompute),
                    len(self.steps))

    # -- queries ---------------------------------------------------------------------------------------------
    @property
    def forward_steps(self) -> list[Step]:
        return [s for s in self.steps if s.phase is Phase.FORWARD]

    @property
    def backward_steps(self) -> list[Step]:
        return [s for s in self.steps if s.phase is Phase.BACKWARD]

    def rebuildable_aux(self) -> list[str]:
        """The aux tensors of this route a plan may leave out (`Layer.rebuildable_aux`: attention's scores)."""
        if self.packing is not None:  # a packed route's aux tensors are per micro-batch (renamed): not offered
            return []
        out = []
        for st in self.forward_steps:
            layer = self.network.nodes[st.node].layer
            out += [t for t in (aux_id(st.name, a) for a in layer.rebuildable_aux) if t in self.tensors]
        return out

    def with_micro_batches(self, micro_batches: int, packs: list[list[str]] | None = None) -> "Route":
        """This route's network cut into `micro_batches` micro-batches and `packs` (default: one per layer), on
        the same backend's menu and under the same options: how a policy that chooses the count or the packing
        itself (`packs`, `auto`) rebuilds the route it was given."""
        packs = [[n.name] for n in self.network.layer_nodes] if packs is None else packs
        return self.network.route(training=True, optimizer_slots=self.optimizer_slots, backend=self.backend,
                                  fused_update=True, micro_batches=micro_batches,
                                  packs=packs).with_options(self.options)

    def with_options(self, options: PlanOptions) -> "Route":
        """This route planned under `options`: a copy (the cached route is shared and never changes). It keeps
        the memo: the analyses there (liveness, bounds, step costs) do not depend on how tensors are placed."""
        return self if options == self.options else replace(self, options=options)

    def without_aux(self, aux: Sequence[str]) -> "Route":
        """This route without the aux tensors `aux` (among `rebuildable_aux()`): no step writes or reads them, and
        their layers, finding no array for them, rebuild what they hold in backward (same bits). A new route
        (its own memo); the steps keep their indices, so per-step choices made on this one still apply."""
        drop = set(aux)
        others = drop - set(self.rebuildable_aux())
        if others:
            raise ValueError(f"not rebuildable aux tensors of this route: {sorted(others)}")
        steps = [replace(st, reads=[t for t in st.reads if t not in drop],
                         writes=[t for t in st.writes if t not in drop])
                 if drop & (set(st.reads) | set(st.writes)) else st for st in self.steps]
        return replace(self, steps=steps, tensors={k: v for k, v in self.tensors.items() if k not in drop}, memo={})

    def tensors_of(self, *roles: Role) -> list[TensorSpec]:
        return [t for t in self.tensors.values() if t.role in roles]

    def persistent_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values() if t.role.persistent)

    # -- construction ------------------------------------------------------------------------------------------
    @staticmethod
    def build(net: "Network", training: bool = True, optimizer_slots: Sequence[str] = (),
              backend=None, fused_update: bool = False) -> "Route":
        """The route of `net`. `backend` (None: the CPU reference) is asked, once per step, which algorithms
        a layer can run with and how much workspace each needs: the route is where that menu is fixed, so
        every planner pass (sizing, bounds, simulation, auto's search) reads the same one. `fused_update`:
        each layer's optimizer update right after its backward instead of one update step at the end."""
        nodes = net.nodes
        tensors: dict[str, TensorSpec] = {}

        def add(tid: str, role: Role, shape, dtype, owner: str) -> str:
            tensors[tid] = TensorSpec(tid, role, tuple(shape), np.dtype(dtype), owner)
            return tid

        # requires_grad: does the delta of this node's output have to be computed?
        rg = [False] * len(nodes)
        for n in nodes:
            if n.layer is None:
                continue
            has_trainable = any(p.trainable for p in n.params.values()) or bool(n.tied)
            rg[n.index] = has_trainable or any(
                rg[i] for k, i in enumerate(n.inputs) if k not in n.layer.nondiff_inputs)

        for n in nodes:
            if n.layer is None:
                role = Role.DATA if np.issubdtype(n.dtype, np.floating) else Role.LABEL
                add(act_id(n.name), role, n.shape, n.dtype, n.name)
            else:
                add(act_id(n.name), Role.ACTIVATION, n.shape, n.dtype, n.name)
                for pname, spec in n.params.items():
                    role = Role.PARAMETER if spec.trainable else Role.BUFFER
                    add(param_id(n.name, pname), role, spec.shape, n.dtype if np.issubdtype(
                        n.dtype, np.floating) else net.dtype, n.name)

        steps: list[Step] = []
        aux_of: dict[int, list[str]] = {}  # node -> its aux tensor ids (looked up in backward; no scan)
        for n in nodes:
            if n.layer is None:
                continue
            layer = n.layer
            in_shapes = [nodes[i].shape for i in n.inputs]
            reads = [act_id(nodes[i].name) for i in n.inputs] + list(n.param_ids().values())
            writes = [act_id(n.name)] + [param_id(n.name, p) for p, s in n.params.items()
                                         if not s.trainable and training]
            if training:
                layer.check_training(in_shapes)
                # written by the training forward even when no backward reads them (BN on the data)
                for aname, ashape in layer.aux_specs(in_shapes, training=True).items():
                    tid = add(aux_id(n.name, aname), Role.AUX, ashape, net.dtype, n.name)
                    writes.append(tid)
                    aux_of.setdefault(n.index, []).append(tid)
            opts = layer.workspace_options("fwd", in_shapes, n.shape, net.dtype.itemsize, backend=backend)
            ws = add(workspace_id(n.name, "fwd"), Role.WORKSPACE, (0,), np.uint8, n.name) if opts else None
            steps.append(Step(len(steps), Phase.FORWARD, n.index, n.name, reads, writes, ws, list(opts)))

        if training:
            tied_in = tied_contributions(net)
            seen_delta: set[str] = set()
            for n in reversed(nodes):
                if n.layer is None or not rg[n.index]:
                    continue
                layer = n.layer
                in_shapes = [nodes[i].shape for i in n.inputs]
                dout = add(delta_id(n.name), Role.DELTA, n.shape, n.dtype, n.name)
                reads = [dout]
                reads += [act_id(nodes[n.inputs[k]].name) for k in layer.needs_inputs]
                if layer.needs_output:
                    reads.append(act_id(n.name))
                reads += aux_of.get(n.index, [])
                reads += list(n.param_ids().values())
                writes: list[str] = []
                dinputs: list[str | None] = []
                accs: list[Accumulation] = []
                for k, i in enumerate(n.inputs):
                    src = nodes[i]
                    if k in layer.nondiff_inputs or not rg[i]:
                        dinputs.append(None)
                        continue
                    d = delta_id(src.name)
                    if d not in seen_delta:
                        seen_delta.add(d)
                        add(d, Role.DELTA, src.shape, src.dtype, src.name)
                        target = d
                    else:
                        target = add(partial_delta_id(src.name, n.name, k), Role.DELTA, src.shape, src.dtype,
                                     src.name)
                        accs.append(Accumulation(target, d))
                    dinputs.append(target)
                    writes.append(target)
                for pname, spec in n.params.items():
                    if spec.trainable:
                        writes.append(add(grad_id(n.name, pname), Role.GRADIENT, spec.shape, net.dtype, n.name))
                for pname, (owner, oname) in n.tied.items():
                    shape = net.node(owner).params[oname].shape
                    writes.append(add(grad_id(n.name, pname), Role.GRADIENT, shape, net.dtype, n.name))
                for part, into in tied_in.get(n.index, ()):
                    reads.append(part)
                    accs.append(Accumulation(part, into))
                opts = layer.workspace_options("bwd", in_shapes, n.shape, net.dtype.itemsize, backend=backend)
                ws = add(workspace_id(n.name, "bwd"), Role.WORKSPACE, (0,), np.uint8, n.name) if opts else None
                step = Step(len(steps), Phase.BACKWARD, n.index, n.name, reads, writes, ws, list(opts), dinputs,
                            accs)
                if layer.is_loss:
                    step.seed_delta = dout
                steps.append(step)
                if fused_update:
                    update = update_step(len(steps), [n], optimizer_slots, add, net.dtype)
                    if update is not None:
                        steps.append(update)
            if not fused_update:
                steps.append(update_step(len(steps), nodes, optimizer_slots, add, net.dtype)
                             or Step(len(steps), Phase.UPDATE, None, "", [], []))
        return Route(net, training, steps, tensors, tuple(optimizer_slots), rg,
                     backend_name(backend), fused_update, backend=backend)


def tied_contributions(net: "Network") -> dict[int, list[tuple[str, str]]]:
    """Owner node -> [(a tied user's gradient contribution, the owner's gradient it is added into)]: the additions
    the owner's backward step makes after its own (`Network.tie`; the users' backward steps ran before it)."""
    out: dict[int, list[tuple[str, str]]] = {}
    for n in net.layer_nodes:
        for pname, (owner, oname) in n.tied.items():
            out.setdefault(net.node(owner).index, []).append((grad_id(n.name, pname), grad_id(owner, oname)))
    return out


def update_step(index: int, nodes, optimizer_slots: Sequence[str], add, dtype) -> Step | None:
    """The optimizer update of `nodes`' trainable parameters (None if they have none). One node: a fused
    per-layer update, named after its layer; several: the whole-network update step."""
    reads: list[str] = []
    writes: list[str] = []
    for n in nodes:
        for pname, spec in n.params.items():
            if not spec.trainable:
                continue
            p = param_id(n.name, pname)
            reads += [p, grad_id(n.name, pname)]
            writes.append(p)
            for slot in optimizer_slots:
                s = add(opt_state_id(n.name, pname, slot), Role.OPTIMIZER, spec.shape, dtype, n.name)
                reads.append(s)
                writes.append(s)
    if not writes:
        return None
    if len(nodes) == 1:
        return Step(index, Phase.UPDATE, nodes[0].index, nodes[0].name, reads, writes)
    return Step(index, Phase.UPDATE, None, "", reads, writes)
