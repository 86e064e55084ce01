"""The planner: route + schedule + budget -> a plan with offsets, computed before the first step.

A pure pass over the route (shapes, dtypes, reads and writes) that replays the executor's own allocator
(`TensorPool`, or `PagedPool` under `--paged`) on shape-only blocks, so its offsets, peak and minimum arena are what
a run gets. Every policy is a `Schedule` placed by `place` and held to the budget by `finalize`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.errors import BudgetError
from ..core.tensors import Role
from ..graph.route import Route
from .liveness import analyze
from .paged import PagedLayout, PagedPool, paged_capacity
from .plan import Event, EventKind, Plan, StepPlan
from .pool import ALIGNMENT, TensorPool, align_up, format_bytes
from .workspace import WorkspaceChoice, WorkspaceFitter, smallest_workspaces, workspace_choices


def default_workspace(route: Route, costs=None) -> dict[int, WorkspaceChoice]:
    """Each layer's fastest algorithm: the menu's first, or the fastest by `costs` (a `workspace.CostTable`)."""
    if costs is not None:
        return {k: WorkspaceChoice(c.algo, c.nbytes) for k, c in workspace_choices(route, costs).items()}
    out: dict[int, WorkspaceChoice] = {}
    for step in route.steps:
        if step.workspace is None:
            continue
        opts = step.workspace_options  # fastest first
        out[step.index] = WorkspaceChoice(opts[0].algo, opts[0].workspace_bytes)
    return out


class PlacementRecorder:
    """Replays allocations on a shape-only pool as events with offsets, tracking the arena's high water."""

    def __init__(self, capacity: int, paged=None):
        self.paged = paged is not None
        self.pool = paged if paged is not None else TensorPool(capacity)
        self.offsets: dict[str, int] = {}
        self.high_water = 0
        self.high_water_step = -1
        self.peak_step = -1
        self.step = -1

    def alloc(self, tid: str, nbytes: int, kind: EventKind = EventKind.ALLOC, reason: str = "") -> Event:
        prev_peak = self.pool.peak
        off = self.pool.alloc(nbytes, tag=tid)
        self.offsets[tid] = off
        end = self.pool.arena_end() if self.paged else off + self.pool.size_of(off)
        if self.pool.peak > prev_peak:
            self.peak_step = self.step
        if end > self.high_water:
            self.high_water, self.high_water_step = end, self.step
        return Event(kind, tid, off, nbytes, reason)

    def free(self, tid: str, kind: EventKind = EventKind.FREE, reason: str = "") -> Event:
        off = self.offsets.pop(tid)
        nbytes = self.pool.size_of(off)
        self.pool.free(off)
        return Event(kind, tid, off, nbytes, reason)

    @property
    def live(self) -> list[str]:
        return list(self.offsets)


def capacity_bound(route: Route, ws: dict[int, WorkspaceChoice]) -> int:
    """An arena size no plan can exceed: every tensor at once."""
    return (sum(align_up(t.nbytes) for t in route.tensors.values())
            + sum(align_up(max([c.nbytes] + [o.workspace_bytes for o in c.options or ()])) for c in ws.values())
            + ALIGNMENT)


def lower_bound(route: Route) -> int:
    """Parameters + gradients + optimizer state + the largest step's working set (least workspace); memoized."""
    if "lower_bound" not in route.memo:
        route.memo["lower_bound"] = _lower_bound(route)
    return route.memo["lower_bound"]


def _lower_bound(route: Route) -> int:
    fixed = sum(align_up(t.nbytes) for t in route.tensors.values()
                if t.role.persistent or t.role is Role.GRADIENT)
    best = 0
    for step in route.steps:
        touched = set(step.reads) | set(step.writes) | {a.into for a in step.accumulate}
        ws = 0
        if step.workspace is not None:
            ws = min(o.workspace_bytes for o in step.workspace_options)
        work = sum(align_up(route.tensors[t].nbytes) for t in touched
                   if not (route.tensors[t].role.persistent or route.tensors[t].role is Role.GRADIENT)
                   and route.tensors[t].role is not Role.WORKSPACE)
        best = max(best, work + (align_up(ws) if ws else 0))
    return fixed + best


def make_plan(route: Route, policy: str = "liveness", budget: int | None = None,
              workspace: dict[int, WorkspaceChoice] | None = None, schedule: Schedule | None = None) -> Plan:
    """Plan `route` from `schedule` (default: liveness); with a `budget`, BudgetError if it does not fit."""
    ws = default_workspace(route) if workspace is None else workspace
    plan = place(route, ws, schedule, budget, policy=policy)
    if budget is not None and plan.min_budget_bytes > budget and any(c.options for c in ws.values()):
        plan = _frugal_fallback(route, policy, ws, schedule, budget, plan)
    return finalize(plan, budget)


def finalize(plan: Plan, budget: int | None, policy: str | None = None) -> Plan:
    """The one place a placed plan becomes a policy's plan: named, held to `budget`, given its arena."""
    if policy is not None:
        plan.policy = policy
    check_budget(plan, budget)
    plan.arena_bytes = budget if budget is not None else plan.min_budget_bytes
    return plan


def _frugal_fallback(route: Route, policy: str, ws: dict[int, WorkspaceChoice], schedule: Schedule | None,
                     budget: int, greedy: Plan) -> Plan:
    """Every open workspace on its smallest option (a large workspace fitted early can fragment the pool so a
    later step misses); the plan with the smaller minimum."""
    frugal = smallest_workspaces(ws, "not taken (the fastest-that-fits placement missed the budget)")
    plan = place(route, frugal, schedule, budget, policy=policy)
    return plan if plan.min_budget_bytes < greedy.min_budget_bytes else greedy


def check_budget(plan: Plan, budget: int | None) -> None:
    if budget is None or budget >= plan.min_budget_bytes:
        return
    step = plan.binding_label
    raise BudgetError(
        f"budget {format_bytes(budget)} ({budget:,} B) is too small for policy '{plan.policy}': the smallest "
        f"budget that works is {format_bytes(plan.min_budget_bytes)} ({plan.min_budget_bytes:,} B), bound at "
        f"step {plan.binding_step} ({step}); peak in use {format_bytes(plan.peak_bytes)}. Try a larger budget "
        f"or a more frugal policy.", plan.min_budget_bytes, step)


@dataclass(slots=True)
class Residency:
    """One stretch of a tensor's residency; `start_seq`/`end_seq` > 0 order an event within its boundary."""

    start: int
    start_at: str
    start_kind: EventKind
    end: int
    end_at: str
    end_kind: EventKind
    reason: str = ""
    start_seq: int = 0
    end_seq: int = 0


@dataclass(slots=True)
class Marker:
    """An event that changes no residency (an offload's start, a prefetch's wait)."""

    step: int
    at: str
    kind: EventKind
    tensor: str
    reason: str = ""
    seq: int = 0


@dataclass(slots=True)
class Schedule:
    """Where each tensor is resident, plus transfer markers."""

    residencies: dict[str, list[Residency]] = field(default_factory=dict)
    markers: list[Marker] = field(default_factory=list)
    host_steps: set[int] = field(default_factory=set)  # steps run on the host's copies (weights decision)
    sizes: dict[str, int] = field(default_factory=dict)  # blocks that are not route tensors (z:<t>)
    upfront: list[tuple[str, str]] = field(default_factory=list)  # (tensor, reason): allocated first, never freed


def none_schedule(route: Route, ws: dict[int, WorkspaceChoice]) -> Schedule:
    """Policy none: every tensor allocated up front in first-use order (workspaces last), never freed."""
    intervals = analyze(route)
    upfront = [(tid, "policy none: lives for the whole step")
               for tid in sorted(intervals, key=lambda t: (intervals[t].first, t))
               if route.tensors[tid].role is not Role.WORKSPACE]
    upfront += [(route.steps[k].workspace, "policy none") for k in sorted(ws)]
    return Schedule(upfront=upfront)


def liveness_schedule(route: Route, ws: dict[int, WorkspaceChoice]) -> Schedule:
    """Every tensor resident from just before its first use to just after its last."""
    sched = Schedule()
    for tid, iv in analyze(route).items():
        if route.tensors[tid].role is Role.WORKSPACE:
            continue
        sched.residencies[tid] = [Residency(iv.first, "before", EventKind.ALLOC, iv.last, "after", EventKind.FREE)]
    for k in ws:
        sched.residencies[route.steps[k].workspace] = [
            Residency(k, "before", EventKind.ALLOC, k, "after", EventKind.FREE, f"workspace of {ws[k].algo}")]
    return sched


def place(route: Route, ws: dict[int, WorkspaceChoice], schedule: Schedule | None = None,
          budget: int | None = None, *, policy: str = "liveness") -> Plan:
    """One placement pass: `schedule` replayed on the pool; with `budget`, open workspaces take the fastest
    algorithm that fits (`finalize` checks the budget)."""
    rec = PlacementRecorder(capacity_bound(route, ws), _paged_pool(route, ws))
    sizes = {tid: t.nbytes for tid, t in route.tensors.items()}
    for k, c in ws.items():
        sizes[route.steps[k].workspace] = c.nbytes
    if schedule is not None:
        sizes.update(schedule.sizes)
    setup: list[Event] = []
    steps = [StepPlan() for _ in route.steps]
    for k, c in ws.items():
        steps[k].algo, steps[k].workspace_bytes, steps[k].refused = c.algo, c.nbytes, list(c.refused)

    for t in route.tensors.values():
        # a persistent tensor the schedule gives residencies to is homed on the host (decisions/weights.py)
        if t.role.persistent and (schedule is None or t.id not in schedule.residencies):
            setup.append(rec.alloc(t.id, t.nbytes, reason="persistent"))
    for k in schedule.host_steps if schedule is not None else ():
        steps[k].on_host = True

    sched = schedule if schedule is not None else liveness_schedule(route, ws)
    for tid, reason in sched.upfront:
        setup.append(rec.alloc(tid, sizes[tid], reason=reason))
    _place_schedule(route, sched, sizes, steps, rec, _workspace_fitter(route, ws, budget, steps))
    peak = rec.pool.peak
    plan = Plan(route=route, policy=policy, arena_bytes=0, setup=setup, steps=steps, peak_bytes=peak,
                min_budget_bytes=rec.high_water, binding_step=max(rec.high_water_step, 0),
                peak_step=max(rec.peak_step, 0), sizes=sizes)
    plan.peak_live = live_at(plan, plan.peak_step)
    if rec.paged:
        plan.paged = PagedLayout(rec.pool.chunk, rec.pool.virtual_high, rec.pool.live_peak, rec.pool.rounded_peak)
    plan.lower_bound_bytes = lower_bound(route)
    plan.arena_bytes = plan.min_budget_bytes
    plan.offloaded_bytes, plan.prefetched_bytes = transfer_bytes(plan)
    return plan


def transfer_bytes(plan: Plan) -> tuple[int, int]:
    """(bytes offloaded, bytes prefetched) per training step."""
    off = pre = 0
    for sp in plan.steps:
        for ev in sp.before + sp.after:
            if ev.kind is EventKind.OFFLOAD:
                off += ev.nbytes
            elif ev.kind is EventKind.PREFETCH:
                pre += ev.nbytes
    return off, pre


def _paged_pool(route: Route, ws: dict[int, WorkspaceChoice]) -> PagedPool | None:
    chunk = route.options.paged_chunk
    if not chunk:
        return None
    sizes = [t.nbytes for t in route.tensors.values()]
    sizes += [max([c.nbytes] + [o.workspace_bytes for o in c.options or ()]) for c in ws.values()]
    return PagedPool(paged_capacity(sizes, chunk), chunk, 2 * paged_capacity(sizes, chunk))


def _place_schedule(route: Route, sched: Schedule, sizes: dict[str, int], steps: list[StepPlan],
                    rec: "PlacementRecorder", fit_workspace=None) -> None:
    """Residencies and markers -> ordered events with offsets. Before a step: ends (memory reusable), sequenced
    events (by number: starts, markers, ends: a recomputation chain rebuilds an input, then frees it), starts
    largest first (big blocks take the best holes; open workspaces last, fitted to what is free), markers (waits).
    After a step: markers (an offload starts while resident), ends, sequenced events, starts."""
    starts: dict[tuple[int, str], list[tuple[str, Residency]]] = {}
    ends: dict[tuple[int, str], list[tuple[str, Residency]]] = {}
    # sequenced items: (number, 0 start / 1 marker / 2 end, tensor, residency or marker)
    seqd: dict[tuple[int, str], list[tuple[int, int, str, Residency | Marker]]] = {}
    for tid, lst in sched.residencies.items():
        for r in lst:
            if r.start_seq > 0:
                seqd.setdefault((r.start, r.start_at), []).append((r.start_seq, 0, tid, r))
            else:
                starts.setdefault((r.start, r.start_at), []).append((tid, r))
            if r.end_seq > 0:
                seqd.setdefault((r.end, r.end_at), []).append((r.end_seq, 2, tid, r))
            else:
                ends.setdefault((r.end, r.end_at), []).append((tid, r))
    marks: dict[tuple[int, str], list[Marker]] = {}
    for m in sched.markers:
        if m.seq > 0:
            seqd.setdefault((m.step, m.at), []).append((m.seq, 1, m.tensor, m))
        else:
            marks.setdefault((m.step, m.at), []).append(m)

    def do_ends(key, out):
        for tid, r in sorted(ends.get(key, ()), key=lambda e: e[0]):
            out.append(rec.free(tid, r.end_kind, reason=r.reason or "last use"))

    def marker_event(m: Marker) -> Event:
        return Event(m.kind, m.tensor, rec.offsets.get(m.tensor, -1), sizes[m.tensor], m.reason)

    def do_seq(key, out):
        for _, what, tid, r in sorted(seqd.get(key, ()), key=lambda e: (e[0], e[1], e[2])):
            if what == 2:
                out.append(rec.free(tid, r.end_kind, reason=r.reason or "last use"))
            elif what == 1:
                out.append(marker_event(r))
            else:
                out.append(rec.alloc(tid, sizes[tid], r.start_kind, reason=r.reason or "first use"))

    def do_starts(key, out):
        deferred = []
        for tid, r in sorted(starts.get(key, ()), key=lambda e: (-sizes[e[0]], e[0])):
            if fit_workspace is not None and fit_workspace.is_open(tid):
                deferred.append((tid, r))
                continue
            out.append(rec.alloc(tid, sizes[tid], r.start_kind, reason=r.reason or "first use"))
        for tid, r in deferred:
            sizes[tid] = fit_workspace.choose(tid, rec.pool)
            out.append(rec.alloc(tid, sizes[tid], r.start_kind, reason=fit_workspace.reason(tid)))

    def do_marks(key, out):
        for m in marks.get(key, ()):
            out.append(marker_event(m))

    for step in route.steps:
        k = step.index
        rec.step = k
        sp = steps[k]
        do_ends((k, "before"), sp.before)
        do_seq((k, "before"), sp.before)
        do_starts((k, "before"), sp.before)
        do_marks((k, "before"), sp.before)
        sp.in_use = rec.pool.in_use
        do_marks((k, "after"), sp.after)
        do_ends((k, "after"), sp.after)
        do_seq((k, "after"), sp.after)
        do_starts((k, "after"), sp.after)


def _workspace_fitter(route: Route, ws: dict[int, WorkspaceChoice], budget: int | None, steps: list[StepPlan]):
    if budget is None or not any(c.options for c in ws.values()):
        return None
    return WorkspaceFitter(route, ws, budget, steps)


def live_at(plan: Plan, k: int) -> list[str]:
    """Tensors resident while step k computes."""
    live = {ev.tensor for ev in plan.setup}
    for sp in plan.steps[:k + 1]:
        for ev in sp.before:
            _apply_residency(live, ev)
        if sp is plan.steps[k]:
            break
        for ev in sp.after:
            _apply_residency(live, ev)
    return sorted(live, key=lambda t: (-plan.sizes.get(t, 0), t))


def _apply_residency(live: set[str], ev: Event) -> None:
    if ev.kind.allocates:
        live.add(ev.tensor)
    elif ev.kind.frees:
        live.discard(ev.tensor)
