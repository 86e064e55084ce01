"""The simulator's own memory: a plan's events replayed from scratch on a shape-only pool.

The peak is derived, never read from `plan.peak_bytes` (that would compare the plan with itself): every event at
the plan's offset (the pool refuses an overlap), so tests hold plan = replay = executor byte for byte.
"""
from __future__ import annotations

from .paged import PagedPool
from .plan import EventKind, Plan
from .pool import TensorPool


def replay(plan: Plan):
    """The pool after one step's events replayed on it: `.peak`, `.in_use`."""
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
        if not isinstance(ev.kind, EventKind):   # memory effects are declared by `EventKind` alone
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
    """The pool peak of a step of `plan`, by replay."""
    return replay(plan).peak
