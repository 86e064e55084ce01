"""Policy `window`: out-of-core training the nnabla way (Hayakawa & Narihira, 2020), a local two-pointer schedule.

`auto` is a global search: it tries whole plans and keeps the fastest that fits. The window scheduler is the
paper's own, local answer: it walks the recorded access order of one training step once, with two pointers,
and decides every swap-in and swap-out from what the next few steps need. A reader can run both on the same net
(`minidl plan ... --policy window` vs `--policy auto`) and see where each wins.

**The access order.** nnabla records the first iteration's array accesses; here the route already *is* that
record (every step's reads and writes, from the layers' declared backward needs), so `AccessOrder` is read off
the route: for each step, the non-persistent tensors it touches (its workspace included) and which it writes.
Parameters, buffers and optimizer state stay resident (they are placed once, before the first step); the
window moves everything else: activations, deltas, gradients, BN statistics, the batch.

**The two pointers.** With `cap` the bytes the window may hold (the budget minus the resident parameters):

- the *head* runs ahead of the step being computed. Before step k it advances over steps k, k+1, ... and takes
  each step's tensors into the window while the window's bytes stay within `cap` and the bytes being prefetched
  within `prefetch_limit`. A tensor entering the window is swapped in (PREFETCH before step k, WAIT before its
  use), or, if it is created fresh at that step, only *reserved* (counted, allocated at its first use); a tensor
  whose swap-out is still pending when it re-enters is simply kept: the swap-out is *cancelled* (its OFFLOAD
  never happens). Step k itself always enters, whatever it costs;
- after step k computes, a tensor with no use left inside the window is swapped out (OFFLOAD after step k)
  if it is used again later, or freed if never. A swap-out does not free memory at once: the block stays until
  the *tail* needs the space;
- the *tail*: before step k, while the window's bytes plus the blocks of pending swap-outs exceed `cap`, the
  oldest swap-out is waited on and its block released (RELEASE before step k).
So the window is wide where layers are small and narrow where they are big: it adapts to each layer's memory.
A swap-out of a tensor whose host copy is still current (read-only since its last copy) moves no bytes: the
block is just freed (FREE) and prefetched back from the copy already on the host.

**When a step cannot fit.** The byte counts above ignore where blocks land: the placement pass (the same
best-fit pool the executor replays, or the paged one under `--paged`) may need more arena than the window's
bytes because of holes. Then the schedule is redone with the window budget lowered *at the step that binds*
by the excess: the head may no longer carry prefetches across that step, so the prefetches that held memory
there are cancelled, and the step is rescheduled (`MAX_RESCHEDULES` rounds). The head checks every step it
would carry a prefetch across (`cap` is per step), so lowering one step's budget narrows only the windows
that span it.

The window's bytes are a *sum* over the steps it spans (a fresh tensor is reserved from the moment the head
passes it), never the memory at one instant, so a window as wide as the whole step needs more than the
liveness plan; a budget that the liveness plan meets therefore gets the liveness plan (nothing moves), as under
the tensor cache.

**Its minimum budget** is found, not guessed: the tightest window (`cap` 0 everywhere: the head takes only
the current step, the tail releases every swap-out before the next step, so at each step only that step's own
tensors and the parameters are on the device) is placed by the same pass, and its arena (peak plus holes; with
`--paged`, peak chunks) is what a `BudgetError` states when nothing fits (`window_min_budget`). It is an upper
bound: a wider window placed under a slightly smaller budget can land with fewer holes, so `plan_network` verifies
the stated number and searches below it (`schedulers/minimum.py`; ResNet-50 at batch 32: 587.20 MiB stated,
568.85 MiB verified).

**Rationale / limitations.** The schedule is computed once before training, from shapes, like every minidl
plan, so cancellations and reschedules happen in the plan, never at run time. It does not estimate compute
or copy times (the paper's scheduler does not either): a prefetch is issued as soon as the window has room,
which is as early as memory allows. Parameters are not swapped (nnabla swaps them too).
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
"""Default prefetch limit as a share of the window budget: at most half the window may be bytes still being
copied in. nnabla has the same knob (a maximum of prefetched bytes); without one, a wide window would fill with
copies issued long before they are needed and leave no room for the arrays the next steps create."""

MAX_RESCHEDULES = 60
"""Rounds of "lower the budget at the binding step and reschedule" before falling back to the tightest window."""


@dataclass(slots=True)
class AccessOrder:
    """The recorded accesses of one training step: per route step, the tensors touched and those written."""

    touched: list[list[str]]
    written: list[set[str]]
    uses: dict[str, list[int]]   # tensor -> the steps that touch it, in order
    sizes: dict[str, int]        # tensor -> pool bytes (rounded as the pool rounds)

    @staticmethod
    def record(route: Route, ws: dict[int, WorkspaceChoice]) -> "AccessOrder":
        uses = {t: u for t, u in tensor_uses(route).items() if route.tensors[t].role is not Role.WORKSPACE}
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
                written[0].add(t.id)     # the batch is loaded just before the first step
        sizes = {t: align_up(route.tensors[t].nbytes) for t in uses if t in route.tensors}
        for k, c in ws.items():   # reserved at the smallest algorithm's; the placement may grant a faster one
            smallest = min([c.nbytes] + [o.workspace_bytes for o in c.options or ()])
            sizes[route.steps[k].workspace] = align_up(smallest)
        return AccessOrder(touched, written, uses, sizes)


@dataclass(slots=True)
class WindowStep:
    """What the two pointers did before one step: for `--explain` and tests."""

    head: int          # the window is steps [k, head)
    window_bytes: int  # bytes of the tensors used inside the window (fresh ones reserved)
    pending_bytes: int  # blocks of swap-outs not yet released (the tail's side)
    released: int = 0  # swap-outs the tail waited on before this step
    cancelled: int = 0  # swap-outs cancelled because their tensor re-entered the window


@dataclass(slots=True)
class WindowResult:
    schedule: Schedule
    steps: list[WindowStep] = field(default_factory=list)


_NEW, _DEV, _OUT, _HOST, _DEAD = range(5)


def window_schedule(route: Route, order: AccessOrder, cap: list[float], prefetch_limit: float,
                    ws: dict[int, WorkspaceChoice]) -> WindowResult:
    """One pass of the two pointers over `order` with window budget `cap[k]` at step k (see the module doc)."""
    n = len(route.steps)
    labels = [s.label for s in route.steps]
    size = order.sizes
    state = {t: _NEW for t in order.uses}
    inwin = dict.fromkeys(order.uses, 0)          # uses of t inside [k, head)
    host_valid = dict.fromkeys(order.uses, False)  # the host holds t's current bytes
    opened: dict[str, Residency] = {}             # t -> its open residency
    res: dict[str, list[Residency]] = {t: [] for t in order.uses}
    markers: list[Marker | None] = []
    pending: OrderedDict[str, tuple[int, int | None, bool]] = OrderedDict()  # swap-outs: t -> (step, marker, valid)
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
        if reason:   # one reason serves both events of the residency: say where it starts and ends
            r.reason = (r.reason or "first used here") + "; " + reason

    for k in range(n):
        info = WindowStep(head, 0, 0)
        # -- the head: take steps into the window while it has room ----------------------------------------
        limit = cap[k]
        while head < n:
            j = head
            limit = min(limit, cap[j]) if j > k else limit
            new = [t for t in order.touched[j] if inwin[t] == 0]
            add = sum(size[t] for t in new)       # a cancelled swap-out moves from the tail's bytes to these
            pre = sum(size[t] for t in new if state[t] == _HOST)
            if j > k and (bytes_w + add > limit or bytes_p + pre > prefetch_limit):
                break
            for t in new:
                if state[t] == _OUT:               # it returns inside the window: cancel its swap-out
                    _, mk, valid = pending.pop(t)
                    bytes_s -= size[t]
                    if mk is not None:
                        markers[mk] = None
                    host_valid[t] = valid
                    state[t] = _DEV
                    info.cancelled += 1
                elif state[t] == _HOST:            # swap it in now, wait for it before its use
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
        # -- the tail: wait on the oldest swap-outs while space is short -----------------------------------
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
        # -- fresh tensors are allocated at their first use -------------------------------------------------
        for t in order.touched[k]:
            if state[t] == _NEW:
                start(t, k, EventKind.ALLOC, ws_reason.get(t, ""))
                state[t] = _DEV
            if prefetching.get(t) == k:
                del prefetching[t]
                bytes_p -= size[t]
        # -- after step k: what has no use left in the window leaves ---------------------------------------
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
    """Plan `route` with the window scheduler under `budget` (None: the window spans the whole step, which is
    plain liveness). Raises BudgetError naming the window's minimum budget (see the module doc)."""
    ws = workspace_choices(route) if workspace is None else workspace
    order = AccessOrder.record(route, ws)
    n = len(route.steps)
    frugal = frugal_workspace(route) if any(s.workspace for s in route.steps) else ws

    def place_window(cap: list[float], limit: float, fit: int | None, w=ws) -> Plan:
        """Schedule, then place; with `fit` (a budget) each convolution gets the fastest workspace that fits."""
        wr = window_schedule(route, order, cap, limit, w)
        plan = place(route, {k: WorkspaceChoice(c.algo, c.nbytes, list(c.refused), c.options)
                             for k, c in w.items()}, wr.schedule, fit, policy=policy)
        for k, (sp, st) in enumerate(zip(plan.steps, wr.steps)):
            sp.note = _note(st, k)
        return plan

    whole = place_window([math.inf] * n, math.inf, None)   # a window as wide as the step: plain liveness
    if budget is None or whole.min_budget_bytes <= budget:
        return finalize(whole, budget)            # like the tensor cache: nothing moves while everything fits

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
        cap[b] = max(0, cap[b] - excess)        # a step that cannot fit: cancel prefetches across it
    # the tightest window, then also with the most frugal workspaces: the smallest arena this scheduler reaches
    for tight in (place_window([0] * n, 0, budget), place_window([0] * n, 0, None, frugal)):
        if tight.min_budget_bytes <= budget:
            return finalize(tight, budget)
    raise BudgetError(
        f"budget {format_bytes(budget)} ({budget:,} B) is too small for policy '{policy}': the tightest window "
        f"(only the current step's tensors on the device, every swap-out waited on at once, the smallest "
        f"workspaces) needs {format_bytes(tight.min_budget_bytes)} ({tight.min_budget_bytes:,} B), bound at step "
        f"{tight.binding_step} ({tight.binding_label}).", tight.min_budget_bytes, tight.binding_label)


def window_min_budget(route: Route, costs=None) -> int:
    """The arena of the tightest window: the minimum `window` states when nothing fits (see the module doc)."""
    try:
        plan_window(route, 1, workspace=workspace_choices(route, costs))
    except BudgetError as e:
        return int(e.min_budget_bytes)
    return 1


def window_policy(route: Route, budget: int | None, device: str, costs=None) -> Plan:
    """The `window` policy (see the table in `memory/policies.py`)."""
    return plan_window(route, budget, workspace=workspace_choices(route, costs))
