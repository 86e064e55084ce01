"""The all-reduce decision: data-parallel gradients packed in buckets, reduced while backward goes on.

Rules: buckets are planned tensors (written at the backward step that makes them ready, read by the update), so
every budget and report counts them; bucketing as PyTorch DDP's (backward's order, closed before `bucket_bytes`).
ALLREDUCE starts a bucket's collective, REDUCED waits and writes the mean back; neither changes residency. Each
element is (g_0 + ... + g_{N-1}) / N in rank order, summed here, never by the library, so replicas stay
bit-identical and one rank equals a plain run. `ring` (MPI): all-to-all, ordered sum of one chunk, all-gather, 2x
the gradients' memory; `gather` (NCCL, no all-to-all): all-gather of rows, N x (DDP's take 1x, summed in its own
order). BN statistics stay per rank.
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
"""DDP's first bucket, 1 MiB: small buckets start early in backward (LeNet's 0.24 MiB is one bucket at 1 MiB)."""


REDUCTIONS = ("ring", "gather")


def bucket_shape(reduction: str, ranks: int, elements: int) -> tuple[int, int]:
    """Rows x columns: `ring`, 2 rows padded to `ranks` equal chunks; `gather`, one row per rank."""
    if reduction == "gather":
        return (ranks, elements)
    return (2, -(-elements // ranks) * ranks)


@dataclass(frozen=True, slots=True)
class DataParallel:
    """A plan for one of `world_size` data-parallel ranks."""

    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    reduction: str = "ring"

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
    tensor: str            # "bucket:k"
    grads: list[str]       # in packing order
    elements: int          # per rank row
    ready_step: int        # the backward step writing its last gradient


def assign_buckets(route: Route, bucket_bytes: int) -> list[Bucket]:
    """Gradients in backward's order, in buckets of at most `bucket_bytes`."""
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
    """A copy of `route` with one bucket tensor per bucket, written at its ready step (which reads the bucket's
    gradients: its ALLREDUCE packs them), read by the update."""
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
        ready = steps[b.ready_step]
        ready.reads.extend(g for g in b.grads if g not in ready.reads)   # ALLREDUCE packs them after the step
        ready.writes.append(b.tensor)
        update.reads.append(b.tensor)
    # a fresh memo: the route's analyses are of its own steps
    return dataclasses.replace(route, steps=steps, tensors=tensors, memo={}), buckets


def add_allreduce_events(plan: Plan, buckets: list[Bucket], dp: DataParallel) -> Plan:
    """ALLREDUCE first after each bucket's ready step (before any eviction there), REDUCED last before the update
    (after every gradient has landed), in bucket order."""
    update = next((k for k, s in enumerate(plan.route.steps) if s.phase is Phase.UPDATE), None)
    how = ("reduce-scatter (all-to-all, ordered sum of the chunks) then all-gather" if dp.reduction == "ring"
           else "all-gather of every rank's row")
    plan.memo.clear()
    first: dict[int, int] = {}   # ready step -> ALLREDUCEs placed at its front (bucket order: every rank's)
    for b in buckets:
        nbytes = plan.sizes[b.tensor]
        label = plan.route.steps[b.ready_step].label
        grad_bytes = b.elements * plan.route.tensors[b.grads[0]].dtype.itemsize
        at = first.get(b.ready_step, 0)
        first[b.ready_step] = at + 1
        plan.steps[b.ready_step].after.insert(at, Event(
            EventKind.ALLREDUCE, b.tensor, -1, nbytes,
            f"{len(b.grads)} gradients ({format_bytes(grad_bytes)}) ready after {label}: {how} over "
            f"{dp.world_size} rank(s) starts, overlapping the rest of backward"))
    if update is not None:
        plan.steps[update].before.extend([Event(
            EventKind.REDUCED, b.tensor, -1, plan.sizes[b.tensor],
            f"wait for the all-reduce (sums in rank order), / {dp.world_size} into the gradients") for b in buckets])
    plan.buckets = {b.tensor: list(b.grads) for b in buckets}
    plan.data_parallel = dp
    return plan


@dataclass(frozen=True, slots=True)
class Interconnect:
    """Bandwidth a rank receives at (bytes/s) and one message's start-up cost."""

    bw: float
    latency_s: float
    note: str = ""


INTERCONNECTS: dict[str, Interconnect] = {
    # measured here: Iallgather between 2 mpich ranks over shared memory, 1-7 GB/s by row size (shared 2-core VM)
    "cpu": Interconnect(2e9, 20e-6, "MPI over shared memory, measured here (2 ranks, noisy: 1-7 GB/s)"),
    "k40c": Interconnect(10e9, 10e-6, "PCIe 3 x16 peer to peer, datasheet"),
    "titanx": Interconnect(10e9, 10e-6, "PCIe 3 x16 peer to peer, datasheet"),
    "v100": Interconnect(12e9, 10e-6, "PCIe 3 x16 peer to peer (the PCIe V100), datasheet"),
    "h100": Interconnect(450e9, 5e-6, "NVLink 4, 900 GB/s both ways, datasheet"),
}


@dataclass(slots=True)
class AllreduceTimeline:
    total_s: float     # all-gather time of every bucket of a step
    exposed_s: float   # the part the update waited for
    ranks: int
    link: Interconnect

    @property
    def hidden_fraction(self) -> float:
        return 1.0 - self.exposed_s / self.total_s if self.total_s > 0 else 1.0


def allreduce_timeline(plan: Plan, device: DeviceProfile | str = "cpu",
                       link: Interconnect | None = None) -> AllreduceTimeline:
    """A data-parallel plan on `device`'s clock, its all-gathers on one channel."""
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
                if ring:  # all-to-all, then all-gather: (N-1) chunks of row / N each
                    d = 2 * (ranks - 1) * (link.latency_s + ev.nbytes / 2 / ranks / link.bw)
                else:  # all-gather of (N-1) rows
                    d = (ranks - 1) * (link.latency_s + ev.nbytes / ranks / link.bw)
                free = max(now, free) + d
                done[ev.tensor] = free
                total += d
    return AllreduceTimeline(total, exposed, ranks, link)

