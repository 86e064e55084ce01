"""`Symbol`: the handle a layer call returns while a network is being built.

It lives on its own, beneath both `layers` (whose `Layer.__call__` checks its inputs are Symbols) and `graph`
(whose `Network` creates them), so neither has to import the other: the layer asks the symbol's network to add
the node, and the network is only ever reached through the symbol.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from ..graph.network import Network, Node

Shape = tuple[int, ...]


class Symbol:
    """A handle to a node's output while building: carries the shape so the next layer can check it."""

    __slots__ = ("network", "index")

    def __init__(self, network: "Network", index: int):
        self.network = network
        self.index = index

    @property
    def node(self) -> "Node":
        return self.network.nodes[self.index]

    @property
    def shape(self) -> Shape:
        return self.node.shape

    @property
    def dtype(self) -> np.dtype:
        return self.node.dtype

    @property
    def name(self) -> str:
        return self.node.name

    def __repr__(self) -> str:
        return f"Symbol({self.name!r}, shape={self.shape}, dtype={np.dtype(self.dtype).name})"
