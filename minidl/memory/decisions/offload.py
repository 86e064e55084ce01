"""The offload decision: the planning half of SuperNeurons' tensor cache (`host.py` moves the bytes).

A chosen tensor's residency splits: OFFLOAD after its last forward use, RELEASE once the copy should be done,
PREFETCH early enough to hide the copy back, WAIT before its first backward use. Rules: move only what the budget
demands. The route is static, so evict by Belady's rule, not LRU: priority is idle byte-seconds. Candidates are not
only checkpoints (without recomputation a cheap layer's output is what survives to backward). `plan_offload` is the
fallback of `offload_fit.offload_policy` and the weights scheduler's search.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass

from ...core.errors import BudgetError
from ...core.tensors import Role
from ...graph.route import Route
from .. import planner
from ..liveness import tensor_uses
from ..plan import EventKind, Plan
from ..planner import Marker, Residency, Schedule, WorkspaceChoice, default_workspace, finalize, liveness_schedule
from ..pool import format_bytes
from ..simulate import DeviceProfile, get_profile, step_costs

COPY_SLACK = 2.5
"""Planned copy time = bytes / link bandwidth x this (CPU memcpy measured 4-6 GB/s beside the kernels, 11 alone)."""

GPU_COPY_SLACK = 1.0
"""A simulated GPU's copy engine runs at the link's modelled bandwidth: a margin would only hold blocks longer."""


def copy_slack(device: DeviceProfile) -> float:
    return COPY_SLACK if device.name == "cpu" else GPU_COPY_SLACK


COPY_LATENCY_S = {"cpu": 0.010}
"""Seconds from issue to copy start: the CPU's copy thread waits for the GIL (5 ms switch interval) and the OS."""

DEFAULT_LATENCY_S = 1e-5

MAX_REPAIRS = 100
"""Targeted repair rounds (one placement each) before scaling every window uniformly."""

SCALE_STEPS = 7
"""Bisection steps on the uniform window scale (1/128 of a window)."""

_MOVABLE_ROLES = (Role.ACTIVATION, Role.DATA)


@dataclass(slots=True)
class Offloadable:
    """A tensor that could wait on the host between its last forward and first backward use."""

    tensor: str
    nbytes: int
    last_forward: int
    first_backward: int
    base: Residency        # in the base schedule
    idle_s: float = 0.0    # estimated compute time between the two uses
    checkpoint: bool = False
    seq_read: bool = False  # first read by a sequence (recomputation, decompression)
    out_seq: int = 0        # written by the sequence after `last_forward` (a compressed stream)

    @property
    def gap(self) -> int:
        return self.first_backward - self.last_forward

    @property
    def priority(self) -> float:
        """Idle byte-seconds: what offloading it saves."""
        return self.nbytes * self.idle_s


@dataclass(slots=True)
class Timing:

    release: int    # RELEASE after this step computes (>= last_forward)
    prefetch: int   # PREFETCH before this step computes (<= first_backward, >= release + 2)


@dataclass(slots=True)
class _Clock:
    """Estimated step start times; start[-1] is the iteration's end."""

    start: list[float]
    link_bw: float
    slack: float
    latency: float = 0.0

    def copy_s(self, nbytes: int) -> float:
        """Issue to end of a copy on a free stream."""
        return self.latency + nbytes * self.slack / self.link_bw

    def end(self, k: int) -> float:
        return self.start[k + 1]


def _clock(route: Route, device: DeviceProfile, slack: float) -> _Clock:
    start = [0.0]
    for c in step_costs(route, device):
        start.append(start[-1] + c.time_s)
    latency = device.link_latency_s or DEFAULT_LATENCY_S   # measured by calibrate.py, else the default
    return _Clock(start, device.link_bw, slack, COPY_LATENCY_S.get(device.name, latency))


def find_candidates(route: Route, base: Schedule, clock: _Clock | None = None) -> list[Offloadable]:
    """Tensors resident across the forward/backward turn, highest priority first."""
    uses = tensor_uses(route)
    turn = route.turn  # a packed route's re-forwards belong to the backward half
    out: list[Offloadable] = []
    for tid, lst in base.residencies.items():
        spec = route.tensors.get(tid)
        if spec is None or spec.role not in _MOVABLE_ROLES or len(lst) != 1:
            continue
        r = lst[0]
        if r.start_kind is not EventKind.ALLOC or r.end_kind is not EventKind.FREE:
            continue
        fwd = [k for k in uses.get(tid, ()) if k < turn]
        bwd = [k for k in uses.get(tid, ()) if k >= turn]
        if not fwd or not bwd:
            continue
        lf, fb = fwd[-1], bwd[0]
        if fb - lf < 2 or lf < r.start or fb > r.end:
            continue
        node = route.network.node(spec.owner) if spec.role is Role.ACTIVATION else None
        c = Offloadable(tid, spec.nbytes, lf, fb, r, checkpoint=bool(node is not None and node.layer.checkpoint))
        if clock is not None:
            c.idle_s = clock.start[fb] - clock.end(lf)
        else:
            c.idle_s = float(fb - lf - 1)
        out.append(c)
    out.sort(key=lambda c: (-c.priority, -c.nbytes, c.tensor))
    return out


def hiding_timing(chosen: list[Offloadable], clock: _Clock) -> dict[str, Timing]:
    """Per tensor, the latest prefetch and earliest release that still hide its copies on the FIFO stream."""
    timing: dict[str, Timing] = {}
    done: dict[str, float] = {}
    free = 0.0
    for c in sorted(chosen, key=lambda c: (c.last_forward, c.tensor)):
        start = max(free, clock.end(c.last_forward))
        free = done[c.tensor] = start + clock.copy_s(c.nbytes)
    limit = math.inf
    for c in sorted(chosen, key=lambda c: (-c.first_backward, c.tensor)):
        lf, fb = c.last_forward, c.first_backward
        start = min(clock.start[fb], limit) - clock.copy_s(c.nbytes)
        limit = start
        p = bisect.bisect_right(clock.start, start) - 1     # last step beginning by `start`
        p = min(fb, max(lf + 2, p))
        r = max(lf, bisect.bisect_left(clock.start, done[c.tensor]) - 1)  # first step ending after the copy
        timing[c.tensor] = Timing(min(r, p - 2), p)
    return timing


def tight_timing(chosen: list[Offloadable]) -> dict[str, Timing]:
    """Least memory: release right after the copy out, prefetch right before the use."""
    return {c.tensor: Timing(c.last_forward, c.first_backward) for c in chosen}


def offload_schedule(route: Route, base: Schedule, chosen: list[Offloadable],
                     timing: dict[str, Timing]) -> Schedule:
    """`base` with each chosen tensor's residency split around its stay on the host."""
    res = dict(base.residencies)
    markers = list(base.markers)
    steps = route.steps
    for c in sorted(chosen, key=lambda c: (c.last_forward, c.tensor)):
        t, b = timing[c.tensor], c.base
        back = steps[c.first_backward].label
        # a sequence that reads it first prefetches and waits for it; one that writes it copies it out
        seq = 1 if c.seq_read else 0
        res[c.tensor] = [
            Residency(b.start, b.start_at, b.start_kind, t.release, "after", EventKind.RELEASE,
                      f"on the host until step {t.prefetch}: next use '{back}' is {c.gap} steps after its last "
                      f"forward use (step {c.last_forward}); release waits for the copy out",
                      start_seq=b.start_seq, end_seq=c.out_seq if t.release == c.last_forward else 0),
            Residency(t.prefetch, "before", EventKind.PREFETCH, b.end, b.end_at, b.end_kind,
                      f"prefetch {c.first_backward - t.prefetch} steps ahead of '{back}' so the copy hides "
                      f"behind compute", end_seq=b.end_seq, start_seq=seq if t.prefetch == c.first_backward else 0),
        ]
        markers.append(Marker(c.last_forward, "after", EventKind.OFFLOAD, c.tensor,
                              f"start the copy out: next use is '{back}', {c.gap} steps away", seq=c.out_seq))
        markers.append(Marker(c.first_backward, "before", EventKind.WAIT, c.tensor,
                              f"the prefetch issued before step {t.prefetch} must have landed"
                              + (" (before the recomputation that reads it)" if seq else ""), seq=seq))
    return dataclasses.replace(base, residencies=res, markers=markers, host_steps=set(base.host_steps))


def plan_offload(route: Route, budget: int | None, device: str | DeviceProfile = "cpu", *,
                 base: Schedule | None = None, workspace: dict[int, WorkspaceChoice] | None = None,
                 policy: str = "offload", slack: float | None = None) -> Plan:
    """Plan `route` offloading as little as fits `budget`, hidden where possible; BudgetError names the smallest."""
    ws = default_workspace(route) if workspace is None else workspace
    base = liveness_schedule(route, ws) if base is None else base

    def place(sched: Schedule) -> Plan:
        return planner.place(route, ws, sched, policy=policy)

    plan = place(base)
    if budget is None or plan.min_budget_bytes <= budget:
        return finalize(plan, budget)

    dev = get_profile(device) if isinstance(device, str) else device
    clock = _clock(route, dev, copy_slack(dev) if slack is None else slack)
    cands = find_candidates(route, base, clock)
    def with_first(n: int, tight: bool = False) -> Plan:
        chosen = cands[:n]
        timing = tight_timing(chosen) if tight else hiding_timing(chosen, clock)
        return place(offload_schedule(route, base, chosen, timing))

    if cands:
        best = with_first(len(cands))
        if best.min_budget_bytes <= budget:
            lo, hi = 0, len(cands)           # with_first(lo) does not fit, with_first(hi) does
            while hi - lo > 1:
                mid = (lo + hi) // 2
                p = with_first(mid)
                if p.min_budget_bytes <= budget:
                    hi, best = mid, p
                else:
                    lo = mid
            return finalize(best, budget)

    floor = with_first(len(cands), tight=True) if cands else plan
    if floor.min_budget_bytes > budget:
        raise BudgetError(
            f"budget {format_bytes(budget)} ({budget:,} B) is too small for policy '{policy}': even with all "
            f"{len(cands)} candidate tensors offloaded and prefetched just in time, the smallest budget that "
            f"works is {format_bytes(floor.min_budget_bytes)} ({floor.min_budget_bytes:,} B), bound at step "
            f"{floor.binding_step} ({floor.binding_label}); without offload it is "
            f"{format_bytes(plan.min_budget_bytes)}. Try a larger budget or add recomputation.",
            floor.min_budget_bytes, floor.binding_label)
    return finalize(_repair(route, base, cands, clock, budget, place) or floor, budget)


def _repair(route: Route, base: Schedule, cands: list[Offloadable], clock: _Clock, budget: int,
            place) -> Plan | None:
    """Offload all, then cut the windows open at the binding (or peak) step, largest first, until it fits; if that
    stalls, scale every window by the largest factor that fits. None if only the tightest plan fits."""
    timing = hiding_timing(cands, clock)
    by_id = {c.tensor: c for c in cands}

    def covering(k: int) -> list[tuple[int, str, str]]:
        out = []
        for tid, t in timing.items():
            c = by_id[tid]
            if c.last_forward < k <= t.release:
                out.append((c.nbytes, tid, "release"))
            if t.prefetch <= k < c.first_backward:
                out.append((c.nbytes, tid, "prefetch"))
        return out

    for _ in range(MAX_REPAIRS):
        plan = place(offload_schedule(route, base, cands, timing))
        if plan.min_budget_bytes <= budget:
            return plan
        b = plan.binding_step
        windows = covering(b) or covering(plan.peak_step)
        if not windows:
            break
        b = b if covering(b) else plan.peak_step
        excess = plan.min_budget_bytes - budget
        for nbytes, tid, kind in sorted(windows, key=lambda w: (-w[0], w[1], w[2])):
            c, t = by_id[tid], timing[tid]
            if kind == "release":
                t.release = max(c.last_forward, b - 1)
            else:
                t.prefetch = min(c.first_backward, b + 1)
            excess -= nbytes
            if excess <= 0:
                break

    def scaled(f: float) -> dict[str, Timing]:
        out = {}
        for tid, t in timing.items():
            c = by_id[tid]
            out[tid] = Timing(c.last_forward + int((t.release - c.last_forward) * f),
                              c.first_backward - int((c.first_backward - t.prefetch) * f))
        return out

    lo, hi, best = 0.0, 1.0, None
    for _ in range(SCALE_STEPS):
        mid = (lo + hi) / 2
        plan = place(offload_schedule(route, base, cands, scaled(mid)))
        if plan.min_budget_bytes <= budget:
            lo, best = mid, plan
        else:
            hi = mid
    return best
