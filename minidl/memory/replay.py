"""The simulator's own memory: a plan's events replayed on a shape-only pool, from scratch.

"The simulator's peak equals the executor's pool peak" is only a check if the two are computed apart. The planner
records `plan.peak_bytes` while it places tensors; reading that number back in the simulator would compare the
plan with itself, and a planner bug (a free one step late, a prefetch never released) would pass unseen. This
module derives the peak the way the executor does, but without arrays: a fresh `TensorPool` (or `PagedPool` for
a paged plan) with no backing, the setup allocations, then every event of every step in order, each placed at
the offset the plan chose (the pool refuses an overlap) and freed where the plan frees it. What it returns is
what a run would measure, so tests can hold plan = replay = executor byte for byte.
"""
from __future__ import annotations

from .paged import PagedPool
from .plan import EventKind, Plan
from .pool import TensorPool


def replay(plan: Plan):
    """The pool after one training step's events replayed on it (shape only): `.peak`, `.in_use`."""
    if plan.paged is not None:
        pool = PagedPool(plan.arena_bytes, plan.paged.chunk_bytes, plan.paged.virtual_bytes)
    else:
        pool = TensorPool(plan.arena_bytes)
    live: dict[str, int] = {}
    events = [*plan.setup]
    for sp in plan.steps:
        events += sp.before
        events += sp.after
    for ev in events:
        if not isinstance(ev.kind, EventKind):   # what a kind does to memory is declared by `EventKind` alone
            raise ValueError(f"replay: event kind '{getattr(ev.kind, 'value', ev.kind)}' has no memory effect "
                             f"declared (not a minidl.memory.plan.EventKind)")
        if ev.kind.allocates:
            if ev.tensor in live:
                raise ValueError(f"replay: {ev.kind.value} of '{ev.tensor}', which is already resident")
            pool.alloc_at(ev.offset, ev.nbytes, tag=ev.tensor)
            live[ev.tensor] = ev.offset
        elif ev.kind.frees:
            if ev.tensor not in live:
                raise ValueError(f"replay: {ev.kind.value} of '{ev.tensor}', which is not resident")
            pool.free(live.pop(ev.tensor))
    return pool


def replay_peak(plan: Plan) -> int:
    """The pool peak a training step of `plan` reaches, derived by replaying its events (not read from it)."""
    return replay(plan).peak
