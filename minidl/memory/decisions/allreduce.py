"""The all-reduce decision: data-parallel gradients packed in buckets and reduced while backward goes on.

Rules this module keeps:
- **Buckets are planned tensors** (role `bucket`), so a budget, `--explain`, the timeline and the trace count
  them like any other. The route is extended, not special-cased: a bucket is *written* by the backward step at
  which it becomes ready and *read* by the update step, so under every policy liveness allocates it just before
  it is packed and frees it after the update, and the placement pass gives it an arena offset.
- **Bucketing** follows PyTorch DDP's reducer: gradients are taken in the order backward writes them (the last
  layer's first), and a bucket is closed before the gradient that would take it past `bucket_bytes` (a gradient
  larger than that gets a bucket of its own). A bucket is ready at the backward step that writes its last
  gradient.
- **Events.** `ALLREDUCE` after the ready step packs the bucket's gradients into this rank's row and starts the
  collective without blocking, so it proceeds while the remaining backward steps compute; `REDUCED` before the
  update step waits for it and writes the averaged gradients back into the gradient tensors the optimizer reads.
  Neither changes residency, so they are added after placement and peaks are unchanged by them.
- **Fixed reduction order.** Every element of a reduced gradient is g_0 + g_1 + ... + g_{N-1} (rank order),
  then / N, computed by this code, never by the library, so runs are bit-identical run to run and every replica
  holds the very same bits: replicas cannot drift apart. Two ways to get there (`DataParallel.reduction`), with
  the same additions and so the same bits:
  - `ring` (MPI's default): a reduce-scatter then an all-gather, as a ring all-reduce moves data. The bucket is
    2 rows of the gradients padded to N chunks: row 0 is this rank's packed gradients, row 1 receives chunk
    `rank` of every rank's row (an all-to-all); this rank sums those N chunks in rank order into its chunk of
    row 0 (the send buffer is free by then), and an in-place all-gather of row 0's chunks completes it. Each
    rank receives 2(N-1)/N x the gradient bytes and the bucket takes 2x the gradient bytes, whatever N.
  - `gather` (NCCL's, which has no all-to-all): N rows, one per rank; an in-place all-gather of the rows, then
    every rank sums all of them in rank order. Each rank receives (N-1) x the gradient bytes and the bucket
    takes N x: the same as `ring` at 2 ranks, worse beyond.
  With one rank the sum is the gradient itself, so a 1-rank run is bit-identical to a plain one.

**Simulated time** (`allreduce_timeline`, `minidl plan --ranks N`): the plan's steps on a device profile, each
bucket's all-gather queued on one channel when its ALLREDUCE is reached, (N-1) x (latency + row bytes /
bandwidth) long (a ring all-gather), and REDUCED blocking the compute clock until it is done: what blocks is the
exposed all-reduce time; the rest hid behind backward.

Limitations: the in-flight buckets take 2x (`ring`) or N x (`gather`) the gradient bytes, where DDP's buckets
take 1x (its library sums in place, in an order of its own). Only trainable parameters' gradients are reduced:
BN running statistics stay per rank (see docs/multi-process.md).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ...core.errors import DistError
from ...core.tensors import Role, TensorSpec, bucket_id
from ...graph.route import Phase, Route
from ..plan import Event, EventKind, Plan
from ..pool import format_bytes
from ..simulate import DeviceProfile, add_plan_costs, get_profile, step_costs

DEFAULT_BUCKET_BYTES = 1 << 20
"""1 MiB: DDP's first bucket (its later ones are 25 MiB). Small buckets start communicating early in backward,
which is what hides the all-reduce on small networks (LeNet's gradients are 0.24 MiB in all: at 1 MiB it has one
bucket, ready only at the end of backward; `--bucket-size 64KiB` splits it)."""


REDUCTIONS = ("ring", "gather")


def bucket_shape(reduction: str, ranks: int, elements: int) -> tuple[int, int]:
    """A bucket's rows x columns: `ring`: 2 rows of the gradients padded to `ranks` equal chunks; `gather`: one
    row per rank."""
    if reduction == "gather":
        return (ranks, elements)
    return (2, -(-elements // ranks) * ranks)


@dataclass(frozen=True, slots=True)
class DataParallel:
    """How a plan is made for one of `world_size` data-parallel ranks."""

    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    reduction: str = "ring"   # "ring" (reduce-scatter + all-gather) or "gather" (all-gather of whole rows)

    def __post_init__(self):
        if self.reduction not in REDUCTIONS:
            raise DistError(f"data parallel: reduction must be one of {', '.join(REDUCTIONS)}, got "
                            f"{self.reduction!r}")
        if int(self.world_size) < 1:
            raise DistError(f"data parallel: world size must be >= 1, got {self.world_size}")
        if int(self.bucket_bytes) < 1:
            raise DistError(f"data parallel: --bucket-size must be > 0 bytes, got {self.bucket_bytes}")


@dataclass(slots=True)
class Bucket:
    tensor: str            # the bucket's tensor id ("bucket:k")
    grads: list[str]       # gradient tensor ids in packing order
    elements: int          # elements per rank row
    ready_step: int        # the backward step that writes its last gradient


def assign_buckets(route: Route, bucket_bytes: int) -> list[Bucket]:
    """Gradients in the order backward writes them, cut into buckets of at most `bucket_bytes` each."""
    buckets: list[Bucket] = []
    cur: list[str] = []
    cur_bytes = 0
    ready = -1

    def close() -> None:
        nonlocal cur, cur_bytes
        if cur:
            elems = sum(math.prod(route.tensors[g].shape) for g in cur)
            buckets.append(Bucket(bucket_id(len(buckets)), cur, elems, ready))
        cur, cur_bytes = [], 0

    dtypes = set()
    for step in route.steps:
        if step.phase is not Phase.BACKWARD:
            continue
        for tid in step.writes:
            spec = route.tensors[tid]
            if spec.role is not Role.GRADIENT:
                continue
            dtypes.add(np.dtype(spec.dtype))
            if cur and cur_bytes + spec.nbytes > bucket_bytes:
                close()
            cur.append(tid)
            cur_bytes += spec.nbytes
            ready = step.index
    close()
    if len(dtypes) > 1:
        raise DistError(f"data parallel: gradients of several dtypes ({sorted(map(str, dtypes))}) cannot share "
                        f"buckets")
    return buckets


def with_buckets(route: Route, dp: DataParallel) -> tuple[Route, list[Bucket]]:
    """A copy of `route` whose ready steps write, and whose update step reads, one bucket tensor per bucket."""
    buckets = assign_buckets(route, dp.bucket_bytes)
    tensors = dict(route.tensors)
    steps = [dataclasses.replace(s, reads=list(s.reads), writes=list(s.writes)) for s in route.steps]
    update = next((s for s in steps if s.phase is Phase.UPDATE), None)
    if update is None and buckets:
        raise DistError("data parallel: the route has gradients but no update step")
    for b in buckets:
        g = route.tensors[b.grads[0]]
        shape = bucket_shape(dp.reduction, dp.world_size, b.elements)
        tensors[b.tensor] = TensorSpec(b.tensor, Role.BUCKET, shape, g.dtype, "allreduce")
        steps[b.ready_step].writes.append(b.tensor)
        update.reads.append(b.tensor)
    # a fresh memo: the route's analyses (liveness, step costs) are of its own steps, not of the copy's
    return dataclasses.replace(route, steps=steps, tensors=tensors, memo={}), buckets


def add_allreduce_events(plan: Plan, buckets: list[Bucket], dp: DataParallel) -> Plan:
    """Attach ALLREDUCE after each bucket's ready step and REDUCED before the update step (in bucket order)."""
    update = next((k for k, s in enumerate(plan.route.steps) if s.phase is Phase.UPDATE), None)
    how = ("reduce-scatter (all-to-all, ordered sum of the chunks) then all-gather" if dp.reduction == "ring"
           else "all-gather of every rank's row")
    plan.memo.clear()   # analyses of the plan without these events
    for b in buckets:
        nbytes = plan.sizes[b.tensor]
        label = plan.route.steps[b.ready_step].label
        grad_bytes = b.elements * plan.route.tensors[b.grads[0]].dtype.itemsize
        plan.steps[b.ready_step].after.append(Event(
            EventKind.ALLREDUCE, b.tensor, -1, nbytes,
            f"{len(b.grads)} gradients ({format_bytes(grad_bytes)}) ready after {label}: {how} over "
            f"{dp.world_size} rank(s) starts, overlapping the rest of backward"))
    if update is not None:
        plan.steps[update].before[:0] = [Event(
            EventKind.REDUCED, b.tensor, -1, plan.sizes[b.tensor],
            f"wait for the all-reduce (sums in rank order), / {dp.world_size} into the gradients") for b in buckets]
    plan.buckets = {b.tensor: list(b.grads) for b in buckets}
    plan.data_parallel = dp
    return plan


@dataclass(frozen=True, slots=True)
class Interconnect:
    """What links the ranks: bandwidth one rank receives at (bytes/s) and the start-up cost of one message."""

    bw: float
    latency_s: float
    note: str = ""


INTERCONNECTS: dict[str, Interconnect] = {
    # Measured here: Iallgather of one row per rank between 2 ranks of the mpich wheel over shared memory, 1-7 GB/s
    # by row size on the shared 2-core VM (0.02 ms for 64 KiB rows); 2 GB/s is the middle of that.
    "cpu": Interconnect(2e9, 20e-6, "MPI over shared memory, measured here (2 ranks, noisy: 1-7 GB/s)"),
    # GPUs of one server: peer-to-peer over PCIe 3 x16 (~10-12 GB/s), NVLink 4 on an H100 SXM (450 GB/s each way).
    "k40c": Interconnect(10e9, 10e-6, "PCIe 3 x16 peer to peer, datasheet"),
    "titanx": Interconnect(10e9, 10e-6, "PCIe 3 x16 peer to peer, datasheet"),
    "v100": Interconnect(12e9, 10e-6, "PCIe 3 x16 peer to peer (the PCIe V100), datasheet"),
    "h100": Interconnect(450e9, 5e-6, "NVLink 4, 900 GB/s both ways, datasheet"),
}


@dataclass(slots=True)
class AllreduceTimeline:
    total_s: float     # all-gather time of every bucket of a step
    exposed_s: float   # the part the update had to wait for (the rest ran while backward computed)
    ranks: int
    link: Interconnect

    @property
    def hidden_fraction(self) -> float:
        return 1.0 - self.exposed_s / self.total_s if self.total_s > 0 else 1.0


def allreduce_timeline(plan: Plan, device: DeviceProfile | str = "cpu",
                       link: Interconnect | None = None) -> AllreduceTimeline:
    """Replay a data-parallel plan's steps on `device`'s clock with its buckets' all-gathers on one channel."""
    dev = get_profile(device) if isinstance(device, str) else device
    if link is None:
        if dev.name not in INTERCONNECTS:
            raise DistError(f"no interconnect known for device profile '{dev.name}': expected one of "
                            f"{', '.join(INTERCONNECTS)}, or pass one")
        link = INTERCONNECTS[dev.name]
    dp = plan.data_parallel
    ranks, ring = (dp.world_size, dp.reduction == "ring") if dp is not None else (1, False)
    costs = step_costs(plan.route, dev)
    add_plan_costs(plan, costs)
    now = free = total = exposed = 0.0
    done: dict[str, float] = {}
    for sp, c in zip(plan.steps, costs):
        for ev in sp.before:
            if ev.kind is EventKind.REDUCED:
                t = done.pop(ev.tensor)
                if t > now:
                    exposed += t - now
                    now = t
        now += c.time_s
        for ev in sp.after:
            if ev.kind is EventKind.ALLREDUCE:
                if ring:  # all-to-all then all-gather, each (N-1) chunks of row / N
                    d = 2 * (ranks - 1) * (link.latency_s + ev.nbytes / 2 / ranks / link.bw)
                else:  # all-gather of the rows: (N-1) rows
                    d = (ranks - 1) * (link.latency_s + ev.nbytes / ranks / link.bw)
                free = max(now, free) + d
                done[ev.tensor] = free
                total += d
    return AllreduceTimeline(total, exposed, ranks, link)

