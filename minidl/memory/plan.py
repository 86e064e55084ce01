"""Plans: what happens to every tensor, at which step, at which arena offset.

A plan is a list of events attached to route steps, replayed by the executor on a backend and by the simulator on
shapes: both see the same peak, byte for byte. Event kinds, one per mechanism (no mechanism is special-cased):
- ALLOC / FREE: a tensor's device block is carved from / returned to the pool.
- OFFLOAD / RELEASE / PREFETCH / WAIT: the tensor cache moving tensors to host memory and back.
- RECOMPUTE: rebuild a dropped tensor by re-running its layer's forward.
- ALLREDUCE / REDUCED: data parallel: a gradient bucket's all-reduce starts / is waited for (decisions/allreduce.py).
- COMPRESS / DECOMPRESS: a tensor stored in compressed form between forward and backward (lossy, opt-in).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.tensors import Role, compressed_source
from ..graph.route import Route

if TYPE_CHECKING:  # pragma: no cover
    from .paged import PagedLayout


class EventKind(str, enum.Enum):
    ALLOC = "alloc"
    FREE = "free"
    OFFLOAD = "offload"      # start copying a tensor to the host store (transfer stream)
    RELEASE = "release"      # wait for that copy, then free the device block
    PREFETCH = "prefetch"    # allocate the device block and start copying the tensor back
    WAIT = "wait"            # wait until a prefetch has landed (before the step that reads it)
    RECOMPUTE = "recompute"  # allocate the tensor and re-run its producer's forward
    ALLREDUCE = "allreduce"  # pack a bucket's gradients and start its all-reduce (nonblocking)
    REDUCED = "reduced"      # wait for that all-reduce and write the averaged gradients back
    COMPRESS = "compress"    # allocate block z:<t> and encode tensor t into it (decisions/compress.py)
    DECOMPRESS = "decompress"  # allocate tensor t again and decode it from z:<t>

    @property
    def allocates(self) -> bool:
        """The event claims a device block for its tensor."""
        return self in _ALLOCATING

    @property
    def frees(self) -> bool:
        """The event returns its tensor's device block (declared once, for every reader of plans)."""
        return self in _FREEING


_ALLOCATING = frozenset({EventKind.ALLOC, EventKind.PREFETCH, EventKind.RECOMPUTE, EventKind.COMPRESS,
                         EventKind.DECOMPRESS})
_FREEING = frozenset({EventKind.FREE, EventKind.RELEASE})


@dataclass(slots=True)
class Event:
    kind: EventKind
    tensor: str
    offset: int = -1
    nbytes: int = 0
    reason: str = ""


@dataclass(slots=True)
class StepPlan:
    """Events around one route step, the algorithm its layer runs, and the pool's high point during it."""

    before: list[Event] = field(default_factory=list)
    after: list[Event] = field(default_factory=list)
    algo: str | None = None
    workspace_bytes: int = 0
    in_use: int = 0          # bytes allocated while the step computes
    refused: list[str] = field(default_factory=list)  # faster algorithms refused for lack of memory
    note: str = ""           # a scheduler's word on this step, shown by --explain
    on_host: bool = False    # runs on the host store's copies (a host update)


@dataclass(slots=True)
class Plan:
    route: Route
    policy: str
    arena_bytes: int               # the pool the executor allocates (the budget when one is given)
    setup: list[Event]             # allocations before the first step (persistent tensors)
    steps: list[StepPlan]
    peak_bytes: int                # max bytes in use at any moment (sum of live blocks)
    min_budget_bytes: int          # smallest arena this exact plan fits in (peak plus fragmentation)
    binding_step: int              # the step whose allocation needs the most arena
    peak_step: int = 0
    peak_live: list[str] = field(default_factory=list)
    lower_bound_bytes: int = 0
    sizes: dict[str, int] = field(default_factory=dict)  # bytes of every planned tensor (workspace included)
    offloaded_bytes: int = 0       # bytes copied device -> host per training step (OFFLOAD events)
    prefetched_bytes: int = 0      # bytes copied host -> device per training step (PREFETCH events)
    paged: "PagedLayout | None" = None  # `--paged`: offsets are virtual, the arena is chunks
    buckets: dict[str, list[str]] = field(default_factory=dict)  # data parallel: bucket -> its gradients
    data_parallel: object = None   # the `decisions.allreduce.DataParallel` the buckets were made for
    decision: str = ""             # a searching policy's word on why this plan
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    """Analyses computed once (`simulate`); an event added afterwards (`decisions.allreduce`) clears it."""

    def by_role_at_peak(self) -> dict[str, int]:
        """Pool bytes (aligned, as allocated) per role at the peak: they sum to it."""
        from .pool import align_up

        out = {r.value: 0 for r in self.roles}
        for tid in self.peak_live:
            out[self.role_of(tid).value] += align_up(self.sizes[tid])
        return out

    @property
    def roles(self) -> list[Role]:
        """The roles a report of this plan lists: every one, but those of a half-precision mode only where the
        route has tensors of them."""
        have = {t.role for t in self.route.tensors.values()}
        return [r for r in Role if not r.mixed_only or r in have]

    def role_of(self, tid: str) -> Role:
        spec = self.route.tensors.get(tid)
        if spec is None and compressed_source(tid) is not None:   # a compressed stream counts as what it stores
            spec = self.route.tensors.get(compressed_source(tid))
        return spec.role if spec is not None else Role.WORKSPACE

    def timeline(self) -> list[int]:
        return [s.in_use for s in self.steps]

    @property
    def fragmentation(self) -> float:
        """Share of the arena lost to holes at the worst moment: 1 - peak / arena needed."""
        return 0.0 if not self.min_budget_bytes else 1.0 - self.peak_bytes / self.min_budget_bytes

    @property
    def binding_label(self) -> str:
        return self.route.steps[self.binding_step].label if self.route.steps else "setup"

    @property
    def peak_label(self) -> str:
        return self.route.steps[self.peak_step].label if self.route.steps else "setup"
