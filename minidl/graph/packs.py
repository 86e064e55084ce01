"""Layer packs and micro-batches (Harmony): the route that lets weights be brought in once per pack per step.

With M micro-batches and the layers cut into packs of consecutive layers, one training step is:

    for each pack, in order:              forward of the pack's layers, micro-batch 1, then 2, ... M
    for each pack, in reverse order:      for each micro-batch: re-run the pack's forward from its stashed
                                          inputs, then the pack's backward
                                          then the update of the pack's layers (fused: once per step)

So a pack's weights are used in one block of consecutive steps in forward and one in backward, whatever M is:
the weights decision (`memory/decisions/weights.py`) brings them in once per block. Between its forward and
its backward a micro-batch keeps only the pack's *inputs* (the stash: tensors produced outside the pack that its
layers read, plus BN's per-micro-batch statistics); every activation inside a pack is produced again by the
re-forward, into tensors of their own (`act:X@<m>r`), so liveness frees the forward's copies at once. The
stash is an ordinary activation: the tensor cache may offload it like any other.

Rules the code keeps:
- Tensor ids: a micro-batch's activations, deltas, BN statistics and workspaces carry `@m`; the re-forward's
  outputs `@mr`. Parameters, buffers and optimizer slots are shared. Micro-batch m > 0 writes its weight
  gradients into `grad:...@m`, added into the gradient right after (an `Accumulation`, like a fork's partial
  delta), so gradients sum over micro-batches in a fixed order: micro-batch 1, 2, ... M.
- Each step carries `rename` (canonical id -> this step's id), so the executor asks for `act:conv1` and gets
  the micro-batch's own tensor: layers and the executor's dispatch stay unaware of micro-batching.
- The loss of each micro-batch is the mean over its b = N / M samples; its backward is seeded with 1 / M, so
  the summed gradient is the full batch's mean-loss gradient, to float rounding (the sum order differs).
  Results equal the same micro-batching under policy `none` bit for bit.
- BatchNorm with micro-batches normalizes each micro-batch with its own statistics (as GPipe and Harmony do)
  and updates the running statistics once per micro-batch (M times per step); its re-forward reuses the saved
  statistics and leaves the running ones alone. With M = 1 it is exactly the plain route's BN.
- Dropout draws a mask per (layer, step, micro-batch); the re-forward replays it.
- The route is always fused: each backward pack is followed at once by its layers' updates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..backend import backend_name
from ..core.errors import MinidlError
from ..core.tensors import Role, TensorSpec, act_id, aux_id, delta_id, grad_id, param_id, partial_delta_id
from .route import Accumulation, Phase, Route, Step, tied_contributions, update_step

if TYPE_CHECKING:  # pragma: no cover
    from .network import Network


class PackError(MinidlError, ValueError):
    """A micro-batch count or a packing that cannot be built (names the values)."""


@dataclass(slots=True)
class Packing:
    """How a packed route was cut: M micro-batches of `micro_batch` samples; `packs` lists each pack's layer
    names; `blocks` the (first, last) step of each pack's forward block and backward block."""

    micro_batches: int
    micro_batch: int
    packs: list[list[str]]
    blocks: list[tuple[int, int]] = field(default_factory=list)
    shapes: dict[int, tuple[list[tuple[int, ...]], tuple[int, ...]]] = field(default_factory=dict)


def micro_shapes(net: "Network", b: int) -> dict[int, tuple[list[tuple[int, ...]], tuple[int, ...]]]:
    """(input shapes, output shape) of every node for a micro-batch of `b` samples, by re-running shape
    inference from the inputs (a layer's output shape is a pure function of its input shapes)."""
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


def even_packs(net: "Network", n_packs: int) -> list[list[str]]:
    """`n_packs` packs of consecutive layers, cut so each holds about the same weight bytes (a layer without
    weights joins the pack of the layer before it)."""
    layers = net.layer_nodes
    wbytes = [sum(int(np.prod(p.shape)) for p in n.params.values() if p.trainable) for n in layers]
    total = sum(wbytes) or 1
    n_packs = max(1, min(n_packs, len(layers)))
    packs: list[list[str]] = [[]]
    acc = 0
    for n, w in zip(layers, wbytes):
        if packs[-1] and w and acc >= total * len(packs) / n_packs and len(packs) < n_packs:
            packs.append([])
        packs[-1].append(n.name)
        acc += w
    return packs


def build_packed(net: "Network", micro_batches: int, packs: Sequence[Sequence[str]] | None = None,
                 optimizer_slots: Sequence[str] = (), backend=None) -> Route:
    """The training route of `net` with `micro_batches` micro-batches and `packs` (layer names, consecutive in
    topological order, covering every layer; default: one pack per layer)."""
    nodes = net.nodes
    batch = net.input_nodes[0].shape[0]
    M = int(micro_batches)
    if M < 1 or batch % M:
        raise PackError(f"micro-batches: {M} does not divide the batch of {batch} (network '{net.name}')")
    b = batch // M
    layer_names = [n.name for n in net.layer_nodes]
    packs = [[n] for n in layer_names] if packs is None else [list(p) for p in packs]
    flat = [n for p in packs for n in p]
    if flat != layer_names or any(not p for p in packs):
        raise PackError(f"packs must list every layer of '{net.name}' once, in order, in non-empty packs; got "
                        f"{len(flat)} names for {len(layer_names)} layers")
    if net.loss_node.name not in packs[-1]:
        raise PackError("the loss layer must be in the last pack")
    shapes = micro_shapes(net, b)
    pack_of = {net.node(n).index: k for k, p in enumerate(packs) for n in p}
    tensors: dict[str, TensorSpec] = {}

    def add(tid: str, role: Role, shape, dtype, owner: str) -> str:
        if tid not in tensors:
            tensors[tid] = TensorSpec(tid, role, tuple(shape), np.dtype(dtype), owner)
        return tid

    rg = [False] * len(nodes)
    for n in nodes:
        if n.layer is None:
            continue
        rg[n.index] = any(p.trainable for p in n.params.values()) or bool(n.tied) or any(
            rg[i] for k, i in enumerate(n.inputs) if k not in n.layer.nondiff_inputs)

    def act(i: int, m: int, pack: int | None = None) -> str:
        """The id of node i's output for micro-batch m, as seen from pack `pack`'s re-forward/backward."""
        src = nodes[i]
        again = pack is not None and src.layer is not None and pack_of[src.index] == pack
        tid = f"{act_id(src.name)}@{m}{'r' if again else ''}"
        role = (Role.DATA if np.issubdtype(src.dtype, np.floating) else Role.LABEL) if src.layer is None \
            else Role.ACTIVATION
        return add(tid, role, shapes[i][1], src.dtype, src.name)

    for n in nodes:
        for pname, spec in n.params.items():
            role = Role.PARAMETER if spec.trainable else Role.BUFFER
            add(param_id(n.name, pname), role, spec.shape,
                n.dtype if np.issubdtype(n.dtype, np.floating) else net.dtype, n.name)
    for n in net.input_nodes:
        for m in range(M):
            act(n.index, m)

    steps: list[Step] = []
    blocks: list[tuple[int, int]] = []
    itemsize = net.dtype.itemsize

    def fwd_step(n, m: int, again: bool) -> Step:
        layer = n.layer
        ins, out_shape = shapes[n.index]
        pack = pack_of[n.index] if again else None
        rename = {act_id(nodes[i].name): act(i, m, pack) for i in n.inputs}
        out = act(n.index, m, pack)
        rename[act_id(n.name)] = out
        reads = [rename[act_id(nodes[i].name)] for i in n.inputs] + list(n.param_ids().values())
        writes = [out]
        if not again:
            writes += [param_id(n.name, p) for p, s in n.params.items() if not s.trainable]
        if rg[n.index]:
            for aname, ashape in layer.aux_specs(ins, training=True).items():
                tid = add(f"{aux_id(n.name, aname)}@{m}", Role.AUX, ashape, net.dtype, n.name)
                rename[aux_id(n.name, aname)] = tid
                (reads if again else writes).append(tid)
        opts = layer.workspace_options("fwd", ins, out_shape, itemsize, backend=backend)
        ws = add(f"ws:{n.name}.{'rfwd' if again else 'fwd'}@{m}", Role.WORKSPACE, (0,), np.uint8, n.name) \
            if opts else None
        return Step(len(steps), Phase.FORWARD, n.index, n.name, reads, writes, ws, list(opts), micro=m,
                    recompute=again, rename=rename)

    # forward: pack by pack, every micro-batch through a pack before the next pack
    for pack in packs:
        first = len(steps)
        for m in range(M):
            for name in pack:
                steps.append(fwd_step(net.node(name), m, again=False))
        blocks.append((first, len(steps) - 1))

    tied_in = tied_contributions(net)
    seen: list[set[str]] = [set() for _ in range(M)]
    for k in reversed(range(len(packs))):
        first = len(steps)
        pack_nodes = [net.node(name) for name in packs[k]]
        for m in range(M):
            for n in pack_nodes:
                steps.append(fwd_step(n, m, again=True))
            for n in reversed(pack_nodes):
                if not rg[n.index]:
                    continue
                steps.append(_bwd_step(net, n, m, M, k, len(steps), rg, shapes, act, add, seen[m], backend,
                                       tied_in.get(n.index, ()) if m == M - 1 else ()))
        for n in pack_nodes:
            upd = update_step(len(steps), [n], optimizer_slots, add, net.dtype)
            if upd is not None:
                steps.append(upd)
        blocks.append((first, len(steps) - 1))

    route = Route(net, True, steps, tensors, tuple(optimizer_slots), rg, backend_name(backend), fused_update=True,
                  backend=backend)
    route.packing = Packing(M, b, [list(p) for p in packs], blocks, shapes)
    return route


def _bwd_step(net, n, m: int, M: int, pack: int, index: int, rg, shapes, act, add, seen: set[str],
              backend, tied_in=()) -> Step:
    """Layer `n`'s backward for micro-batch m. `tied_in`: the tied users' gradient contributions its owner adds
    in (`route.tied_contributions`), at the last micro-batch: every micro-batch of the users has run by then,
    whether they share the owner's pack or sit in a later one."""
    nodes = net.nodes
    layer = n.layer
    ins, out_shape = shapes[n.index]
    dout = add(f"{delta_id(n.name)}@{m}", Role.DELTA, out_shape, n.dtype, n.name)
    rename = {delta_id(n.name): dout}
    reads = [dout]
    for k in layer.needs_inputs:
        i = n.inputs[k]
        rename[act_id(nodes[i].name)] = act(i, m, pack)
        reads.append(rename[act_id(nodes[i].name)])
    if layer.needs_output:
        rename[act_id(n.name)] = act(n.index, m, pack)
        reads.append(rename[act_id(n.name)])
    for aname in layer.aux_specs(ins, training=True):
        tid = f"{aux_id(n.name, aname)}@{m}"
        rename[aux_id(n.name, aname)] = tid
        reads.append(tid)
    reads += list(n.param_ids().values())
    writes: list[str] = []
    dinputs: list[str | None] = []
    accs: list[Accumulation] = []
    for k, i in enumerate(n.inputs):
        src = nodes[i]
        if k in layer.nondiff_inputs or not rg[i]:
            dinputs.append(None)
            continue
        d = f"{delta_id(src.name)}@{m}"
        if d not in seen:
            seen.add(d)
            target = add(d, Role.DELTA, shapes[i][1], src.dtype, src.name)
        else:
            target = add(f"{partial_delta_id(src.name, n.name, k)}@{m}", Role.DELTA, shapes[i][1], src.dtype,
                         src.name)
            accs.append(Accumulation(target, d))
        dinputs.append(target)
        writes.append(target)
    own = [(p, s.shape) for p, s in n.params.items() if s.trainable]
    own += [(p, net.node(o).params[op].shape) for p, (o, op) in n.tied.items()]
    for pname, shape in own:
        g = add(grad_id(n.name, pname), Role.GRADIENT, shape, net.dtype, n.name)
        if m:
            part = add(f"{g}@{m}", Role.GRADIENT, shape, net.dtype, n.name)
            rename[g] = part
            accs.append(Accumulation(part, g))
            writes.append(part)
        else:
            writes.append(g)
    for part, into in tied_in:
        reads.append(part)
        accs.append(Accumulation(part, into))
    opts = layer.workspace_options("bwd", ins, out_shape, net.dtype.itemsize, backend=backend)
    ws = add(f"ws:{n.name}.bwd@{m}", Role.WORKSPACE, (0,), np.uint8, n.name) if opts else None
    step = Step(index, Phase.BACKWARD, n.index, n.name, reads, writes, ws, list(opts), dinputs, accs, micro=m,
                rename=rename)
    if layer.is_loss:
        step.seed_delta = dout
    return step
