"""The offload decision: which tensors leave the device between forward and backward, and when they return.

This is the planning half of SuperNeurons' tensor cache (the moving half is `host.py`). It starts from a base
schedule (plain liveness by default) and, for a chosen set of tensors, splits their single residency in two:

    ALLOC (first use) .. last forward use | OFFLOAD .. RELEASE | .. host ..
        | PREFETCH .. WAIT | first backward use .. FREE

- OFFLOAD right after the last forward use starts the copy to the host on the transfer stream;
- RELEASE frees the device block, after waiting for that copy (placed where the copy should be done);
- PREFETCH allocates the block again and starts the copy back, early enough to hide behind compute;
- WAIT, right before the first backward use, blocks until the copy has landed.

**The tensor cache: move only what the budget demands.** A transfer is never free (it takes link bandwidth
and, on the CPU, memory bandwidth from the kernels), so the default is to keep every tensor resident: with no
budget, or a budget the base plan already fits, this policy offloads nothing and its plan *is* the base plan.
Only when the budget is smaller do tensors leave, and then as few as fit. SuperNeurons' cache evicts in LRU
order when space runs out; with a static route we know the future, so we can evict by Belady's rule instead:
the tensor whose next use is farthest away (weighted by its size, since a big tensor frees more) is the one
whose absence costs least. The priority is therefore *idle byte-seconds*: bytes x estimated compute time
between the last forward use and the first backward use.

**Candidates.** Tensors with exactly one residency in the base schedule that are used in forward and again in
backward with at least one step in between (else releasing and re-allocating frees nothing while any step
computes): layer outputs and the network input. SuperNeurons offloads only checkpoint layers' outputs (conv,
FC, joins), because in its design the cheap layers' outputs are recomputed, so checkpoints are all that
survive to backward. Without recomputation, what survives is often a cheap layer's output (ReLU keeps its
output for its backward; in VGG a conv's own output dies right after the ReLU reads it), so restricting to
checkpoints would leave most of the memory unmovable. Combined with a recomputation schedule as the base, the
dropped outputs have several residencies and are skipped, and the rule falls back to SuperNeurons' own.

**Fitted to the budget first.** Under a binding budget, which tensors leave and how long their copy windows
stay open are first chosen on a per-slot byte timeline (`offload_fit.py`): windows cut only where memory is
short, scored by the simulator's link model, placed once (twice or three times if fragmentation needs more room).
The policy's entry point (`offload_fit.offload_policy`) tries that first; `plan_offload` below is the older
search, used when the timeline finds no fit (and by the weights scheduler).

**Choosing how many.** In priority order, the first n candidates are offloaded; n is found by binary search
(memory at each step can only drop when one more tensor leaves, so "fits" is monotone in n up to allocator
noise), each probe being one replay of the placement pass. Planning ResNet-50 takes a handful of replays.

**Timing: hide the copies, but pay for the hiding in memory.** Each step's compute time is estimated on the
device profile (`simulate.step_costs`), each copy's time as a start latency plus bytes / link bandwidth times
a safety factor (`COPY_LATENCY_S`, `COPY_SLACK`: on the CPU the copy thread must first get a core and the GIL,
then competes with the kernels for memory bandwidth). Copies share one FIFO stream, as in the
executor. Offloads are issued in forward order; the RELEASE goes after the first step by whose end the copy
should be done. Prefetches are scheduled backwards from their deadlines (the first backward use), each one
starting as *late* as it can while still finishing before its deadline and before the next prefetch on the
stream starts: starting earlier would hide nothing more and only hold the block longer. If that plan does not
fit the budget, the windows that hold memory at the binding step (a release waiting for its copy, a prefetch
landing early) are cut short: less hiding, but a smaller peak; the simulator reports the exposed time. If even
the tightest plan (everything offloaded, released at once, prefetched just in time) does not fit, a
`BudgetError` names the smallest budget that does.
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
"""Planning assumes a copy takes this many times bytes / link bandwidth: a margin for the copy competing with
compute for memory bandwidth (on the CPU the "link" is a memcpy on the same memory bus: measured at 4-6 GB/s
while the kernels run, against 11 GB/s alone) and for estimates of compute time that come out optimistic.
Too small and copies are exposed; too large and blocks are held longer than needed."""

GPU_COPY_SLACK = 1.0
"""On a simulated GPU the copy engine runs beside the compute units at the link's bandwidth, which is exactly
what the simulator models, so planning assumes no margin there: a margin would only keep blocks longer (and
at ResNet-2500 scale, where the forward pass produces activations about as fast as the link drains them, make
every copy look late)."""


def copy_slack(device: DeviceProfile) -> float:
    """The factor planning applies to bytes / link bandwidth on `device` (`COPY_SLACK` on the CPU)."""
    return COPY_SLACK if device.name == "cpu" else GPU_COPY_SLACK


COPY_LATENCY_S = {"cpu": 0.010}
"""Planning also assumes each copy starts this late after it is issued. On the CPU the transfer engine is a
Python thread: before copying it must be scheduled and take the GIL, which the main thread hands over at its
next kernel or after the interpreter's switch interval (5 ms); on a busy machine the OS adds more. On a GPU a
copy launch takes microseconds (`DEFAULT_LATENCY_S`). Only the lead of prefetches and the delay of releases
grow with it, never the bytes moved."""

DEFAULT_LATENCY_S = 1e-5

MAX_REPAIRS = 100
"""Targeted repair rounds (each one placement replay) before scaling every window down uniformly."""

SCALE_STEPS = 7
"""Bisection steps on the uniform window scale (resolution 1/128 of each window)."""

_MOVABLE_ROLES = (Role.ACTIVATION, Role.DATA)


@dataclass(slots=True)
class Offloadable:
    """A tensor that could wait on the host between its last forward use and its first backward use."""

    tensor: str
    nbytes: int
    last_forward: int      # step after which the copy out starts
    first_backward: int    # step before which the tensor must be back
    base: Residency        # its residency in the base schedule
    idle_s: float = 0.0    # estimated compute time between the two uses
    checkpoint: bool = False
    seq_read: bool = False  # first read by a sequence before `first_backward` (recomputation, decompression)
    out_seq: int = 0        # written in the sequence after `last_forward` (a compressed stream): copied out there

    @property
    def gap(self) -> int:
        return self.first_backward - self.last_forward

    @property
    def priority(self) -> float:
        """Idle byte-seconds: what keeping it resident costs, hence what offloading it saves."""
        return self.nbytes * self.idle_s


@dataclass(slots=True)
class Timing:
    """When one offloaded tensor's block is freed and claimed again."""

    release: int    # RELEASE after this step computes (>= last_forward)
    prefetch: int   # PREFETCH before this step computes (<= first_backward, >= release + 2)


@dataclass(slots=True)
class _Clock:
    """Estimated step start times on a device: start[k] is when step k begins, start[-1] the iteration's end."""

    start: list[float]
    link_bw: float
    slack: float
    latency: float = 0.0

    def copy_s(self, nbytes: int) -> float:
        """Planned time from issuing a copy to its end, if the stream is free: latency + slack x bytes / bw."""
        return self.latency + nbytes * self.slack / self.link_bw

    def end(self, k: int) -> float:
        return self.start[k + 1]


def _clock(route: Route, device: DeviceProfile, slack: float) -> _Clock:
    start = [0.0]
    for c in step_costs(route, device):
        start.append(start[-1] + c.time_s)
    latency = device.link_latency_s or DEFAULT_LATENCY_S   # measured (calibrate.py), else default
    return _Clock(start, device.link_bw, slack, COPY_LATENCY_S.get(device.name, latency))


def find_candidates(route: Route, base: Schedule, clock: _Clock | None = None) -> list[Offloadable]:
    """Tensors the base schedule keeps resident across the forward/backward turn, highest priority first."""
    uses = tensor_uses(route)
    turn = route.turn  # the first backward step (a packed route's re-forwards belong to the backward half)
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
    """For each chosen tensor, the latest prefetch and the earliest release that still hide its copies.

    Offloads go on the stream in issue order (forward order); each starts when the stream is free and its
    tensor's last forward use has finished. Prefetches are planned from the last deadline backwards: a copy
    must end before its tensor's first backward use *and* before the next copy on the stream begins, so it
    starts at min(deadline, next start) - duration, and is issued before the last step that begins by then.
    """
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
        p = bisect.bisect_right(clock.start, start) - 1     # last step that begins no later than `start`
        p = min(fb, max(lf + 2, p))
        r = max(lf, bisect.bisect_left(clock.start, done[c.tensor]) - 1)  # first step ending after the copy
        timing[c.tensor] = Timing(min(r, p - 2), p)
    return timing


def tight_timing(chosen: list[Offloadable]) -> dict[str, Timing]:
    """Least memory: release right after the copy out (waiting for it), prefetch right before the use."""
    return {c.tensor: Timing(c.last_forward, c.first_backward) for c in chosen}


def offload_schedule(route: Route, base: Schedule, chosen: list[Offloadable],
                     timing: dict[str, Timing]) -> Schedule:
    """`base` with each chosen tensor's residency split around its stay on the host, plus the markers."""
    res = dict(base.residencies)
    markers = list(base.markers)
    steps = route.steps
    for c in sorted(chosen, key=lambda c: (c.last_forward, c.tensor)):
        t, b = timing[c.tensor], c.base
        back = steps[c.first_backward].label
        # a tensor a sequence reads first (a recomputation, a decompression) is prefetched and waited for in that
        # sequence, before its reader; one a sequence writes (a compressed stream) is copied out right after
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
    """Plan `route` with the tensor cache under `budget`: offload as little as fits, hidden where possible.

    `base` is the schedule to start from (plain liveness by default; a recomputation schedule composes).
    Raises BudgetError naming the smallest budget reachable with every candidate offloaded.
    """
    ws = default_workspace(route) if workspace is None else workspace
    base = liveness_schedule(route, ws) if base is None else base

    def place(sched: Schedule) -> Plan:
        return planner.place(route, ws, sched, policy=policy)

    plan = place(base)
    if budget is None or plan.min_budget_bytes <= budget:
        return finalize(plan, budget)   # the cache keeps everything resident: nothing moves

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
            # Binary search for the fewest offloads that fit with fully hidden timing.
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
    """Offload everything, then trim the hiding windows until the plan fits; None if only the tightest does.

    Targeted first: a release window (block kept while its copy out finishes) or a prefetch window (block
    claimed before the copy back is needed) that holds memory at the binding step (or, failing that, at the
    step of peak use) is cut to end just before / start just after it, largest windows first, just enough of
    them to cover the excess. Each round is one placement replay.

    That can stall: the arena a plan needs is peak use *plus fragmentation*, and the binding step may be one
    where no window is open but an earlier early-landed prefetch left its hole pattern behind. Then every window
    is scaled by the same factor between the tightest timing (0) and the current one (1), and the largest
    factor that fits is found by bisection: uniformly less hiding, never more memory than the tightest plan.
    """
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
