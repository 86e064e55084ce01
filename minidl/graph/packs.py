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
re-forward, into tensors of their own (`act:X@<m>r`), so liveness frees the forward's copies at once. So are
attention's scores (a layer's `rebuildable_aux`): the forward does not keep them, the re-forward writes them
(`aux:X.probs@<m>r`) for the micro-batch's backward right after, so one micro-batch's B H T^2 values are live at a
time, not the whole batch's. The stash is an ordinary activation: the tensor cache may offload it like any other.

Rules the code keeps:
- Tensor ids: a micro-batch's activations, deltas, BN statistics and workspaces carry `@m`; the re-forward's
  outputs `@mr`. Parameters, buffers and optimizer slots are shared. Micro-batch m > 0 writes its weight
  gradients into `grad:...@m`, added into the gradient right after (an `Accumulation`, like a fork's partial
  delta), so gradients sum over micro-batches in a fixed order: micro-batch 1, 2, ... M.
- Each step carries `rename` (canonical id -> this step's id), so the executor asks for `act:conv1` and gets
  the micro-batch's own tensor: layers and the executor's dispatch stay unaware of micro-batching. The ids are
  spelled by `core.tensors.micro_id` alone.
- The route is built by `route.build_route`, the builder of every route: the plain route is its one-micro-batch
  case (canonical ids, no re-forward); this module cuts the packs and checks them.
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

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..backend.cpu.menu import CPU_MENU
from ..core.errors import GraphError, MinidlError
from .route import Packing, Route, build_route, micro_shapes

if TYPE_CHECKING:  # pragma: no cover
    from .network import Network

__all__ = ["PackError", "Packing", "build_packed", "even_packs", "micro_shapes"]


class PackError(MinidlError, ValueError):
    """A micro-batch count or a packing that cannot be built (names the values)."""


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


def _check_micro_training(net: "Network", M: int) -> None:
    """Every layer must train on one micro-batch's shapes, as it must on the batch's (BN on one value per channel
    fails here, when planning, not in the first step's kernel)."""
    shapes = micro_shapes(net, net.input_nodes[0].shape[0] // M)
    for n in net.layer_nodes:
        try:
            n.layer.check_training(shapes[n.index][0])
        except GraphError as e:
            raise PackError(f"{M} micro-batches of the batch of {net.input_nodes[0].shape[0]}: {e}; give fewer "
                            f"micro-batches") from None


def build_packed(net: "Network", micro_batches: int, packs: Sequence[Sequence[str]] | None = None,
                 optimizer_slots: Sequence[str] = (), menu=CPU_MENU, math: str = "fp32") -> Route:
    """The training route of `net` with `micro_batches` micro-batches and `packs` (layer names, consecutive in
    topological order, covering every layer), built by `route.build_route`; `packs` None: no packs, the accumulate
    schedule (each micro-batch's forward, then its backward: `route.py`)."""
    batch = net.input_nodes[0].shape[0]
    M = int(micro_batches)
    if M < 1 or batch % M:
        raise PackError(f"micro-batches: {M} does not divide the batch of {batch} (network '{net.name}')")
    _check_micro_training(net, M)
    if packs is None:
        return build_route(net, True, optimizer_slots, menu, True, M, None, math)
    layer_names = [n.name for n in net.layer_nodes]
    packs = [list(p) for p in packs]
    flat = [n for p in packs for n in p]
    if flat != layer_names or any(not p for p in packs):
        raise PackError(f"packs must list every layer of '{net.name}' once, in order, in non-empty packs; got "
                        f"{len(flat)} names for {len(layer_names)} layers")
    if net.loss_node.name not in packs[-1]:
        raise PackError("the loss layer must be in the last pack")
    return build_route(net, True, optimizer_slots, menu, True, M, packs, math)
