"""`Symbol`, the handle a layer call returns while building: beneath `layers` and `graph`, so neither imports the
other (a layer reaches the network through its input symbols)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from ..graph.network import Network, Node

Shape = tuple[int, ...]


class Symbol:
    """A node's output while building; its shape lets the next layer check."""

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
