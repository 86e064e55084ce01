"""Policy `auto`: given a budget, the fastest plan that fits, searched over every mechanism minidl has.

The mechanisms trade memory for time in different currencies:

- **liveness** costs nothing: free every tensor after its last use. Always on.
- **workspace sizing** costs convolution speed: a slower algorithm with less scratch space. Always on under a
  budget, per step: each convolution gets the fastest algorithm whose workspace fits what is free then
  (`workspace.py`), so it only slows down the steps where memory is actually short.
- **recomputation** costs FLOPs: cheap layers' outputs are rebuilt in backward (`recompute.py`), either
  speed-centric (each segment once) or memory-centric (per use: more FLOPs, less memory).
- **offload** costs link bandwidth, hidden behind compute when the schedule allows: checkpoints wait on the
  host between their forward and backward uses (`offload.py`, when that module is present).

`auto` plans a handful of combinations (below), keeps those whose smallest budget is within the given one,
estimates each one's step time with the simulator (compute on the device profile, plus recomputation, plus
slower workspace algorithms, plus transfer time the link could not hide), and returns the fastest.

    combination                       what it gives up
    liveness                          nothing (workspace algorithms only where memory is short)
    recompute                         a little compute: segments speed-centric where the bottleneck allows
    recompute, memory-centric         more compute, the least activation memory without transfers
    offload                           link time, as little as the budget demands
    recompute + offload               both: what SuperNeurons runs for the deepest networks
    recompute (memory) + offload      the most memory-frugal plan minidl can make

Each base is also tried in a second arena *layout* that pins small long-lived tensors (gradients, BN
statistics, labels) at the bottom of the arena: less fragmentation, for slightly more bytes early on (`LAYOUTS`).

The search stays cheap where it can. A base whose busiest step alone exceeds the budget is not placed at all
(`compute_peak_lower_bound`), and a base's own time (compute plus recomputation, nothing moved) is computed
from its schedule, without placing it. Offload is fitted to the budget on a byte timeline first
(`decisions/offload_fit.py`: which tensors, and copy windows cut only where memory is short), so a base costs
one placement (rarely two or three, when fragmentation needs a little more room) instead of one per probe.
Bases are searched in the order of their own time, and the search stops as soon as no base left could beat
the best plan by more than `GOOD_ENOUGH`; the recomputation bases are not even built when a liveness plan is
already that close to liveness' own time, the least any plan can take. ResNet-2500 b16 at 12 GB on a K40c:
one placement, about 4 s of CPU (it was 45 s, hiding nothing).

If nothing fits, `BudgetError` states the smallest budget that works: that of the most memory-frugal plan
(every mechanism at its most frugal: memory-centric recomputation, every candidate offloaded and prefetched just
in time, the smallest workspace everywhere), then verified and searched by `policies.plan_network`
(`schedulers/minimum.py`): planning at the stated number succeeds.

Offload composed with recomputation needs one adjustment: a checkpoint that a recomputation reads must be back
on the device *before* the recomputation sequence at that step boundary, which runs before the boundary's plain
allocations and waits. So a root's "first backward use" for offload purposes is its first recomputation read,
its prefetch (when just in time) and its wait are the first items of that boundary's sequence, and its end keeps
the recomputation sequence number.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...core.errors import BudgetError
from ...core.tensors import Role
from ...graph.route import Route
from ..decisions import offload as offload_decision
from ..decisions import offload_fit
from ..decisions import weights as weights_decision
from ..decisions.recompute import MEMORY, RecomputeSchedule, compute_peak_lower_bound, recompute_schedule
from ..liveness import analyze
from ..plan import EventKind, Plan
from ..planner import Residency, Schedule, WorkspaceChoice, finalize, liveness_schedule, lower_bound, place
from ..pool import ALIGNMENT, align_up, format_bytes
from ..simulate import get_profile, simulate, step_costs
from ..workspace import CostTable, workspace_choices


@dataclass(slots=True)
class Trial:
    """One combination `auto` tried: its plan (when one was made), whether it fits, and its estimated time."""

    name: str
    plan: Plan | None = None
    fits: bool = False
    min_budget_bytes: int = 0
    est_step_time_s: float = math.inf
    note: str = ""


@dataclass(slots=True)
class AutoResult:
    plan: Plan | None
    trials: list[Trial] = field(default_factory=list)
    frugal: Trial | None = None

    def summary(self) -> str:
        lines = []
        for t in self.trials:
            mark = "*" if self.plan is not None and t.plan is self.plan else " "
            state = "fits" if t.fits else ("over budget" if t.plan is not None else "skipped")
            time = f"{t.est_step_time_s * 1e3:9.2f} ms" if math.isfinite(t.est_step_time_s) else "        -   "
            mb = format_bytes(t.min_budget_bytes) if t.plan is not None else "-"
            lines.append(f" {mark} {t.name:<44} {state:<11} min budget {mb:>11}  est {time}  {t.note}")
        return "\n".join(lines)


# -- offload on top of any base schedule ------------------------------------------------------------------------
@dataclass(slots=True)
class CacheResult:
    plan: Plan          # the plan found (fits the budget if `fits`)
    fits: bool
    offloaded: int      # tensors offloaded
    candidates: int


def offload_candidates(route: Route, base: Schedule, clock, root_reads: dict[str, int]) -> list:
    """offload.find_candidates, adjusted for recomputation: a root must be back for its first recompute read,
    which runs in the sequence before that step (`Candidate.seq_read`: prefetched and waited for in the sequence,
    just before the chain), and roots that only recomputation reads in backward become candidates too."""
    n_fwd = sum(1 for s in route.steps if s.phase.value == "forward")
    cands = []
    seen = set()
    for c in offload_decision.find_candidates(route, base, clock):
        seen.add(c.tensor)
        if c.tensor in root_reads and root_reads[c.tensor] <= c.first_backward:
            fb = root_reads[c.tensor]
            if fb - c.last_forward < 2:
                continue
            c.first_backward, c.seq_read = fb, True
            c.idle_s = clock.start[fb] - clock.end(c.last_forward)
        cands.append(c)
    iv = analyze(route)
    for tid, a in root_reads.items():
        if tid in seen or tid not in iv or len(base.residencies.get(tid, ())) != 1:
            continue
        r = base.residencies[tid][0]
        fwd = [u for u in iv[tid].uses if u < n_fwd]
        if not fwd or any(u >= n_fwd for u in iv[tid].uses):
            continue
        lf, fb = fwd[-1], a
        if fb - lf < 2:
            continue
        spec = route.tensors[tid]
        cands.append(offload_decision.Candidate(tid, spec.nbytes, lf, fb, r, clock.start[fb] - clock.end(lf), True,
                                                seq_read=True))
    cands.sort(key=lambda c: (-c.priority, -c.nbytes, c.tensor))
    return cands


def offload_schedule_for(route: Route, base: Schedule, chosen: list, timing: dict) -> Schedule:
    """`base` with `chosen` offloaded at `timing`, each root keeping its place in its recomputation sequence
    (offload_schedule rebuilds the residency)."""
    sched = offload_decision.offload_schedule(route, base, chosen, timing)
    for c in chosen:
        if c.base.end_seq:
            sched.residencies[c.tensor][-1].end_seq = c.base.end_seq
    return sched


GOOD_ENOUGH = 0.005
"""`auto` stops searching when no combination left could beat the best plan found by more than this share of
its step time: placing another ResNet-2500 candidate costs seconds of planning for a <0.5% faster step."""

FIT_ATTEMPTS = 3
"""Placements `OffloadSearch.place_fitted` makes at most: each one that does not fit lowers the timeline's room
by twice the excess it found (fragmentation is not monotone in the room left: a little more than the excess
converges in fewer placements than exactly the excess)."""

INITIAL_MARGIN = 0.005
"""Share of the budget kept free on the timeline for fragmentation before the first placement (ResNet-2500's
frugal plans lose about 1% of the arena to holes; a first guess near it saves a placement either way)."""


class OffloadSearch:
    """Offload on top of one base schedule under a budget: the timeline fit (cheap, no placement) first, so that
    `auto` can rank bases by their estimated time and place only the promising ones."""

    def __init__(self, route: Route, base: Schedule, ws: dict[int, WorkspaceChoice], budget: int, device,
                 root_reads: dict[str, int] | None = None):
        self.route, self.base, self.ws, self.budget = route, base, ws, budget
        self.dev = get_profile(device) if isinstance(device, str) else device
        self.clock = offload_decision._clock(route, self.dev, offload_decision.copy_slack(self.dev))
        self.cands = offload_candidates(route, base, self.clock, root_reads or {})
        self.usage = offload_fit.base_usage(route, base, ws) if self.cands else None
        self.persistent = sum(align_up(t.nbytes) for t in route.tensors.values() if t.role.persistent)
        self.margin = int(budget * INITIAL_MARGIN)
        self.fit = self._fit()

    def _fit(self):
        if not self.cands:
            return None
        cap = self.budget - self.persistent - self.margin
        return offload_fit.best_fit(self.usage, self.cands, self.clock, cap, self.dev.link_bw)

    @property
    def est_exposed_s(self) -> float:
        return self.fit.exposed_s if self.fit is not None else math.inf

    def place_fitted(self) -> CacheResult | None:
        """Place the timeline's best timing; if fragmentation makes it miss the budget, refit with less room and
        place again (`FIT_ATTEMPTS`). None if no fitted timing fits."""
        for _ in range(FIT_ATTEMPTS):
            if self.fit is None:
                return None
            chosen, timing = self.fit.chosen, self.fit.timing
            plan = place(self.route, self.ws, offload_schedule_for(self.route, self.base, chosen, timing),
                         self.budget)
            if plan.min_budget_bytes <= self.budget:
                return CacheResult(plan, True, len(chosen), len(self.cands))
            self.margin += 2 * (plan.min_budget_bytes - self.budget) + ALIGNMENT
            self.fit = self._fit()
        return None

    def place_tight(self) -> CacheResult:
        """Every candidate offloaded, released at once and prefetched just in time: the most frugal plan this
        base allows (every copy exposed)."""
        plan = place(self.route, self.ws, offload_schedule_for(self.route, self.base, self.cands,
                                                               offload_decision.tight_timing(self.cands)),
                     self.budget)
        return CacheResult(plan, plan.min_budget_bytes <= self.budget, len(self.cands), len(self.cands))


def cache_search(route: Route, base: Schedule, ws: dict[int, WorkspaceChoice], budget: int, device,
                 root_reads: dict[str, int] | None = None, plan0: Plan | None = None) -> CacheResult:
    """Offloads that make `base` fit `budget`, with the copies hidden where memory allows (`offload_fit`); else
    every candidate offloaded with the tightest timing (the most frugal plan this base allows, which may still
    not fit). `plan0`: `base` already placed under `budget`, if at hand."""
    if plan0 is None and compute_peak_lower_bound(route, base, ws) <= budget:
        plan0 = place(route, ws, base, budget)
    if plan0 is not None and plan0.min_budget_bytes <= budget:
        return CacheResult(plan0, True, 0, 0)
    search = OffloadSearch(route, base, ws, budget, device, root_reads)
    if not search.cands:
        plan = plan0 if plan0 is not None else place(route, ws, base, budget)
        return CacheResult(plan, False, 0, 0)
    return search.place_fitted() or search.place_tight()


# -- layouts: where long-lived small tensors sit in the arena ----------------------------------------------------
LAYOUTS: dict[str, tuple[Role, ...]] = {
    "": (),
    "grads pinned": (Role.GRADIENT,),
    "aux pinned": (Role.AUX, Role.LABEL),
    "grads+aux pinned": (Role.GRADIENT, Role.AUX, Role.LABEL),
}
"""Fragmentation is the last few percent between a frugal plan's peak and its smallest arena. Its main cause is
small tensors that live long (a gradient from its layer's backward until the update; BN's saved statistics from
forward until backward; the labels) landing in the middle of the big hole that activations and deltas come and
go in, and splitting it. A layout variant allocates those tensors once, before the first step, at the bottom of
the arena next to the parameters, in the order they die (the last to die lowest, like a stack). That costs
their bytes for longer (gradients during forward), so it is a variant `auto` tries, not a rule."""


def pin_long_lived(route: Route, sched: Schedule, roles: tuple[Role, ...]) -> Schedule:
    """`sched` with every single-residency tensor of `roles` allocated before step 0 (see LAYOUTS)."""
    if not roles:
        return sched
    chosen = [(tid, lst[0]) for tid, lst in sched.residencies.items()
              if len(lst) == 1 and lst[0].start_kind is EventKind.ALLOC and tid in route.tensors
              and route.tensors[tid].role in roles]
    chosen.sort(key=lambda e: (-e[1].end, e[1].end_at != "after", e[0]))
    res = dict(sched.residencies)
    for i, (tid, r) in enumerate(chosen):
        res[tid] = [Residency(0, "before", EventKind.ALLOC, r.end, r.end_at, r.end_kind,
                              "small and long-lived: placed once at the bottom of the arena (less fragmentation)",
                              start_seq=i + 1, end_seq=r.end_seq)]
    return Schedule(res, list(sched.markers), set(sched.host_steps))


def schedule_time(route: Route, sched: Schedule, device) -> float:
    """Estimated step time of `sched` with nothing offloaded and every convolution on its fastest algorithm: the
    simulator's compute time plus the forward steps its RECOMPUTE residencies re-run, without placing it (no
    offload of this schedule can be faster)."""
    dev = get_profile(device) if isinstance(device, str) else device
    costs = step_costs(route, dev)
    fwd = {s.node: s.index for s in route.steps if s.phase.value == "forward"}
    extra = 0.0
    for tid, lst in sched.residencies.items():
        for r in lst:
            if r.start_kind is EventKind.RECOMPUTE:
                extra += costs[fwd[route.network.node(route.tensors[tid].owner).index]].time_s
    return math.fsum(c.time_s for c in costs) + extra


# -- the search -------------------------------------------------------------------------------------------------
def auto_search(route: Route, budget: int | None, device: str = "cpu", costs: CostTable | None = None,
                frugal: bool = True) -> AutoResult:
    """Try the combinations (module docstring) and return the fastest that fits `budget`.

    Without a budget, the fastest plan is plain liveness with every convolution on its fastest algorithm.
    Stage 1 places every base (liveness, recomputation variants) in the plain layout and with small long-lived
    tensors pinned; stage 2, only if offload exists and it could still win, searches offloads on every base and
    layout in order of their best possible time, and stops as soon as no remaining one can beat the best fitting
    plan. When nothing fits, the plan with the smallest budget among all tried is the most frugal one.
    """
    ws = workspace_choices(route, costs)
    iv = analyze(route)
    res = AutoResult(None)
    if budget is None:
        plan = place(route, ws, liveness_schedule(route, ws), None)
        t = Trial("liveness", plan, True, plan.min_budget_bytes, simulate(plan, device).est_step_time_s)
        res.trials.append(t)
        res.plan = plan
        return res

    if not frugal and lower_bound(route) > budget:
        res.trials.append(Trial("any", note="skipped: parameters, gradients, optimizer state and the largest "
                                            "step's working set alone exceed the budget"))
        return res
    bases: list[tuple[str, Schedule, RecomputeSchedule | None]] = [("liveness", liveness_schedule(route, ws), None)]

    def recompute_bases() -> list[tuple[str, Schedule, RecomputeSchedule | None]]:
        out: list[tuple[str, Schedule, RecomputeSchedule | None]] = []
        rs_default = recompute_schedule(route, ws, limit=None, iv=iv)
        if rs_default.segments:
            modes = [s.mode for s in rs_default.segments]
            rs_budget = recompute_schedule(route, ws, limit=max(budget, rs_default.bottleneck), iv=iv)
            rs_mem = recompute_schedule(route, ws, mode=MEMORY, iv=iv)
            if [s.mode for s in rs_budget.segments] != modes:
                out.append(("recompute (speed under budget)", rs_budget.schedule, rs_budget))
            out.append(("recompute", rs_default.schedule, rs_default))
            if [s.mode for s in rs_mem.segments] != modes:
                out.append(("recompute (memory-centric)", rs_mem.schedule, rs_mem))
        return out

    def evaluate(trial: Trial) -> Trial:
        p = trial.plan
        trial.min_budget_bytes = p.min_budget_bytes
        trial.fits = p.min_budget_bytes <= budget
        if trial.fits:
            trial.est_step_time_s = simulate(p, device).est_step_time_s
        res.trials.append(trial)
        return trial

    def label(name: str, layout: str) -> str:
        return f"{name}, {layout}" if layout else name

    own_time: dict[str, float] = {}   # a base's time with nothing moved: no offload of it can be faster
    tried = []

    def best_time() -> float:
        return min((t.est_step_time_s for t in res.trials if t.fits), default=math.inf)

    def search(group: list[tuple[int, tuple[str, Schedule, RecomputeSchedule | None]]]) -> None:
        stage1 = ("", "grads+aux pinned")
        for _, (name, sched, _) in group:
            own_time[name] = schedule_time(route, sched, device)
            if compute_peak_lower_bound(route, sched, ws) > budget:
                # cannot fit without offload (placing it would only confirm that)
                res.trials.append(Trial(name, note="skipped: busiest step alone exceeds the budget"))
                continue
            for layout in stage1:
                evaluate(Trial(label(name, layout), place(route, ws, pin_long_lived(route, sched, LAYOUTS[layout]),
                                                          budget)))

        # Stage 2: offload. Every (base, layout) that could still win is fitted on the byte timeline (no placement)
        # and ranked by its estimated time (own time + estimated exposed copies); then placed in that order while
        # the next estimate beats the best plan found.
        searches = []   # (own time, base index, layout index, name, layout, base schedule, root reads)
        for i, (name, sched, rs) in group:
            if any(t.fits for t in res.trials if t.name.split(",")[0] == name):
                continue          # this base already fits (offload would only add copies)
            reads = {s.root: s.root_reads[0] for s in rs.segments if s.root_reads} if rs else {}
            for li, layout in enumerate(LAYOUTS):
                searches.append((own_time[name], i, li, name, layout, sched, reads))
        searches.sort(key=lambda e: e[:3])
        for lb, _, _, name, layout, sched, reads in searches:
            if lb >= best_time() * (1 - GOOD_ENOUGH):
                break             # sorted by their best possible time: none of the rest can win (by more than a hair)
            osearch = OffloadSearch(route, pin_long_lived(route, sched, LAYOUTS[layout]), ws, budget, device, reads)
            tried.append((name, layout, osearch))
            if lb + osearch.est_exposed_s >= best_time() * (1 - GOOD_ENOUGH):
                continue          # its estimate already loses: not worth a placement
            cr = osearch.place_fitted()
            if cr is None:
                continue
            evaluate(Trial(label(f"{name} + offload", layout), cr.plan,
                           note=f"{cr.offloaded} of {cr.candidates} candidates offloaded, copies fitted to the "
                                f"budget (estimated {osearch.est_exposed_s:.3g} s exposed)"))

    search([(0, bases[0])])
    # Recomputation only adds FLOPs to liveness' own time, the least any plan can take: if a liveness plan is
    # already within GOOD_ENOUGH of it, no recomputation base can win, and computing them is skipped.
    if best_time() * (1 - GOOD_ENOUGH) > own_time["liveness"]:
        bases += recompute_bases()
        search(list(enumerate(bases))[1:])

    if not any(t.fits for t in res.trials) and frugal:
        # Nothing fits: the most frugal plans (every candidate offloaded, just in time) name the smallest budget.
        for name, layout, search in tried:
            if search.cands:
                cr = search.place_tight()
                evaluate(Trial(label(f"{name} + offload (tightest)", layout), cr.plan,
                               note=f"all {cr.candidates} candidates offloaded, prefetched just in time"))

    if not any(t.fits for t in res.trials) and route.fused_update:
        # Stage 3: the training state itself does not fit beside the activations: home weights on the host.
        for _, _, name, sched, rs, _ in sorted(((own_time[n], i, n, s, r, "") for i, (n, s, r) in enumerate(bases)),
                                               key=lambda e: (e[0], e[1])):
            reads = {s.root: s.root_reads[0] for s in rs.segments if s.root_reads} if rs else {}
            t = weights_search(route, sched, ws, budget, device, reads, evaluate, name)
            if t is not None and t.fits:
                break

    fitting = [t for t in res.trials if t.fits]
    if fitting:
        res.plan = min(fitting, key=lambda t: (t.est_step_time_s, t.min_budget_bytes)).plan
    elif frugal:
        res.frugal = min((t for t in res.trials if t.plan is not None), key=lambda t: t.min_budget_bytes)
    return res


WEIGHTS_SEARCH_STEPS = 6
"""At most this many placements of `cache_search` to find the fewest layers whose weights go to the host."""


def weights_search(route: Route, base: Schedule, ws: dict[int, WorkspaceChoice], budget: int, device,
                   reads: dict[str, int], evaluate, name: str) -> Trial | None:
    """The fewest layers whose weights and optimizer state must live on the host (largest first, host update,
    the activation cache on top) for `base` to fit `budget`: every candidate first; if that fits, a binary search
    on how many; if not, the same with prefetches just in time (the most frugal weights plan)."""
    layers = weights_decision.layer_candidates(route)
    if not layers:
        return None

    def trial(n: int, lead: int = 1) -> Trial:
        sched = weights_decision.weights_schedule(route, base, layers[:n], host_update=True, lead=lead)
        cr = cache_search(route, sched, ws, budget, device, reads)
        p = cr.plan
        return Trial(f"{name} + weights on host ({n} of {len(layers)} layers) + offload", p,
                     note=f"{cr.offloaded} of {cr.candidates} activation candidates offloaded"
                          + ("" if lead else "; weights prefetched just in time"))

    full = evaluate(trial(len(layers)))
    if not full.fits:
        return evaluate(trial(len(layers), lead=0))
    lo, hi, best = 0, len(layers), full
    for _ in range(WEIGHTS_SEARCH_STEPS):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        t = evaluate(trial(mid))
        if t.fits:
            hi, best = mid, t
        else:
            lo = mid
    return best


def plan_auto(route: Route, budget: int | None, device: str = "cpu", costs: CostTable | None = None) -> Plan:
    """The search on `route`; where nothing fits and the route has rebuildable aux tensors (attention's scores,
    `Route.rebuildable_aux`: B H T^2 values a layer, kept until its backward whatever else moves), the search again
    on the route without them (backward rebuilds them, same bits), as policy `recompute` does: kept where they
    fit (backward then rebuilds nothing), left out where only that fits."""
    res = auto_search(route, budget, device, costs)
    rebuildable = route.rebuildable_aux()
    if res.plan is None and rebuildable:
        alt = auto_search(route.without_aux(rebuildable), budget, device, costs)
        if alt.plan is not None or alt.frugal.plan.min_budget_bytes < res.frugal.plan.min_budget_bytes:
            res = alt
    if res.plan is None:
        f = res.frugal
        p = f.plan
        raise BudgetError(
            f"budget {format_bytes(budget)} ({budget:,} B) is too small for policy 'auto': no combination of "
            f"liveness, recomputation, offload and workspace sizing fits. The "
            f"smallest budget that works is {format_bytes(p.min_budget_bytes)} ({p.min_budget_bytes:,} B), with "
            f"the most memory-frugal plan ({f.name}), bound at step {p.binding_step} ({p.binding_label}).\n"
            f"tried:\n{res.summary()}", p.min_budget_bytes, p.binding_label)
    return finalize(res.plan, budget, policy="auto")


def auto_policy(route: Route, budget: int | None, device: str, costs: CostTable | None = None) -> Plan:
    """The `auto` policy: the fastest plan that fits `budget` (liveness without one)."""
    return plan_auto(route, budget, device or "cpu", costs)
