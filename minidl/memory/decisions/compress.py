"""The compress decision (COMET): stored activations wait for backward in compressed form, in the pool.

For each chosen tensor its single residency becomes two, with a small block for the compressed stream between:

    ALLOC (first use) .. last forward use | COMPRESS z:<t> then FREE <t> | .. z:<t> in the pool ..
        | DECOMPRESS <t> then FREE z:<t> | first backward use .. FREE

COMPRESS allocates the block `z:<t>` and encodes t into it (`codec/sz.py`, bound from `errorbound.py`); t's
block is freed right after, at the same step boundary. DECOMPRESS, right before t's first backward use,
allocates t again and decodes into it; the stream's block is freed right after. Both pairs are sequenced events
(`start_seq` / `end_seq`), so the two blocks coexist only for the instant of the copy. The codec runs on the
compute stream: it costs time (measured in `benchmarks/compression.py`) but no link bandwidth and no FLOPs of
recomputation.

**Which tensors: those the bound allows.** Activations (and the network input) with one residency that are used
in forward and again in backward with at least one step in between, and whose every backward reader tolerates
a bounded error with a known effect on the gradients (`errorbound.ReaderKind`): convolutions and linear layers
reading their input, batch norm reading its input, ReLU reading its output (only its sign, which the codec
keeps exactly). A tensor any other layer reads in backward (max-pool re-finding its argmax, LRN, the loss) stays
exact. Labels and integer tensors are never compressed.

**Reserving space for a size known only at run time.** The plan is made before any data exists, but a
compressed size depends on the data and the bound. The plan therefore reserves, per tensor,

    reserve(t) = min(raw bytes, ceil(raw bytes / ratio(t) * MARGIN)) + sz.HEADER_BYTES

where ratio(t) is the compression ratio *measured* for t (`Executor.compressed.ratios()` after a first training
step, handed to `plan_compress(ratios=...)` for the plan the run continues with) or, without a measurement,
`DEFAULT_RATIO` (the policy table's `compress` row, which plans before any data exists). The margin
covers drift of the data and of the adaptive bound over training. A stream that still comes out larger than its
block at run time is *spilled*: kept in host memory instead of the block (the block stays reserved and unused),
and counted (`CompressedStore.spilled`). So a bad guess costs host memory and a copy, never a crash and never a
byte over the budget: the pool only ever holds what the plan placed. The raw-size cap means a tensor that does not
compress at all costs one header more than keeping it, never more (the codec falls back to raw).

**Compressed and offloaded.** A stream may also wait on the host (`stream_candidates`: the tensor cache's
candidates): COMPRESS, then at once in the same sequence OFFLOAD of `z:<t>` (and its RELEASE, when just in time);
before the first backward step, PREFETCH and WAIT of `z:<t>`, then DECOMPRESS. The link then moves the reserved
stream instead of the tensor: about 1 / DEFAULT_RATIO x MARGIN of its bytes. `auto --lossy` weighs it
(`schedulers/lossy.py`); the `compress` policy alone never offloads.

Limitations: the codec runs on the host on both backends for now (the CUDA kernels in `kernels/compress.cu` are
registered and compile, their wiring is pending a GPU). Under a budget the `compress` policy either fits or fails
with the smallest budget it needs; a checkpoint a recomputation reads is never compressed (its reader is not one
the bound accounts for).
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

"""The compressed stream of tensor t is the plannable block `z:<t>`."""

DEFAULT_RATIO = 2.5
"""Compression ratio assumed for a tensor with no measurement: below what ResNet-20's stored activations reach
at the default bound on the first iterations (CHANGELOG.md, compression), so a first plan rarely spills."""

MARGIN = 1.25
"""Reserve this much more than the measured compressed size: the data and the adaptive bound drift in training."""

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
    """For every tensor a backward step reads as a layer's input or output: its readers, or None if one of them
    is a layer whose gradient the bound cannot account for."""
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
    """Tensors the bound allows to be compressed between their forward and backward uses, in route order.
    `exclude`: tensors a reader the bound does not know reads in backward (a recomputation's checkpoint)."""
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
    """Bytes planned for the compressed stream of a tensor of `nbytes` expected to compress `ratio`-fold."""
    r = DEFAULT_RATIO if ratio is None or not math.isfinite(ratio) or ratio <= 0 else ratio
    return min(nbytes, math.ceil(nbytes / r * MARGIN)) + HEADER_BYTES


def compress_schedule(base: Schedule, chosen: list[Compressible], ratios: dict[str, float] | None = None,
                      offloadable: bool = False) -> Schedule:
    """`base` with each chosen tensor's residency split around its stay in compressed form. `offloadable`: the
    streams may then be offloaded (`stream_candidates`), so the decompression leaves the first place of its
    sequence to the stream's prefetch and wait."""
    res = dict(base.residencies)
    sizes = dict(base.sizes)
    ratios = ratios or {}
    d = 1 if offloadable else 0   # the decompression's place in its sequence, moved up by one
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
    """The compressed streams of `chosen` (in `sched`, made `offloadable`) as candidates of the tensor cache: a
    stream may wait on the host between its compression and its decompression, moving its reserved bytes over the
    link instead of the tensor's. It is written in the sequence after its tensor's last forward step (`out_seq`:
    the copy out starts there) and read in the sequence before its first backward step (`seq_read`)."""
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
    """Plan `route` with every eligible stored activation compressed between forward and backward.

    `ratios` (tensor id -> raw / compressed bytes, from `CompressedStore.ratios()`) size the reserved blocks; missing
    tensors get `DEFAULT_RATIO`. Raises BudgetError (from the placement pass) naming the smallest budget.
    """
    ws = (default_workspace(route, costs) if workspace is None else workspace)
    base = liveness_schedule(route, ws) if base is None else base
    chosen = find_candidates(route, base)
    return make_plan(route, policy, budget, ws, compress_schedule(base, chosen, ratios))


def compress_policy(route: Route, budget: int | None, device: str = "cpu", costs=None) -> Plan:
    """The policy table's `compress` row: reserved sizes from `DEFAULT_RATIO` (no data at planning time)."""
    return plan_compress(route, budget, device, costs)


def compressed_tensors(plan: Plan) -> list[str]:
    """Tensors the plan stores compressed (their COMPRESS events), in route order."""
    return [compressed_source(ev.tensor) for sp in plan.steps for ev in sp.after if ev.kind is EventKind.COMPRESS]
