"""Policy `window`: the two-pointer swap schedule of nnabla's out-of-core training (Hayakawa & Narihira, 2020).

Over the recorded access order (the route) with `cap` = budget minus resident parameters: the head takes steps into
the window while its bytes fit `cap` (prefetching or reserving what enters, cancelling a pending swap-out of what
returns); after a step, what has no use left in the window is swapped out, or just freed if its host copy is
current; the tail releases the oldest swap-outs while the window plus them exceed `cap`. Where placement misses the
budget, `cap` at the binding step drops by the excess. The tightest window (`cap` 0) states the minimum budget.
Shapes only: a prefetch goes as early as memory allows. Parameters are not swapped, nor a data-parallel bucket
while its all-reduce is in flight (its uses span its write to its read).
"""
from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from ...core.errors import BudgetError
from ...core.tensors import Role
from ...graph.route import Route
from ..liveness import tensor_uses
from ..plan import EventKind, Plan
from ..planner import Marker, Residency, Schedule, WorkspaceChoice, finalize, place
from ..pool import align_up, format_bytes
from ..workspace import frugal_workspace, workspace_choices

PREFETCH_SHARE = 0.5
"""Prefetch limit as a share of the window budget (nnabla's knob): without it, early copies crowd out new arrays."""

MAX_RESCHEDULES = 60
"""Rounds of "lower the budget at the binding step, reschedule" before the tightest window."""


@dataclass(slots=True)
class AccessOrder:
    """Per route step, the tensors touched (workspace included) and those written."""

    touched: list[list[str]]
    written: list[set[str]]
    uses: dict[str, list[int]]   # tensor -> the steps that touch it, in order
    sizes: dict[str, int]        # tensor -> pool bytes

    @staticmethod
    def record(route: Route, ws: dict[int, WorkspaceChoice]) -> "AccessOrder":
        uses = {t: u for t, u in tensor_uses(route).items() if route.tensors[t].role is not Role.WORKSPACE}
        for t, u in uses.items():   # a bucket's collective runs from its write to its read: never swapped
            if route.tensors[t].role is Role.BUCKET:
                uses[t] = list(range(u[0], u[-1] + 1))
        for k in ws:
            uses[route.steps[k].workspace] = [k]
        touched: list[list[str]] = [[] for _ in route.steps]
        for t, lst in sorted(uses.items()):
            for k in lst:
                touched[k].append(t)
        written: list[set[str]] = [set() for _ in route.steps]
        for step in route.steps:
            written[step.index].update(step.writes)
            written[step.index].update(a.into for a in step.accumulate)
        for t in route.tensors.values():
            if t.role in (Role.DATA, Role.LABEL):
                written[0].add(t.id)     # the batch is loaded before the first step
        sizes = {t: align_up(route.tensors[t].nbytes) for t in uses if t in route.tensors}
        for k, c in ws.items():   # the smallest algorithm's
            smallest = min([c.nbytes] + [o.workspace_bytes for o in c.options or ()])
            sizes[route.steps[k].workspace] = align_up(smallest)
        return AccessOrder(touched, written, uses, sizes)


@dataclass(slots=True)
class WindowStep:
    """What the two pointers did before one step (for `--explain` and tests)."""

    head: int          # the window is steps [k, head)
    window_bytes: int  # tensors used inside the window, fresh ones reserved
    pending_bytes: int  # swap-outs not yet released
    released: int = 0
    cancelled: int = 0


@dataclass(slots=True)
class WindowResult:
    schedule: Schedule
    steps: list[WindowStep] = field(default_factory=list)


_NEW, _DEV, _OUT, _HOST, _DEAD = range(5)


def window_schedule(route: Route, order: AccessOrder, cap: list[float], prefetch_limit: float,
                    ws: dict[int, WorkspaceChoice]) -> WindowResult:
    """One pass of the two pointers with window budget `cap[k]` at step k."""
    n = len(route.steps)
    labels = [s.label for s in route.steps]
    size = order.sizes
    state = {t: _NEW for t in order.uses}
    inwin = dict.fromkeys(order.uses, 0)          # uses of t inside [k, head)
    host_valid = dict.fromkeys(order.uses, False)  # the host holds t's current bytes
    opened: dict[str, Residency] = {}             # t -> its open residency
    res: dict[str, list[Residency]] = {t: [] for t in order.uses}
    markers: list[Marker | None] = []
    pending: OrderedDict[str, tuple[int, int | None, bool]] = OrderedDict()  # t -> (step, marker, valid)
    prefetching: dict[str, int] = {}              # t -> the step whose WAIT lands it
    bytes_w = bytes_s = bytes_p = 0
    head = 0
    out = WindowResult(Schedule())
    ws_reason = {route.steps[k].workspace: f"workspace of {c.algo}" for k, c in ws.items()}

    def start(t: str, k: int, kind: EventKind, reason: str) -> None:
        r = Residency(k, "before", kind, -1, "after", EventKind.FREE, reason)
        opened[t] = r
        res[t].append(r)

    def end(t: str, k: int, at: str, kind: EventKind, reason: str) -> None:
        r = opened.pop(t)
        r.end, r.end_at, r.end_kind = k, at, kind
        if reason:   # one reason for both events of the residency
            r.reason = (r.reason or "first used here") + "; " + reason

    for k in range(n):
        info = WindowStep(head, 0, 0)
        # the head
        limit = cap[k]
        while head < n:
            j = head
            limit = min(limit, cap[j]) if j > k else limit
            new = [t for t in order.touched[j] if inwin[t] == 0]
            add = sum(size[t] for t in new)
            pre = sum(size[t] for t in new if state[t] == _HOST)
            if j > k and (bytes_w + add > limit or bytes_p + pre > prefetch_limit):
                break
            for t in new:
                if state[t] == _OUT:               # cancel its swap-out
                    _, mk, valid = pending.pop(t)
                    bytes_s -= size[t]
                    if mk is not None:
                        markers[mk] = None
                    host_valid[t] = valid
                    state[t] = _DEV
                    info.cancelled += 1
                elif state[t] == _HOST:
                    start(t, k, EventKind.PREFETCH,
                          f"swapped in {j - k} steps ahead: the window head reached '{labels[j]}' (step {j})")
                    markers.append(Marker(j, "before", EventKind.WAIT, t,
                                          f"the swap-in issued before step {k} must have landed"))
                    prefetching[t] = j
                    bytes_p += size[t]
                    state[t] = _DEV
                bytes_w += size[t] if inwin[t] == 0 else 0
            for t in order.touched[j]:
                inwin[t] += 1
            head += 1
        # the tail
        while pending and bytes_w + bytes_s > cap[k]:
            t, (issued, mk, _) = pending.popitem(last=False)
            bytes_s -= size[t]
            copied = mk is not None
            end(t, k, "before", EventKind.RELEASE if copied else EventKind.FREE,
                f"until the window tail, short of space before step {k}, "
                + (f"waits for its swap-out (issued after step {issued}) and frees it" if copied else
                   "frees it: the host copy is still current, no copy needed"))
            state[t] = _HOST
            info.released += 1
        info.head, info.window_bytes, info.pending_bytes = head, bytes_w, bytes_s
        out.steps.append(info)
        # fresh tensors are allocated at their first use
        for t in order.touched[k]:
            if state[t] == _NEW:
                start(t, k, EventKind.ALLOC, ws_reason.get(t, ""))
                state[t] = _DEV
            if prefetching.get(t) == k:
                del prefetching[t]
                bytes_p -= size[t]
        # after step k: what has no use left in the window leaves
        for t in order.touched[k]:
            if t in order.written[k]:
                host_valid[t] = False
            inwin[t] -= 1
            if inwin[t]:
                continue
            bytes_w -= size[t]
            lst = order.uses[t]
            i = bisect.bisect_right(lst, k)
            if i == len(lst):
                end(t, k, "after", EventKind.FREE, "")
                state[t] = _DEAD
                continue
            nxt = lst[i]
            mk = None
            if not host_valid[t]:
                mk = len(markers)
                markers.append(Marker(k, "after", EventKind.OFFLOAD, t,
                                      f"no use left in the window [{k + 1}, {head}); next use '{labels[nxt]}' "
                                      f"(step {nxt}): swap out"))
            pending[t] = (k, mk, host_valid[t])
            host_valid[t] = True
            bytes_s += size[t]
            state[t] = _OUT
    assert not opened and not pending, f"window left tensors open: {sorted(opened)[:3]} {list(pending)[:3]}"
    out.schedule = Schedule(res, [m for m in markers if m is not None])
    return out


def _note(st: WindowStep, k: int) -> str:
    s = f"window [{k}, {st.head}) {format_bytes(st.window_bytes)}; pending swap-outs {format_bytes(st.pending_bytes)}"
    if st.released:
        s += f"; tail released {st.released}"
    if st.cancelled:
        s += f"; {st.cancelled} swap-out(s) cancelled"
    return s


def plan_window(route: Route, budget: int | None, *, workspace: dict[int, WorkspaceChoice] | None = None,
                prefetch_limit: int | None = None, policy: str = "window") -> Plan:
    """Plan `route` with the window scheduler under `budget` (None: liveness); BudgetError names its minimum."""
    ws = workspace_choices(route) if workspace is None else workspace
    order = AccessOrder.record(route, ws)
    n = len(route.steps)
    frugal = frugal_workspace(route) if any(s.workspace for s in route.steps) else ws

    def place_window(cap: list[float], limit: float, fit: int | None, w=ws) -> Plan:
        """Schedule, then place (with a budget `fit`, the fastest workspaces that fit)."""
        wr = window_schedule(route, order, cap, limit, w)
        plan = place(route, {k: WorkspaceChoice(c.algo, c.nbytes, list(c.refused), c.options)
                             for k, c in w.items()}, wr.schedule, fit, policy=policy)
        for k, (sp, st) in enumerate(zip(plan.steps, wr.steps)):
            sp.note = _note(st, k)
        return plan

    whole = place_window([math.inf] * n, math.inf, None)   # plain liveness
    if budget is None or whole.min_budget_bytes <= budget:
            return finalize(whole, budget)

    fixed = sum(align_up(t.nbytes) for t in route.tensors.values() if t.role.persistent)
    base = max(0, budget - fixed)
    limit = base * PREFETCH_SHARE if prefetch_limit is None else prefetch_limit
    cap: list[float] = [base] * n
    for _ in range(MAX_RESCHEDULES):
        plan = place_window(cap, limit, budget)
        if plan.min_budget_bytes <= budget:
            return finalize(plan, budget)
        b, excess = plan.binding_step, plan.min_budget_bytes - budget
        if cap[b] <= 0:
            break
        cap[b] = max(0, cap[b] - excess)        # cancel prefetches across the binding step
    # the tightest window, then with the most frugal workspaces
    for tight in (place_window([0] * n, 0, budget), place_window([0] * n, 0, None, frugal)):
        if tight.min_budget_bytes <= budget:
            return finalize(tight, budget)
    raise BudgetError(
        f"budget {format_bytes(budget)} ({budget:,} B) is too small for policy '{policy}': the tightest window "
        f"(only the current step's tensors on the device, every swap-out waited on at once, the smallest "
        f"workspaces) needs {format_bytes(tight.min_budget_bytes)} ({tight.min_budget_bytes:,} B), bound at step "
        f"{tight.binding_step} ({tight.binding_label}).", tight.min_budget_bytes, tight.binding_label)


def window_min_budget(route: Route, costs=None) -> int:
    """The arena of the tightest window: the minimum `window` states when nothing fits."""
    try:
        plan_window(route, 1, workspace=workspace_choices(route, costs))
    except BudgetError as e:
        return int(e.min_budget_bytes)
    return 1


def window_policy(route: Route, budget: int | None, device: str, costs=None) -> Plan:
    """The `window` policy (table in `memory/policies.py`)."""
    return plan_window(route, budget, workspace=workspace_choices(route, costs))
