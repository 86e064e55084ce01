"""Layer packs and micro-batches (Harmony): forward pack by pack; backward packs in reverse, each micro-batch
re-running the pack's forward from its stashed inputs, then its backward and the pack's updates.

Rules:
- Between forward and backward a micro-batch keeps only a pack's inputs (the stash); the re-forward remakes the
  rest into tensors of its own (`@mr`; a micro-batch's are `@m`, spelled by `core.tensors.micro_id` alone).
- Gradients sum over micro-batches in the order 1..M, each backward seeded with 1/M: bit-identical to the same
  micro-batching under policy `none`. BatchNorm uses each micro-batch's statistics (as GPipe) and updates the
  running ones M times a step, never in a re-forward; dropout's mask is per micro-batch, replayed by the re-forward.
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
    """`n_packs` packs of consecutive layers with about the same weight bytes each."""
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
    """Every layer must train on one micro-batch's shapes: refused when planning, not in the first kernel."""
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
