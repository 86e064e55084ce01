"""The layer table `minidl info` prints and `Network.summary()` returns, from the nodes alone (no plan, no arrays:
instant even for ResNet-2500)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..core.units import format_bytes

if TYPE_CHECKING:
    from .network import Network

WEIGHTED_TYPES = ("conv", "linear")
"""Layer types counted as "weighted" (the ResNet/VGG papers' depth)."""


@dataclass(frozen=True, slots=True)
class LayerRow:
    """One node of the table."""

    name: str
    type: str
    output_shape: tuple[int, ...]
    params: int
    flops: int
    output_bytes: int


@dataclass(frozen=True, slots=True)
class NetworkSummary:
    """The table and its totals; `repr()` is the printed table, `to_json()` what `minidl info --json` prints."""

    name: str
    rows: tuple[LayerRow, ...]
    params: int
    layers: int
    weighted_layers: int
    forward_flops: int
    input_shape: tuple[int, ...]

    def format(self) -> str:
        """The table, one line per node, then one line of totals."""
        lines = [f"{'name':<28} {'type':<13} {'output shape':<22} {'params':>12} {'FLOPs':>15} {'out bytes':>12}"]
        for r in self.rows:
            lines.append(f"{r.name[:28]:<28} {r.type:<13} {str(tuple(r.output_shape)):<22} {r.params:>12,} "
                         f"{r.flops:>15,} {format_bytes(r.output_bytes):>12}")
        lines.append("")
        lines.append(f"{self.name}: {self.params:,} parameters, {self.layers} layers ({self.weighted_layers} "
                     f"weighted), {self.forward_flops / 1e9:.2f} GFLOPs forward")
        return "\n".join(lines)

    __str__ = format

    def __repr__(self) -> str:
        return self.format()

    def to_json(self) -> dict:
        """The documented keys of `minidl info --json`, plain types only."""
        table = [{**asdict(r), "output_shape": list(r.output_shape)} for r in self.rows]
        return {"params": self.params, "layers": self.layers, "weighted_layers": self.weighted_layers,
                "forward_flops": self.forward_flops, "input_shape": list(self.input_shape), "table": table}


def summarize(net: Network, name: str | None = None) -> NetworkSummary:
    """The layer table of `net`, titled `name` or the network's name."""
    rows = []
    for n in net.nodes:
        in_shapes = [net.nodes[i].shape for i in n.inputs]
        params = sum(math.prod(p.shape) for p in n.params.values() if p.trainable)
        flops = n.layer.flops(in_shapes, n.shape) if n.layer else 0
        rows.append(LayerRow(n.name, n.type_name, tuple(n.shape), int(params), int(flops),
                             int(math.prod(n.shape)) * n.dtype.itemsize))
    weighted = sum(1 for n in net.layer_nodes if n.type_name in WEIGHTED_TYPES)
    return NetworkSummary(name or net.name, tuple(rows), net.num_params(), len(net.layer_nodes), weighted,
                          net.forward_flops(), tuple(net.input_nodes[0].shape))
