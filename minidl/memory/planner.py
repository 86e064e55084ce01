"""The planner: network route + policy + budget -> a plan, computed before the first step.

The planner is a pure pass: it reads only the route (shapes, dtypes, per-step reads and writes) and produces
events with arena offsets. It places tensors by replaying the very allocator the executor uses (`TensorPool`)
on shape-only blocks, so the offsets, the peak and the fragmentation it reports are exactly what a run gets.

Policies in this module:
- `none`: every tensor of the step is allocated once, up front, and lives for the whole step (and across
  steps): the baseline every framework without memory planning pays.
- `liveness`: each tensor is allocated just before its first use and freed right after its last use.

Offload and recomputation extend `liveness` in their own modules; they add event kinds, not special cases.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import BudgetError
from ..route import Phase, Route
from ..tensors import Role
from .liveness import analyze
from .plan import Event, EventKind, Plan, StepPlan
from .pool import ALIGNMENT, TensorPool, format_bytes

POLICIES = ("none", "liveness")


def rounded(nbytes: int) -> int:
    return -(-max(int(nbytes), 1) // ALIGNMENT) * ALIGNMENT


@dataclass(slots=True)
class WorkspaceChoice:
    algo: str | None
    nbytes: int
    refused: list[str] = field(default_factory=list)


def default_workspace(route: Route) -> dict[int, WorkspaceChoice]:
    """Without a memory constraint each layer runs its fastest algorithm (the first option offered)."""
    out: dict[int, WorkspaceChoice] = {}
    for step in route.steps:
        if step.workspace is None:
            continue
        opts = _options(route, step)
        out[step.index] = WorkspaceChoice(opts[0].algo, opts[0].workspace_bytes)
    return out


def _options(route: Route, step):
    net = route.network
    node = net.nodes[step.node]
    phase = "fwd" if step.phase is Phase.FORWARD else "bwd"
    in_shapes = [net.nodes[i].shape for i in node.inputs]
    return node.layer.workspace_options(phase, in_shapes, node.shape, net.dtype.itemsize)


class PlacementRecorder:
    """Replays allocations on a shape-only pool and records them as events with offsets."""

    def __init__(self, capacity: int):
        self.pool = TensorPool(capacity)
        self.offsets: dict[str, int] = {}
        self.high_water = 0
        self.high_water_step = -1
        self.step = -1

    def alloc(self, tid: str, nbytes: int, kind: EventKind = EventKind.ALLOC, reason: str = "") -> Event:
        off = self.pool.alloc(nbytes, tag=tid)
        self.offsets[tid] = off
        end = off + self.pool.size_of(off)
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
    return (sum(rounded(t.nbytes) for t in route.tensors.values())
            + sum(rounded(c.nbytes) for c in ws.values()) + ALIGNMENT)


def lower_bound(route: Route) -> int:
    """Parameters + gradients + optimizer state + the largest single step's working set (least workspace)."""
    fixed = sum(rounded(t.nbytes) for t in route.tensors.values()
                if t.role.persistent or t.role is Role.GRADIENT)
    best = 0
    for step in route.steps:
        touched = set(step.reads) | set(step.writes) | {a.into for a in step.accumulate}
        ws = 0
        if step.workspace is not None:
            ws = min(o.workspace_bytes for o in _options(route, step))
        work = sum(rounded(route.tensors[t].nbytes) for t in touched
                   if not (route.tensors[t].role.persistent or route.tensors[t].role is Role.GRADIENT)
                   and route.tensors[t].role is not Role.WORKSPACE)
        best = max(best, work + (rounded(ws) if ws else 0))
    return fixed + best


def make_plan(route: Route, policy: str = "liveness", budget: int | None = None,
              workspace: dict[int, WorkspaceChoice] | None = None) -> Plan:
    """Plan `route` under `policy`; with a `budget`, fail early (BudgetError) if the plan does not fit."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES)}")
    ws = default_workspace(route) if workspace is None else workspace
    plan = _place(route, policy, ws)
    plan.lower_bound_bytes = lower_bound(route)
    check_budget(plan, budget)
    plan.arena_bytes = budget if budget is not None else plan.min_budget_bytes
    return plan


def check_budget(plan: Plan, budget: int | None) -> None:
    if budget is None or budget >= plan.min_budget_bytes:
        return
    step = plan.binding_label
    raise BudgetError(
        f"budget {format_bytes(budget)} ({budget:,} B) is too small for policy '{plan.policy}': the smallest "
        f"budget that works is {format_bytes(plan.min_budget_bytes)} ({plan.min_budget_bytes:,} B), bound at "
        f"step {plan.binding_step} ({step}); peak in use {format_bytes(plan.peak_bytes)}. Try a larger budget "
        f"or a more frugal policy.", plan.min_budget_bytes, step)


def _place(route: Route, policy: str, ws: dict[int, WorkspaceChoice], stop_at: int | None = None) -> Plan:
    rec = PlacementRecorder(capacity_bound(route, ws))
    sizes = {tid: t.nbytes for tid, t in route.tensors.items()}
    for k, c in ws.items():
        sizes[route.steps[k].workspace] = c.nbytes
    setup: list[Event] = []
    steps = [StepPlan() for _ in route.steps]
    for k, c in ws.items():
        steps[k].algo, steps[k].workspace_bytes, steps[k].refused = c.algo, c.nbytes, list(c.refused)

    persistent = [t for t in route.tensors.values() if t.role.persistent]
    for t in persistent:
        setup.append(rec.alloc(t.id, t.nbytes, reason="persistent"))

    intervals = analyze(route)
    if policy == "none":
        # Everything up front, in first-use order: nothing is ever freed.
        for tid in sorted(intervals, key=lambda t: (intervals[t].first, t)):
            if tid in sizes and route.tensors[tid].role is not Role.WORKSPACE:
                setup.append(rec.alloc(tid, sizes[tid], reason="policy none: lives for the whole step"))
        for k in sorted(ws):
            setup.append(rec.alloc(route.steps[k].workspace, ws[k].nbytes, reason="policy none"))
    else:
        born: dict[int, list[str]] = {}
        dies: dict[int, list[str]] = {}
        for tid, iv in intervals.items():
            if route.tensors[tid].role is Role.WORKSPACE:
                continue
            born.setdefault(iv.first, []).append(tid)
            dies.setdefault(iv.last, []).append(tid)
        for step in route.steps:
            k = step.index
            rec.step = k
            sp = steps[k]
            # Largest first (MXNet's rule): big blocks claim the best holes before small ones split them.
            for tid in sorted(born.get(k, ()), key=lambda t: (-sizes[t], t)):
                sp.before.append(rec.alloc(tid, sizes[tid], reason="first use"))
            if k in ws:
                sp.before.append(rec.alloc(step.workspace, ws[k].nbytes, reason=f"workspace of {ws[k].algo}"))
            sp.in_use = rec.pool.in_use
            if k in ws:
                sp.after.append(rec.free(step.workspace, reason="workspace dies with its step"))
            for tid in sorted(dies.get(k, ())):
                sp.after.append(rec.free(tid, reason="last use"))
    if policy == "none":
        for sp in steps:
            sp.in_use = rec.pool.in_use
    peak_step = max(range(len(steps)), key=lambda k: steps[k].in_use) if steps else -1
    peak = steps[peak_step].in_use if steps else rec.pool.in_use
    plan = Plan(route=route, policy=policy, arena_bytes=0, setup=setup, steps=steps, peak_bytes=peak,
                min_budget_bytes=rec.high_water, binding_step=max(rec.high_water_step, 0), sizes=sizes)
    plan.peak_live = live_at(plan, peak_step)
    return plan


def live_at(plan: Plan, k: int) -> list[str]:
    """Tensors resident while step k computes, by replaying the events."""
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
    if ev.kind in (EventKind.ALLOC, EventKind.PREFETCH, EventKind.RECOMPUTE):
        live.add(ev.tensor)
    elif ev.kind in (EventKind.FREE, EventKind.RELEASE):
        live.discard(ev.tensor)
