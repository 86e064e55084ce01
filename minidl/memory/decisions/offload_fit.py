"""Offload windows fitted to a budget on a byte timeline: copies hidden where memory allows, without replays.

Why this module exists. `offload.hiding_timing` gives every offloaded tensor the windows that hide its copies
(the block is kept until its copy out is done; it is claimed again early enough for the copy back to land in
time), ignoring memory. Under a tight budget those windows do not all fit, and the old answer was to give up
hiding everywhere (`tight_timing`: release at once, prefetch just in time), which exposes *every* copy: the
simulated ResNet-2500 at 12 GB on a K40c hid 0% of 5.7 s of transfers. Memory is short only at some steps,
though, so only the windows that cross those steps need to be cut, and only by as much as the memory demands.

Approach. The base schedule's bytes in use are laid out per slot (the six moments of a step boundary that
`recompute.Timeline` uses), with every chosen tensor absent between its last forward and first backward use
(the tightest plan). What is left under the budget is the room the windows may take:

- copies out, in forward order on the FIFO link: each one's block stays until the first step that ends after
  the copy is done, unless a slot on the way has no room left; then the release moves before that slot and the
  compute stream waits for the rest of the copy (exposed, but only the rest);
- copies back are planned as late as the link allows (`hiding_timing`), then given room in deadline order: a
  window that hits a full slot starts after it (the copy lands late, the step waits for the difference).

How many tensors to offload is chosen on the same timeline: the fewest (in the cache's priority order) whose
tightest plan fits, and a few larger sets (more copies, but more room for the windows); each is scored by
`estimate_exposed`, the simulator's two-clock link model run on the timing directly. The caller places the
best one once (the allocator adds fragmentation the timeline cannot see) and, if it does not fit, asks again
with the room reduced by the excess: usually one placement, rarely two or three, instead of one per probe.

Limitations. The timeline counts bytes, not holes; the planned clock does not move when a step waits for a
copy (so later copies look later than they are: conservative). Both are checked by placing and simulating.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...graph.route import Route
from ..plan import Plan
from ..planner import Schedule, WorkspaceChoice, default_workspace, finalize, liveness_schedule, place
from ..pool import align_up
from . import offload as _offload
from .offload import Offloadable, Timing, _Clock, hiding_timing
from .recompute import SLOTS, Timeline

# Where a step's slots start (see recompute.SLOTS): an offloaded tensor released after step r is gone from
# slot r*SLOTS + AFTER_END; one prefetched before step p is back from slot p*SLOTS + BEFORE_START.
AFTER_END = 3
AFTER_START = 5
BEFORE_START = 2
BEFORE_SEQ = 1

CANDIDATE_SHARES = (0.0, 0.25, 0.5, 1.0)
"""Offload sets scored per base: the fewest that fit, then that plus these shares of the remaining candidates
(more bytes on the link, more room for the windows). Four timeline passes: milliseconds, not placements."""


HIDDEN_ENOUGH = 0.01
"""A set whose estimated exposed time is at most this share of its link time is taken without scoring larger
ones (ResNet-2500 at 12 GB: the fewest that fit hide all but 0.02 s of 6 s)."""


@dataclass(slots=True)
class Fit:
    """A timing for `chosen`, and what the timeline predicts of it."""

    chosen: list[Offloadable]
    timing: dict[str, Timing]
    exposed_s: float        # estimated compute time spent waiting for copies
    transfer_s: float       # estimated link time (both directions)


def base_usage(route: Route, base: Schedule, ws: dict[int, WorkspaceChoice]) -> np.ndarray:
    """Bytes resident per slot under `base` (pool-rounded sizes, fastest workspace algorithms, no persistent
    tensors): the timeline the windows are fitted on."""
    sizes = {tid: align_up(t.nbytes) for tid, t in route.tensors.items()}
    for k, c in ws.items():
        sizes[route.steps[k].workspace] = align_up(c.nbytes)
    sizes.update((tid, align_up(n)) for tid, n in base.sizes.items())   # blocks of the schedule's own (z:<t>)
    tl = Timeline(len(route.steps))
    for tid, lst in base.residencies.items():
        for r in lst:
            tl.add(r, sizes[tid])
    return tl.freeze().copy()


def _back(c: Offloadable) -> int:
    """The first slot at which an offloaded tensor must be on the device again: its first backward step's starts,
    or that boundary's sequence when a recomputation there reads it (`Offloadable.seq_read`)."""
    return c.first_backward * SLOTS + (BEFORE_SEQ if c.seq_read else BEFORE_START)


def _absent(c: Offloadable) -> tuple[int, int]:
    """Slots [lo, hi) where a tensor offloaded with the tightest timing is off the device (one written in the
    sequence after its last forward step, a compressed stream, is there only inside that sequence)."""
    return c.last_forward * SLOTS + (AFTER_START if c.out_seq else AFTER_END), _back(c)


def tight_usage(usage: np.ndarray, chosen: list[Offloadable]) -> np.ndarray:
    """`usage` with each chosen tensor off the device from its last forward use to its first backward use."""
    diff = np.zeros(len(usage) + 1, np.int64)
    for c in chosen:
        lo, hi = _absent(c)
        diff[lo] -= align_up(c.nbytes)
        diff[hi] += align_up(c.nbytes)
    return usage + np.cumsum(diff)[:-1]


def _over(usage: np.ndarray, cap) -> bool:
    return bool(np.any(usage > cap))


def fewest_that_fit(usage: np.ndarray, cands: list[Offloadable], cap) -> int | None:
    """The smallest n such that offloading cands[:n] (tightest timing) keeps every slot within `cap` (bytes, or
    bytes per slot); None if even all of them do not. Memory can only drop as n grows: a bisection finds it."""
    if _over(tight_usage(usage, cands), cap):
        return None
    lo, hi = -1, len(cands)         # cands[:lo] does not fit (lo = -1: nothing known), cands[:hi] fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if not _over(tight_usage(usage, cands[:mid]), cap):
            hi = mid
        else:
            lo = mid
    return hi


def fitted_timing(chosen: list[Offloadable], clock: _Clock, room: np.ndarray) -> dict[str, Timing]:
    """The hiding windows of `chosen`, each cut where a slot has less than its bytes of `room` left (module
    docstring). `room` is free bytes per slot under the tightest plan; it is not modified."""
    room = room.copy()
    want = hiding_timing(chosen, clock)
    timing: dict[str, Timing] = {}
    for c in sorted(chosen, key=lambda c: (c.last_forward, c.tensor)):   # copies out, in link order
        nb = align_up(c.nbytes)
        lo = c.last_forward * SLOTS + AFTER_END
        r = max(c.last_forward, min(want[c.tensor].release, want[c.tensor].prefetch - 2))
        hi = r * SLOTS + AFTER_END
        short = np.flatnonzero(room[lo:hi] < nb)
        if len(short):                      # release before the first slot without room
            r = max(c.last_forward, (lo + int(short[0])) // SLOTS - 1)
            hi = r * SLOTS + AFTER_END
        room[lo:hi] -= nb
        timing[c.tensor] = Timing(r, c.first_backward)
    for c in sorted(chosen, key=lambda c: (c.first_backward, c.tensor)):  # copies back, in deadline order
        nb = align_up(c.nbytes)
        t = timing[c.tensor]
        hi = _back(c)
        p = max(want[c.tensor].prefetch, t.release + 2)
        lo = p * SLOTS + BEFORE_START
        short = np.flatnonzero(room[lo:hi] < nb)
        if len(short):                      # claim the block after the last slot without room
            p = min(c.first_backward, (lo + int(short[-1])) // SLOTS + 1)
            lo = p * SLOTS + BEFORE_START
        room[lo:hi] -= nb
        t.prefetch = p
    return timing


def estimate_exposed(chosen: list[Offloadable], timing: dict[str, Timing], clock: _Clock,
                     link_bw: float) -> tuple[float, float]:
    """(exposed, total) link seconds of this timing, by the simulator's model (`simulate.link_timeline`): one
    FIFO copy stream at `link_bw`; a RELEASE or WAIT blocks compute until its copy is done. Step times are the
    clock's (no recomputation or workspace slow-down: those only give copies more time)."""
    # (step, order within the step, event, candidate): after step k: OFFLOAD then RELEASE; before step k:
    # PREFETCH (issued) then WAIT. Order: before-events of k, compute k, after-events of k.
    evs: list[tuple[int, int, int, Offloadable]] = []
    for c in chosen:
        t = timing[c.tensor]
        evs.append((c.last_forward, 2, 0, c))     # OFFLOAD after lf
        evs.append((t.release, 3, 1, c))          # RELEASE after r
        evs.append((t.prefetch, 0, 2, c))         # PREFETCH before p
        evs.append((c.first_backward, 1, 3, c))   # WAIT before fb
    evs.sort(key=lambda e: (e[0], e[1], e[3].last_forward, e[3].tensor))
    shift = link_free = total = exposed = 0.0
    done: dict[str, float] = {}
    for k, order, kind, c in evs:
        now = (clock.start[k] if order < 2 else clock.start[k + 1]) + shift
        if kind in (0, 2):
            d = c.nbytes / link_bw
            link_free = max(now, link_free) + d
            done[c.tensor] = link_free
            total += d
        else:
            end = done.pop(c.tensor, now)
            if end > now:
                exposed += end - now
                shift += end - now
    return exposed, total


def best_fit(usage: np.ndarray, cands: list[Offloadable], clock: _Clock, cap: int, link_bw: float) -> Fit | None:
    """Among the offload sets of `CANDIDATE_SHARES`, the timing with the least estimated exposed time (then the
    fewest bytes moved) under `cap` bytes per slot; None if no set fits the timeline."""
    n0 = fewest_that_fit(usage, cands, cap)
    if n0 is None:
        return None
    best: Fit | None = None
    for n in sorted({n0 + round((len(cands) - n0) * s) for s in CANDIDATE_SHARES}):
        chosen = cands[:n]
        room = cap - tight_usage(usage, chosen)
        timing = fitted_timing(chosen, clock, room)
        exposed, total = estimate_exposed(chosen, timing, clock, link_bw)
        fit = Fit(chosen, timing, exposed, total)
        if best is None or (exposed, total) < (best.exposed_s - 1e-9, best.transfer_s):
            best = fit
        if best.exposed_s <= HIDDEN_ENOUGH * best.transfer_s:
            break           # the fewest bytes that (almost) all hide: more offloads could only add copies
    return best


def fitted_plan(usage: np.ndarray, cands: list[Offloadable], clock: _Clock, budget: int, persistent: int,
                link_bw: float, place_timing, attempts: int = 3, margin: int = 0):
    """Place the best timeline fit (`place_timing(chosen, timing)` -> Plan); when fragmentation makes it miss
    `budget`, refit with the room lowered by twice the excess. The plan, or None if no fit fits."""
    for _ in range(attempts):
        fit = best_fit(usage, cands, clock, budget - persistent - margin, link_bw)
        if fit is None:
            return None
        plan = place_timing(fit.chosen, fit.timing)
        if plan.min_budget_bytes <= budget:
            return plan
        margin += 2 * (plan.min_budget_bytes - budget) + align_up(1)
    return None


def plan_offload_fitted(route: Route, budget: int | None, device="cpu", *, base: Schedule | None = None,
                        workspace: dict[int, WorkspaceChoice] | None = None, policy: str = "offload") -> Plan:
    """The `offload` policy: liveness (or `base`) plus the tensor cache, with the copies fitted to the budget on
    the timeline; `offload.plan_offload` (the older search) when the timeline finds no fit."""
    ws = default_workspace(route) if workspace is None else workspace
    base = liveness_schedule(route, ws) if base is None else base
    plan = place(route, ws, base, policy=policy)
    if budget is None or plan.min_budget_bytes <= budget:
        return finalize(plan, budget)   # the cache keeps everything resident: nothing moves
    dev = _offload.get_profile(device) if isinstance(device, str) else device
    clock = _offload._clock(route, dev, _offload.copy_slack(dev))
    cands = _offload.find_candidates(route, base, clock)
    if cands:
        persistent = sum(align_up(t.nbytes) for t in route.tensors.values() if t.role.persistent)
        fitted = fitted_plan(base_usage(route, base, ws), cands, clock, budget, persistent, dev.link_bw,
                             lambda chosen, timing: place(
                                 route, ws, _offload.offload_schedule(route, base, chosen, timing), policy=policy))
        if fitted is not None:
            return finalize(fitted, budget)
    return _offload.plan_offload(route, budget, dev, base=base, workspace=ws, policy=policy)


def offload_policy(route: Route, budget: int | None, device: str, costs=None) -> Plan:
    """The `offload` policy: liveness plus the tensor cache (see the table in `memory/policies.py`)."""
    return plan_offload_fitted(route, budget, device or "cpu", workspace=default_workspace(route, costs))


__all__ = ["Fit", "base_usage", "best_fit", "estimate_exposed", "fewest_that_fit", "fitted_plan", "fitted_timing",
           "offload_policy", "plan_offload_fitted", "tight_usage"]
