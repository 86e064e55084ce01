"""The route: the execution order every memory decision is expressed on.

Rules:
- Forward steps in topological order, backward steps in reverse, then the update (fused: each layer's right after
  its backward, the same arithmetic). Each step lists the tensors it reads and writes: liveness and every plan's
  events come from those lists alone.
- One builder (`build_route`) makes every route; the plain route is one micro-batch of the packed one (packs.py).
- A fork's later consumers write partial deltas added into the first one's, or add into it themselves
  (`accumulates_in_place`, the same addition). Every plan of a route sums in one order: plans stay bit-identical.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..backend import backend_name
from ..backend.cpu.menu import CPU_MENU
from ..backend.precision import check_half_kernels, precision
from ..core.errors import OptionError
from ..core.options import PlanOptions
from ..core.tensors import (
    Role,
    TensorSpec,
    act_id,
    aux_id,
    copy_id,
    delta_id,
    grad_id,
    micro_id,
    opt_state_id,
    param_id,
    partial_delta_id,
    staging_id,
    workspace_id,
)
from ..layers.staging import step_staging

if TYPE_CHECKING:  # pragma: no cover
    from .network import Network


class Phase(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


@dataclass(slots=True)
class Accumulation:
    """After a backward step: `into += partial`, then `partial` is dead; with `partial` None the layer added its
    input `slot`'s delta into `into` itself."""

    partial: str | None
    into: str
    slot: int = 0

    @property
    def in_place(self) -> bool:
        return self.partial is None


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
    micro: int = 0                 # the micro-batch this step runs
    recompute: bool = False        # a pack's re-forward in backward: no running-statistics update
    rename: dict[str, str] = field(default_factory=dict)  # canonical tensor id -> this step's (`micro_id`)
    staging: str | None = None     # a half mode on the CPU: the float32 copies its half kernels stage (`Role.STAGING`)

    @property
    def accumulates_into(self) -> frozenset[int]:
        """The input slots whose delta this backward step's layer adds into (in-place accumulations)."""
        return frozenset(a.slot for a in self.accumulate if a.in_place)

    @property
    def label(self) -> str:
        if self.phase is Phase.UPDATE:
            return f"update {self.name}" if self.name else "update"
        kind = "bwd" if self.phase is Phase.BACKWARD else ("refwd" if self.recompute else "fwd")
        return f"{kind} {self.name}" + (f" [{self.micro}]" if self.rename else "")


@dataclass(slots=True)
class Route:
    network: "Network"
    training: bool
    steps: list[Step]
    tensors: dict[str, TensorSpec]
    optimizer_slots: tuple[str, ...] = ()
    requires_grad: list[bool] = field(default_factory=list)
    menu: object = field(default=CPU_MENU, repr=False, compare=False)  # whose algorithms the steps offer
    fused_update: bool = False  # one update step per layer, right after its backward
    options: PlanOptions = field(default_factory=PlanOptions)
    """The options plans of it are made under (`with_options`): a value, attached only by `with_options`, which
    returns a copy: `Network.route` caches one route per configuration and every plan of the network shares it, so
    writing an option into that route would change the plans made before (and the next one made without it)."""
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    """Analyses derived from the route alone (liveness, per-step cost estimates), computed once: a plan of a deep
    network asks for them a dozen times, and a route does not change after `build`."""
    packing: object = None      # packs.Packing for a route of layer packs and micro-batches, else None
    math: str = "fp32"          # the math mode whose storage dtypes the tensors have (`backend.precision`)
    copies: dict[str, str] = field(default_factory=dict)  # a half mode: master weight id -> its half copy's id

    @property
    def precision(self):
        """The `backend.precision.Precision` of the math mode the tensors are stored for."""
        return precision(self.math)

    def kernel_params(self, node) -> dict[str, str]:
        """The tensor each parameter of `node`'s kernels reads, by parameter name: in a half mode the half copy
        of the layer's `half_params` (a tied one's owner's copy), else the master (`Node.param_ids`)."""
        ids = node.param_ids()
        if not self.copies:
            return ids
        half = node.layer.half_params
        return {p: self.copies[t] if p in half else t for p, t in ids.items()}

    @property
    def backend_name(self) -> str:
        """The backend whose algorithms the steps offer."""
        return backend_name(self.menu)

    @property
    def micro_batches(self) -> int:
        return self.packing.micro_batches if self.packing is not None else 1

    def shapes_of(self, node_index: int) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
        if self.packing is not None:
            return self.packing.shapes[node_index]
        node = self.network.nodes[node_index]
        return [self.network.nodes[i].shape for i in node.inputs], node.shape

    @property
    def turn(self) -> int:
        """The first step of the backward half (a re-forward counts as backward)."""
        return next((s.index for s in self.steps if s.phase is not Phase.FORWARD or s.recompute),
                    len(self.steps))

    @property
    def forward_end(self) -> int:
        """One past the last forward that is not a re-forward: where an evaluation's forward ends."""
        last = max((s.index for s in self.steps if s.phase is Phase.FORWARD and not s.recompute), default=-1)
        return last + 1

    # -- queries
    @property
    def forward_steps(self) -> list[Step]:
        return [s for s in self.steps if s.phase is Phase.FORWARD]

    @property
    def backward_steps(self) -> list[Step]:
        return [s for s in self.steps if s.phase is Phase.BACKWARD]

    def rebuildable_aux(self) -> list[str]:
        """The aux tensors a plan may leave out (attention's scores); none on a packed route."""
        if self.packing is not None:
            return []
        out = []
        for st in self.forward_steps:
            layer = self.network.nodes[st.node].layer
            out += [t for t in (aux_id(st.name, a) for a in layer.rebuildable_aux) if t in self.tensors]
        return out

    def with_micro_batches(self, micro_batches: int, packs: list[list[str]] | None = None) -> "Route":
        """This route cut into `micro_batches`, in `packs` or (None) the accumulate order, same menu and options."""
        return self.network.route(training=True, optimizer_slots=self.optimizer_slots, menu=self.menu,
                                  fused_update=True, micro_batches=micro_batches, packs=packs,
                                  math=self.math).with_options(self.options)

    def with_options(self, options: PlanOptions) -> "Route":
        """This route planned under `options`: a copy (the cached route is shared and never changes). It keeps
        the memo: the analyses there (liveness, bounds, step costs) do not depend on how tensors are placed.
        The options' math mode must store as the route's does (the dtypes are the route's)."""
        if precision(options.math).half != precision(self.math).half:
            raise ValueError(f"a route built for --math {self.math} planned under --math {options.math}: build "
                             f"the route in that mode (Network.route(math=...))")
        return self if options == self.options else replace(self, options=options)

    def without_aux(self, aux: Sequence[str]) -> "Route":
        """A new route without the aux tensors `aux`, which their layers rebuild in backward (same bits); step
        indices are kept."""
        drop = set(aux)
        others = drop - set(self.rebuildable_aux())
        if others:
            raise ValueError(f"not rebuildable aux tensors of this route: {sorted(others)}")
        steps = [replace(st, reads=[t for t in st.reads if t not in drop],
                         writes=[t for t in st.writes if t not in drop])
                 if drop & (set(st.reads) | set(st.writes)) else st for st in self.steps]
        return replace(self, steps=steps, tensors={k: v for k, v in self.tensors.items() if k not in drop}, memo={})

    def persistent_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values() if t.role.persistent)

    # -- construction
    @staticmethod
    def build(net: "Network", training: bool = True, optimizer_slots: Sequence[str] = (),
              menu=CPU_MENU, fused_update: bool = False, math: str = "fp32") -> "Route":
        """The plain route of `net` (`build_route` with one micro-batch and no packs)."""
        return build_route(net, training, optimizer_slots, menu, fused_update, math=math)


@dataclass(slots=True)
class Packing:
    """How a micro-batched route was cut: `blocks` are the (first, last) steps of each pack's forward and backward
    block, `shapes` each node's for one micro-batch."""

    micro_batches: int
    micro_batch: int
    packs: list[list[str]]
    blocks: list[tuple[int, int]] = field(default_factory=list)
    shapes: dict[int, tuple[list[tuple[int, ...]], tuple[int, ...]]] = field(default_factory=dict)
    schedule: str = "packs"
    """"packs": Harmony's order (every micro-batch through a pack, re-forward in backward); "accumulate": each
    micro-batch's forward then its backward, gradients summed, no re-forward (`packs` and `blocks` empty)."""


def micro_shapes(net: "Network", b: int) -> dict[int, tuple[list[tuple[int, ...]], tuple[int, ...]]]:
    """(input shapes, output shape) of every node for a micro-batch of `b` samples (shape inference again)."""
    out: dict[int, tuple[int, ...]] = {}
    res = {}
    for n in net.nodes:
        if n.layer is None:
            out[n.index] = (b,) + tuple(n.shape[1:])
            res[n.index] = ([], out[n.index])
            continue
        ins = [out[i] for i in n.inputs]
        out[n.index] = tuple(n.layer.infer_shape(ins))
        res[n.index] = (ins, out[n.index])
    return res


def requires_grad(net: "Network") -> list[bool]:
    """Per node: whether its output's delta is needed (a trainable parameter in it or before it)."""
    rg = [False] * len(net.nodes)
    for n in net.nodes:
        if n.layer is not None:
            rg[n.index] = any(p.trainable for p in n.params.values()) or bool(n.tied) or any(
                rg[i] for k, i in enumerate(n.inputs) if k not in n.layer.nondiff_inputs)
    return rg


def build_route(net: "Network", training: bool = True, optimizer_slots: Sequence[str] = (), menu=CPU_MENU,
                fused_update: bool = False, micro_batches: int = 1,
                packs: Sequence[Sequence[str]] | None = None, math: str = "fp32") -> Route:
    """Every route: `packs` given, Harmony's; None, the plain route or (micro-batches) the accumulate schedule.
    `menu` is asked once per step for its algorithms, so every planner pass reads the same ones. `math` sets each
    tensor's dtype (`backend.precision`): in a half mode one `Role.WEIGHT_COPY` per master a product reads, and
    on the CPU each step's float32 staging (`layers.staging`); a layer without a half kernel is an OptionError."""
    return _RouteBuilder(net, training, tuple(optimizer_slots), menu, fused_update, int(micro_batches),
                         packs, math).build()


class _RouteBuilder:
    """One `build_route` call's state: tensors, steps, and per micro-batch the deltas already written."""

    def __init__(self, net, training, optimizer_slots, menu, fused_update, micro_batches, packs, math):
        self.net, self.nodes, self.training, self.slots, self.menu = net, net.nodes, training, optimizer_slots, menu
        self.math, self.prec = math, precision(math)
        self.half = self.prec.half
        self.tracer = None   # the backend whose half kernels' staging the steps take (the CPU's), or None
        if self.half is not None:
            if net.dtype != np.float32:
                raise OptionError(f"--math {math}: network '{net.name}' is {net.dtype}; the half-precision modes "
                                  f"train a float32 network (float32 masters, half activations)")
            if backend_name(menu) == "cpu":
                from ..backend.cpu.backend import CPUBackend

                self.tracer = CPUBackend(menu)
                check_half_kernels([n.layer for n in net.layer_nodes], self.tracer, math)
        self.ws_itemsize = self.prec.workspace_itemsize(self.tracer is not None) if self.half is not None \
            else net.dtype.itemsize
        self.copies: dict[str, str] = {}
        self.packed = packs is not None
        self.M = micro_batches
        self.accumulate = training and not self.packed and micro_batches > 1
        self.packs = [list(p) for p in packs] if self.packed else [[n.name] for n in net.layer_nodes]
        self.fused = self.packed or self.accumulate or (fused_update and training)
        self.shapes = micro_shapes(net, net.input_nodes[0].shape[0] // self.M)
        self.pack_of = {net.node(name).index: k for k, p in enumerate(self.packs) for name in p}
        self.rg = requires_grad(net)
        self.tensors: dict[str, TensorSpec] = {}
        self.steps: list[Step] = []
        self.aux: dict[tuple[int, int], list[tuple[str, str]]] = {}  # (node, micro) -> [(canonical id, id)]
        self.seen: list[set[str]] = [set() for _ in range(self.M)]
        self.blocks: list[tuple[int, int]] = []
        self.tied_in = tied_contributions(net)

    def micro(self, tid: str, m: int, again: bool = False) -> str:
        return micro_id(tid, m if self.packed or self.accumulate else None, again)

    def add(self, tid: str, role: Role, shape, dtype, owner: str) -> str:
        if tid not in self.tensors:
            self.tensors[tid] = TensorSpec(tid, role, tuple(shape), np.dtype(dtype), owner)
        return tid

    def stored(self, role: Role, node, dtype, aux: str | None = None) -> np.dtype:
        """The dtype a float tensor of `role` belonging to `node` is stored in: `dtype` (the network's) in a
        float32 mode, the mode's (`Precision.dtype`) in a half one; anything not floating keeps its dtype."""
        if self.half is None or not np.issubdtype(dtype, np.floating):
            return dtype
        return self.prec.dtype(role, layer=node.layer if node is not None else None, aux=aux)

    def act(self, i: int, m: int, pack: int | None = None) -> str:
        """Node i's output in micro-batch m as pack `pack` reads it (None: the forward's)."""
        src = self.nodes[i]
        again = pack is not None and src.layer is not None and self.pack_of[i] == pack
        role = self.act_role(src)
        return self.add(self.micro(act_id(src.name), m, again), role, self.shapes[i][1],
                        self.stored(role, src, src.dtype), src.name)

    def delta(self, tid: str, shape, node) -> str:
        """The delta `tid` of node `node`'s output (a partial one alike), stored as the mode says."""
        return self.add(tid, Role.DELTA, shape, self.stored(Role.DELTA, node, node.dtype), node.name)

    def kernel_params(self, n) -> dict[str, str]:
        """`Route.kernel_params` while the route is built: what node `n`'s kernels read for each parameter."""
        ids = n.param_ids()
        half = n.layer.half_params
        return {p: self.copies.get(t, t) if p in half else t for p, t in ids.items()}

    def weight_copies(self) -> None:
        """A half mode: one `Role.WEIGHT_COPY` per master weight some layer's kernels read in half (the owner's,
        for a tied weight)."""
        for n in self.net.layer_nodes:
            for p, tid in n.param_ids().items():
                if p in n.layer.half_params and tid not in self.copies:
                    owner, pname = n.tied.get(p, (n.name, p))
                    spec = self.tensors[tid]
                    self.copies[tid] = self.add(copy_id(owner, pname), Role.WEIGHT_COPY, spec.shape, self.half,
                                                owner)

    def staging(self, n, phase: str, m: int, ins, out_shape, writes: list[str], aux: list[str], dinputs=None,
                accumulate=()) -> str | None:
        """The staging tensor a step of node `n` writes (`phase` 'fwd', 'rfwd' or 'bwd'), added to `writes`; None
        where its kernels stage nothing (float32 modes, CUDA)."""
        if self.tracer is None:
            return None
        dtypes = [self.stored(self.act_role(src), src, src.dtype) for src in (self.nodes[i] for i in n.inputs)]
        kept = [a for a in n.layer.aux_specs(ins, training=True)
                if {self.micro(aux_id(n.name, a), m), self.micro(aux_id(n.name, a), m, True)} & set(aux)]
        nbytes = step_staging(n.layer, self.tracer, self.prec, "bwd" if phase == "bwd" else "fwd", ins, dtypes,
                              out_shape, kept_aux=kept if self.training else [],
                              wants_dinputs=None if dinputs is None else [d is not None for d in dinputs],
                              accumulate=accumulate, fold_relu=True)
        if not nbytes:
            return None
        tid = self.add(self.micro(staging_id(n.name, phase), m), Role.STAGING, (nbytes,), np.uint8, n.name)
        writes.append(tid)
        return tid

    @staticmethod
    def act_role(n) -> Role:
        if n.layer is not None:
            return Role.ACTIVATION
        return Role.DATA if np.issubdtype(n.dtype, np.floating) else Role.LABEL

    def build(self) -> Route:
        net = self.net
        for n in self.nodes:
            for m in range(self.M):
                self.act(n.index, m)
            for pname, spec in n.params.items():
                self.add(param_id(n.name, pname), Role.PARAMETER if spec.trainable else Role.BUFFER, spec.shape,
                         n.dtype if np.issubdtype(n.dtype, np.floating) else net.dtype, n.name)
        if self.half is not None:
            self.weight_copies()
        if self.accumulate:
            self.accumulated()
        else:
            for pack in self.packs:
                first = len(self.steps)
                for m in range(self.M):
                    for name in pack:
                        self.forward(net.node(name), m, again=False)
                self.blocks.append((first, len(self.steps) - 1))
            if self.training:
                self.backward()
        route = Route(net, self.training, self.steps, self.tensors, self.slots, self.rg, self.menu, self.fused,
                      math=self.math, copies=self.copies)
        b = self.shapes[net.input_nodes[0].index][1][0]
        if self.packed:
            route.packing = Packing(self.M, b, self.packs, self.blocks, self.shapes)
        elif self.accumulate:
            route.packing = Packing(self.M, b, [], [], self.shapes, schedule="accumulate")
        return route

    def accumulated(self) -> None:
        """Per micro-batch, every forward then every backward; each update after the last micro-batch's backward."""
        layers = self.net.layer_nodes
        for m in range(self.M):
            for n in layers:
                self.forward(n, m, again=False)
            for n in reversed(layers):
                if self.rg[n.index]:
                    self.backward_step(n, m, None)
                if m == self.M - 1:
                    self.update([n])

    def backward(self) -> None:
        for k in reversed(range(len(self.packs))):
            first = len(self.steps)
            pack_nodes = [self.net.node(name) for name in self.packs[k]]
            for m in range(self.M):
                if self.packed:
                    for n in pack_nodes:
                        self.forward(n, m, again=True)
                for n in reversed(pack_nodes):
                    if self.rg[n.index]:
                        self.backward_step(n, m, k if self.packed else None)
            if self.fused:
                for n in pack_nodes:
                    self.update([n])
            self.blocks.append((first, len(self.steps) - 1))
        if not self.fused:
            if not self.update(self.nodes):
                self.steps.append(Step(len(self.steps), Phase.UPDATE, None, "", [], []))

    def update(self, nodes) -> bool:
        step = update_step(len(self.steps), nodes, self.slots, self.add, self.net.dtype, self.copies)
        if step is not None:
            self.steps.append(step)
        return step is not None

    def forward(self, n, m: int, again: bool) -> None:
        """Layer n's forward on micro-batch m; `again`: its re-forward in backward."""
        layer, net = n.layer, self.net
        ins, out_shape = self.shapes[n.index]
        pack = self.pack_of[n.index] if again else None
        rename = {act_id(self.nodes[i].name): self.act(i, m, pack) for i in n.inputs}
        out = rename[act_id(n.name)] = self.act(n.index, m, pack)
        reads = [rename[act_id(self.nodes[i].name)] for i in n.inputs] + list(self.kernel_params(n).values())
        writes = [out]
        if self.training and not again:
            writes += [param_id(n.name, p) for p, s in n.params.items() if not s.trainable]
            if m == 0:  # on the whole batch's shapes
                layer.check_training([self.nodes[i].shape for i in n.inputs])
            # written even when no backward reads them; on a packed route a rebuildable one is the re-forward's
            self.aux[n.index, m] = [(aux_id(n.name, a), self.add(self.micro(aux_id(n.name, a), m), Role.AUX, shape,
                                                                 self.stored(Role.AUX, n, net.dtype, a), n.name))
                                    for a, shape in layer.aux_specs(ins, training=True).items()
                                    if not (self.packed and a in layer.rebuildable_aux)]
        for canonical, tid in self.aux.get((n.index, m), []) if self.training else ():
            rename[canonical] = tid
            (reads if again else writes).append(tid)
        if again:
            # the re-forward writes its own scores, read right after: one micro-batch's are live at a time
            for a, shape in layer.aux_specs(ins, training=True).items():
                if a in layer.rebuildable_aux:
                    tid = rename[aux_id(n.name, a)] = self.add(self.micro(aux_id(n.name, a), m, again=True),
                                                               Role.AUX, shape, self.stored(Role.AUX, n, net.dtype, a),
                                                               n.name)
                    writes.append(tid)
                    self.aux[n.index, m].append((aux_id(n.name, a), tid))
        opts = layer.workspace_options("fwd", ins, out_shape, self.ws_itemsize, self.menu)
        ws = self.add(self.micro(workspace_id(n.name, "rfwd" if again else "fwd"), m), Role.WORKSPACE, (0,),
                      np.uint8, n.name) if opts else None
        staging = self.staging(n, "rfwd" if again else "fwd", m, ins, out_shape, writes,
                               [t for t in reads + writes if self.tensors[t].role is Role.AUX])
        self.steps.append(Step(len(self.steps), Phase.FORWARD, n.index, n.name, reads, writes, ws, list(opts),
                               micro=m, recompute=again, rename=_renamed(rename), staging=staging))

    def backward_step(self, n, m: int, pack: int | None) -> None:
        """Layer n's backward on micro-batch m, reading pack `pack`'s re-forward (None: the forward's)."""
        layer, net, nodes = n.layer, self.net, self.nodes
        ins, out_shape = self.shapes[n.index]
        dout = self.delta(self.micro(delta_id(n.name), m), out_shape, n)
        rename = {delta_id(n.name): dout}
        reads = [dout]
        for k in layer.needs_inputs:
            i = n.inputs[k]
            rename[act_id(nodes[i].name)] = self.act(i, m, pack)
            reads.append(rename[act_id(nodes[i].name)])
        if layer.needs_output:
            rename[act_id(n.name)] = self.act(n.index, m, pack)
            reads.append(rename[act_id(n.name)])
        for canonical, tid in self.aux.get((n.index, m), []):
            rename[canonical] = tid
            reads.append(tid)
        aux = [t for t in reads if self.tensors[t].role is Role.AUX]
        reads += list(self.kernel_params(n).values())
        writes: list[str] = []
        dinputs: list[str | None] = []
        accs: list[Accumulation] = []
        for k, i in enumerate(n.inputs):
            src = nodes[i]
            if k in layer.nondiff_inputs or not self.rg[i]:
                dinputs.append(None)
                continue
            d = self.micro(delta_id(src.name), m)
            if d not in self.seen[m]:
                self.seen[m].add(d)
                target = self.delta(d, self.shapes[i][1], src)
            elif layer.accumulates_in_place:
                accs.append(Accumulation(None, d, slot=k))
                target = d
            else:
                target = self.delta(self.micro(partial_delta_id(src.name, n.name, k), m), self.shapes[i][1], src)
                accs.append(Accumulation(target, d))
            dinputs.append(target)
            writes.append(target)
        own = [(p, s.shape) for p, s in n.params.items() if s.trainable]
        own += [(p, net.node(o).params[op].shape) for p, (o, op) in n.tied.items()]  # this layer's contribution
        for pname, shape in own:
            g = self.add(grad_id(n.name, pname), Role.GRADIENT, shape, net.dtype, n.name)
            if m:  # micro-batch m > 0 writes its own gradient, added into the gradient right after
                part = rename[g] = self.add(self.micro(g, m), Role.GRADIENT, shape, net.dtype, n.name)
                accs.append(Accumulation(part, g))
                writes.append(part)
            else:
                writes.append(g)
        if m == self.M - 1:  # the tied users' contributions, once all their micro-batches ran
            for part, into in self.tied_in.get(n.index, ()):
                reads.append(part)
                accs.append(Accumulation(part, into))
        step = Step(len(self.steps), Phase.BACKWARD, n.index, n.name, reads, writes, None, [], dinputs, accs,
                    micro=m, rename=_renamed(rename))
        opts = layer.workspace_options("bwd", ins, out_shape, self.ws_itemsize, self.menu,
                                       accumulate=step.accumulates_into)
        if opts:
            step.workspace = self.add(self.micro(workspace_id(n.name, "bwd"), m), Role.WORKSPACE, (0,), np.uint8,
                                      n.name)
            step.workspace_options = list(opts)
        step.staging = self.staging(n, "bwd", m, ins, out_shape, writes, aux, dinputs, sorted(step.accumulates_into))
        if layer.is_loss:
            step.seed_delta = dout
        self.steps.append(step)


def _renamed(rename: dict[str, str]) -> dict[str, str]:
    """A step's renames, without identities."""
    return {k: v for k, v in rename.items() if k != v}


def tied_contributions(net: "Network") -> dict[int, list[tuple[str, str]]]:
    """Owner node -> [(a tied user's gradient contribution, the owner's gradient it is added into)]."""
    out: dict[int, list[tuple[str, str]]] = {}
    for n in net.layer_nodes:
        for pname, (owner, oname) in n.tied.items():
            out.setdefault(net.node(owner).index, []).append((grad_id(n.name, pname), grad_id(owner, oname)))
    return out


def update_step(index: int, nodes, optimizer_slots: Sequence[str], add, dtype,
                copies: dict[str, str] | None = None) -> Step | None:
    """The optimizer update of `nodes`' trainable parameters (None if they have none), which rewrites their half
    copies (`copies`: master id -> copy id). One node: a fused per-layer update, named after its layer; several:
    the whole-network update step."""
    reads: list[str] = []
    writes: list[str] = []
    for n in nodes:
        for pname, spec in n.params.items():
            if not spec.trainable:
                continue
            p = param_id(n.name, pname)
            reads += [p, grad_id(n.name, pname)]
            writes.append(p)
            if copies and p in copies:
                writes.append(copies[p])
            for slot in optimizer_slots:
                s = add(opt_state_id(n.name, pname, slot), Role.OPTIMIZER, spec.shape, dtype, n.name)
                reads.append(s)
                writes.append(s)
    if not writes:
        return None
    if len(nodes) == 1:
        return Step(index, Phase.UPDATE, nodes[0].index, nodes[0].name, reads, writes)
    return Step(index, Phase.UPDATE, None, "", reads, writes)
