"""The compress decision (COMET): stored activations wait for backward as an error-bounded stream in the pool.

t becomes: ALLOC .. COMPRESS z:<t>, FREE t .. DECOMPRESS t, FREE z:<t> .. FREE, each pair sequenced so both blocks
coexist only for the copy. Rules: only float tensors whose every backward reader has a known response to a bounded
error (`errorbound.ReaderKind`). Each stream reserves min(raw, raw / ratio x `MARGIN`) + `sz.HEADER_BYTES`; a
larger stream spills to host memory, never past the budget. The codec runs on the host on both backends for now.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ...codec.sz import HEADER_BYTES
from ...core.tensors import Role, act_id, compressed_id, compressed_source
from ...graph.route import Phase, Route
from ..errorbound import Reader, ReaderKind
from ..liveness import tensor_uses
from ..plan import EventKind, Plan
from ..planner import Residency, Schedule, WorkspaceChoice, default_workspace, liveness_schedule, make_plan
from . import offload

DEFAULT_RATIO = 2.5
"""Ratio assumed unmeasured: below ResNet-20's 4.1-4.6 per layer type (benchmarks/results/compression.json)."""

MARGIN = 1.25
"""Reserve this much above the measured size: data and the adaptive bound drift in training."""

_READER_KINDS = {("Conv2d", "input"): ReaderKind.BILINEAR, ("Linear", "input"): ReaderKind.BILINEAR,
                 ("BatchNorm2d", "input"): ReaderKind.NORMALIZE, ("ReLU", "output"): ReaderKind.SIGN}


@dataclass(slots=True)
class Compressible:
    tensor: str
    nbytes: int
    last_forward: int
    first_backward: int
    base: Residency
    readers: list[Reader]


def backward_readers(route: Route) -> dict[str, list[Reader] | None]:
    """Per tensor a backward step reads: its readers, or None if the bound cannot account for one of them."""
    net = route.network
    out: dict[str, list[Reader] | None] = {}
    for step in route.steps:
        if step.phase is not Phase.BACKWARD or step.node is None:
            continue
        node = net.nodes[step.node]
        layer = node.layer
        uses = [(act_id(net.nodes[i].name), "input") for k, i in enumerate(node.inputs) if k in layer.needs_inputs]
        if layer.needs_output:
            uses.append((act_id(node.name), "output"))
        for tid, what in uses:
            kind = _READER_KINDS.get((type(layer).__name__, what))
            if tid in out and out[tid] is None:
                continue
            out[tid] = None if kind is None else out.get(tid, []) + [Reader(node.name, kind)]
    return out


def find_candidates(route: Route, base: Schedule, exclude=()) -> list[Compressible]:
    """Tensors the bound allows to be compressed, in route order; `exclude`: read in backward by an unknown reader
    (a recomputation's checkpoint)."""
    uses = tensor_uses(route)
    readers = backward_readers(route)
    out: list[Compressible] = []
    for tid, lst in base.residencies.items():
        spec = route.tensors.get(tid)
        if (spec is None or tid in exclude or spec.role not in (Role.ACTIVATION, Role.DATA) or len(lst) != 1
                or np.dtype(spec.dtype) not in (np.float32, np.float64) or not readers.get(tid)):
            continue
        r = lst[0]
        if r.start_kind is not EventKind.ALLOC or r.end_kind is not EventKind.FREE:
            continue
        fwd = [k for k in uses.get(tid, ()) if route.steps[k].phase is Phase.FORWARD]
        bwd = [k for k in uses.get(tid, ()) if route.steps[k].phase is not Phase.FORWARD]
        if not fwd or not bwd or bwd[0] - fwd[-1] < 2 or fwd[-1] < r.start or bwd[0] > r.end:
            continue
        out.append(Compressible(tid, spec.nbytes, fwd[-1], bwd[0], r, readers[tid]))
    out.sort(key=lambda c: (c.last_forward, c.tensor))
    return out


def reserve_bytes(nbytes: int, ratio: float | None) -> int:
    """Bytes reserved for the stream of a tensor of `nbytes` expected to compress `ratio`-fold."""
    r = DEFAULT_RATIO if ratio is None or not math.isfinite(ratio) or ratio <= 0 else ratio
    return min(nbytes, math.ceil(nbytes / r * MARGIN)) + HEADER_BYTES


def compress_schedule(base: Schedule, chosen: list[Compressible], ratios: dict[str, float] | None = None,
                      offloadable: bool = False) -> Schedule:
    """`base` with each chosen tensor stored compressed between its uses; `offloadable` leaves the first place of
    the decompression's sequence to the stream's prefetch and wait."""
    res = dict(base.residencies)
    sizes = dict(base.sizes)
    ratios = ratios or {}
    d = 1 if offloadable else 0
    for c in chosen:
        b, z = c.base, compressed_id(c.tensor)
        sizes[z] = reserve_bytes(c.nbytes, ratios.get(c.tensor))
        res[c.tensor] = [
            Residency(b.start, b.start_at, b.start_kind, c.last_forward, "after", EventKind.FREE,
                      f"stored compressed as {z} until step {c.first_backward}", start_seq=b.start_seq, end_seq=2),
            Residency(c.first_backward, "before", EventKind.DECOMPRESS, b.end, b.end_at, b.end_kind,
                      f"decompressed from {z} for its backward readers "
                      f"({', '.join(r.node for r in c.readers)})", start_seq=1 + d, end_seq=b.end_seq),
        ]
        res[z] = [Residency(c.last_forward, "after", EventKind.COMPRESS, c.first_backward, "before", EventKind.FREE,
                            f"{c.tensor} compressed (reserved for ratio "
                            f"{ratios.get(c.tensor, DEFAULT_RATIO):.2f} x margin {MARGIN})", start_seq=1,
                            end_seq=2 + d)]
    return dataclasses.replace(base, residencies=res, markers=list(base.markers), sizes=sizes)


def stream_candidates(route: Route, sched: Schedule, chosen: list[Compressible], clock) -> list[offload.Offloadable]:
    """The streams of `chosen` as tensor-cache candidates, written in the sequence after the last forward step
    (`out_seq`) and read in the one before the first backward step (`seq_read`)."""
    out = []
    for c in chosen:
        z = compressed_id(c.tensor)
        if c.first_backward - c.last_forward < 2:
            continue
        out.append(offload.Offloadable(z, sched.sizes[z], c.last_forward, c.first_backward, sched.residencies[z][0],
                                     clock.start[c.first_backward] - clock.end(c.last_forward), seq_read=True,
                                     out_seq=1))
    return out


def plan_compress(route: Route, budget: int | None, device: str = "cpu", costs=None, *,
                  ratios: dict[str, float] | None = None, workspace: dict[int, WorkspaceChoice] | None = None,
                  base: Schedule | None = None, policy: str = "compress") -> Plan:
    """Plan `route` with every eligible stored activation compressed; `ratios` (raw / compressed, from
    `CompressedStore.ratios()`) size the blocks."""
    ws = (default_workspace(route, costs) if workspace is None else workspace)
    base = liveness_schedule(route, ws) if base is None else base
    chosen = find_candidates(route, base)
    return make_plan(route, policy, budget, ws, compress_schedule(base, chosen, ratios))


def compress_policy(route: Route, budget: int | None, device: str = "cpu", costs=None) -> Plan:
    """The policy table's `compress` row (`DEFAULT_RATIO`: no data at planning time)."""
    return plan_compress(route, budget, device, costs)


def compressed_tensors(plan: Plan) -> list[str]:
    """Tensors the plan stores compressed, in route order."""
    return [compressed_source(ev.tensor) for sp in plan.steps for ev in sp.after if ev.kind is EventKind.COMPRESS]
