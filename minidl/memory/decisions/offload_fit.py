"""Offload windows fitted to a budget on a byte timeline: only the hiding windows that cross a short step are cut.

Bytes in use per slot (`recompute.Timeline`), each chosen tensor absent from last forward to first backward use;
the rest of the budget is the windows' room. Copies out release before the first full slot on their way, copies
back claim after the last. Offload sets are scored by `estimate_exposed`; the best is placed once and refitted if
fragmentation misses. Limits: bytes, not holes; a wait does not move the planned clock (conservative).
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

# slot offsets within a step (recompute.SLOTS): a tensor released after step r is gone from slot r*SLOTS + AFTER_END;
# one prefetched before step p is back from p*SLOTS + BEFORE_START
AFTER_END = 3
AFTER_START = 5
BEFORE_START = 2
BEFORE_SEQ = 1

CANDIDATE_SHARES = (0.0, 0.25, 0.5, 1.0)
"""Offload sets scored: the fewest that fit plus these shares of the rest (four timeline passes, milliseconds)."""


HIDDEN_ENOUGH = 0.01
"""Exposed share of link time taken without scoring larger sets (ResNet-2500 at 12 GB: 0.02 s of 6 s exposed)."""


@dataclass(slots=True)
class Fit:
    """A timing for `chosen` and what the timeline predicts of it."""

    chosen: list[Offloadable]
    timing: dict[str, Timing]
    exposed_s: float        # estimated compute time waiting for copies
    transfer_s: float       # estimated link time, both directions


def base_usage(route: Route, base: Schedule, ws: dict[int, WorkspaceChoice]) -> np.ndarray:
    """Bytes resident per slot under `base` (rounded, fastest workspaces, no persistent tensors)."""
    sizes = {tid: align_up(t.nbytes) for tid, t in route.tensors.items()}
    for k, c in ws.items():
        sizes[route.steps[k].workspace] = align_up(c.nbytes)
    sizes.update((tid, align_up(n)) for tid, n in base.sizes.items())   # the schedule's own blocks (z:<t>)
    tl = Timeline(len(route.steps))
    for tid, lst in base.residencies.items():
        for r in lst:
            tl.add(r, sizes[tid])
    return tl.freeze().copy()


def _back(c: Offloadable) -> int:
    """The first slot the tensor must be back."""
    return c.first_backward * SLOTS + (BEFORE_SEQ if c.seq_read else BEFORE_START)


def _absent(c: Offloadable) -> tuple[int, int]:
    """Slots [lo, hi) off the device under the tightest timing."""
    return c.last_forward * SLOTS + (AFTER_START if c.out_seq else AFTER_END), _back(c)


def tight_usage(usage: np.ndarray, chosen: list[Offloadable]) -> np.ndarray:
    diff = np.zeros(len(usage) + 1, np.int64)
    for c in chosen:
        lo, hi = _absent(c)
        diff[lo] -= align_up(c.nbytes)
        diff[hi] += align_up(c.nbytes)
    return usage + np.cumsum(diff)[:-1]


def _over(usage: np.ndarray, cap) -> bool:
    return bool(np.any(usage > cap))


def fewest_that_fit(usage: np.ndarray, cands: list[Offloadable], cap) -> int | None:
    """The smallest n whose cands[:n] (tightest timing) fit `cap` in every slot, else None."""
    if _over(tight_usage(usage, cands), cap):
        return None
    lo, hi = -1, len(cands)         # cands[:lo] does not fit, cands[:hi] fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if not _over(tight_usage(usage, cands[:mid]), cap):
            hi = mid
        else:
            lo = mid
    return hi


def fitted_timing(chosen: list[Offloadable], clock: _Clock, room: np.ndarray) -> dict[str, Timing]:
    """The hiding windows of `chosen`, each cut where `room` (free bytes per slot) runs short."""
    room = room.copy()
    want = hiding_timing(chosen, clock)
    timing: dict[str, Timing] = {}
    for c in sorted(chosen, key=lambda c: (c.last_forward, c.tensor)):   # copies out, link order
        nb = align_up(c.nbytes)
        lo = c.last_forward * SLOTS + AFTER_END
        r = max(c.last_forward, min(want[c.tensor].release, want[c.tensor].prefetch - 2))
        hi = r * SLOTS + AFTER_END
        short = np.flatnonzero(room[lo:hi] < nb)
        if len(short):
            r = max(c.last_forward, (lo + int(short[0])) // SLOTS - 1)
            hi = r * SLOTS + AFTER_END
        room[lo:hi] -= nb
        timing[c.tensor] = Timing(r, c.first_backward)
    for c in sorted(chosen, key=lambda c: (c.first_backward, c.tensor)):  # copies back, deadline order
        nb = align_up(c.nbytes)
        t = timing[c.tensor]
        hi = _back(c)
        p = max(want[c.tensor].prefetch, t.release + 2)
        lo = p * SLOTS + BEFORE_START
        short = np.flatnonzero(room[lo:hi] < nb)
        if len(short):
            p = min(c.first_backward, (lo + int(short[-1])) // SLOTS + 1)
            lo = p * SLOTS + BEFORE_START
        room[lo:hi] -= nb
        t.prefetch = p
    return timing


def estimate_exposed(chosen: list[Offloadable], timing: dict[str, Timing], clock: _Clock,
                     link_bw: float) -> tuple[float, float]:
    """(exposed, total) link seconds by the simulator's model: one FIFO stream; RELEASE and WAIT block compute."""
    # (step, order: 0 PREFETCH, 1 WAIT before the step; 2 OFFLOAD, 3 RELEASE after it, kind, candidate)
    evs: list[tuple[int, int, int, Offloadable]] = []
    for c in chosen:
        t = timing[c.tensor]
        evs.append((c.last_forward, 2, 0, c))
        evs.append((t.release, 3, 1, c))
        evs.append((t.prefetch, 0, 2, c))
        evs.append((c.first_backward, 1, 3, c))
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
    """The set with the least estimated exposed time, then fewest bytes; None if none fits."""
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
            break           # more offloads could only add copies
    return best


def fitted_plan(usage: np.ndarray, cands: list[Offloadable], clock: _Clock, budget: int, persistent: int,
                link_bw: float, place_timing, attempts: int = 3, margin: int = 0):
    """Place the best fit; if fragmentation misses `budget`, refit with room lowered by twice the excess."""
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
    """The `offload` policy's plan: fitted on the timeline, else `offload.plan_offload`."""
    ws = default_workspace(route) if workspace is None else workspace
    base = liveness_schedule(route, ws) if base is None else base
    plan = place(route, ws, base, policy=policy)
    if budget is None or plan.min_budget_bytes <= budget:
        return finalize(plan, budget)
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
    """The `offload` policy (table in `memory/policies.py`)."""
    return plan_offload_fitted(route, budget, device or "cpu", workspace=default_workspace(route, costs))


__all__ = ["Fit", "base_usage", "best_fit", "estimate_exposed", "fewest_that_fit", "fitted_plan", "fitted_timing",
           "offload_policy", "plan_offload_fitted", "tight_usage"]
