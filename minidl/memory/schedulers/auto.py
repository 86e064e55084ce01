"""Policy `auto`: given a budget, the fastest plan that fits, searched over every mechanism minidl has.

The mechanisms trade memory for time in different currencies:

- **liveness** costs nothing: free every tensor after its last use. Always on.
- **workspace sizing** costs convolution speed: a slower algorithm with less scratch space. Always on under a
  budget, per step: each convolution gets the fastest algorithm whose workspace fits what is free then
  (`workspace.py`), so it only slows down the steps where memory is actually short.
- **recomputation** costs FLOPs: cheap layers' outputs are rebuilt in backward (`recompute.py`), either
  speed-centric (each segment once) or memory-centric (per use: more FLOPs, less memory).
- **offload** costs link bandwidth, hidden behind compute when the schedule allows: checkpoints wait on the
  host between their forward and backward uses (`decisions/offload.py`).

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

**The other exact policies** (`window`, `offload`, `recompute`, `weights`, `packs`, `liveness`, `none`) are
candidates too (`Rival`, `AutoSearch.rivals`): each one's own plan, made by its own function on the route
`plan_network` gives it, so `auto` plans wherever one of them does, with an estimated step no slower. A rival is
skipped, and its skip named in the plan's `decision` (`--explain`), where it cannot be faster (its route's compute
alone, `least_time`, is no less than the best plan found: an exact bound, so the guarantee holds), where it would
home weights that must stay on the device (`PlanOptions.host_weights` off), or where the route is longer than
`SEARCH_MAX_STEPS` (their own searches take minutes there). Policy `packs` is not planned on its own where the
micro-batch search runs: its plan is layer packs at one of the counts that search plans packs at (1 included).

The search is a list of `Candidate` records (base, decisions on top, layout, micro-batch count, plan, estimated
time), made and timed by `AutoSearch` stage by stage; the fastest that fits is the plan (`rank`), and its
`decision` says which and why.

**Micro-batches** are weighed by time like the other decisions (`micro_batch_search`): 2, 4, 8, ...
micro-batches dividing the batch, in increasing order while one count's compute alone could still beat the best
plan found (a smaller micro-batch only adds to each step's cost, so the first count that cannot win ends the
search). Harmony's layer packs (`schedulers/packs.py`) are weighed at every count, 1 included; `auto`'s own search
on the micro-batched route (gradient accumulation) where no plan of the batch whole fits, since a micro-batched
plan trains to the bits of `none` with the same `--micro-batches`, not of the batch whole (BatchNorm normalizes
each micro-batch; gradients are summed per micro-batch). More micro-batches keep fewer activations: fewer copies,
faster workspaces, or a fit where one batch has none. `PlanOptions.max_micro_batches` bounds the count (1: the
batch stays whole), and a route already cut into micro-batches (`--micro-batches`) keeps its count. VGG-16 at
batch 1024 on a K40c: 43 GiB as one batch, 16 micro-batches of liveness under 12 GB. The smallest budget a
BudgetError states is verified with the batch whole (`policies.plan_network`): searching every count at each of
the verification's dozen budgets costs minutes.

If nothing fits, `BudgetError` states the smallest budget that works: that of the most memory-frugal plan
(every mechanism at its most frugal: memory-centric recomputation, every candidate offloaded and prefetched just
in time, the smallest workspace everywhere) or a rival's own minimum, whichever is smaller, then verified and
searched by `policies.plan_network` (`schedulers/minimum.py`): planning at the stated number succeeds.

Offload composed with recomputation needs one adjustment: a checkpoint that a recomputation reads must be back
on the device *before* the recomputation sequence at that step boundary, which runs before the boundary's plain
allocations and waits. So a root's "first backward use" for offload purposes is its first recomputation read,
its prefetch (when just in time) and its wait are the first items of that boundary's sequence, and its end keeps
the recomputation sequence number.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ...core.errors import BudgetError
from ...core.tensors import Role
from ...graph.packs import PackError
from ...graph.route import Route
from ..decisions import offload as offload_decision
from ..decisions import offload_fit
from ..decisions import weights as weights_decision
from ..decisions.recompute import MEMORY, RecomputeSchedule, compute_peak_lower_bound, recompute_schedule
from ..liveness import analyze
from ..plan import EventKind, Plan
from ..planner import Residency, Schedule, WorkspaceChoice, finalize, liveness_schedule, place
from ..pool import ALIGNMENT, align_up, format_bytes
from ..simulate import get_profile, simulate, step_costs
from ..workspace import CostTable, workspace_choices
from .packs import plan_packs, step_floor


@dataclass(slots=True)
class Candidate:
    """One plan `auto` considered: the decisions it combines (a base schedule, the mechanisms put on top of it,
    the arena layout, the micro-batch count), the plan when one was placed, and what the search learnt of it.

    The search is a list of these: it ranks them by `est_step_time_s` among those that fit, and, when none fits,
    names the smallest budget from the one with the smallest `min_budget_bytes`."""

    base: str                               # the base schedule: liveness or a recomputation variant (`Base`)
    decisions: tuple[str, ...] = ()         # mechanisms on top of it, in words: "offload", "compress", ...
    layout: str = ""                        # the arena layout (`LAYOUTS`), "" for the plain one
    micro_batches: int = 1                  # the batch split into this many micro-batches (packs.py)
    plan: Plan | None = None                # None: not placed (`note` says why)
    fits: bool = False                      # the plan's smallest arena is within the budget
    est_step_time_s: float = math.inf       # the simulator's estimate (and the codec's, for compression), if it fits
    note: str = ""
    error: BudgetError | None = None        # a rival policy that does not fit: its error, naming what it needs
    unsearched: bool = False                # not planned to keep planning time short: named in the decision
    lossy: bool = False                     # compressed (`auto --lossy`): chosen only where strictly faster

    @property
    def name(self) -> str:
        text = " + ".join((self.base,) + self.decisions)
        if self.layout:
            text += f", {self.layout}"
        return text + (f", {self.micro_batches} micro-batches" if self.micro_batches > 1 else "")

    @property
    def min_budget_bytes(self) -> int:
        if self.plan is not None:
            return self.plan.min_budget_bytes
        return self.error.min_budget_bytes or 0 if self.error is not None else 0

    @property
    def peak_bytes(self) -> int:
        return self.plan.peak_bytes if self.plan is not None else 0


def rank(c: Candidate) -> tuple[float, bool, int]:
    """How the search orders plans that fit: the fastest; at equal times an exact plan before a lossy one, then the
    smaller arena."""
    return c.est_step_time_s, c.lossy, c.min_budget_bytes


@dataclass(slots=True)
class AutoResult:
    plan: Plan | None
    trials: list[Candidate] = field(default_factory=list)
    frugal: Candidate | None = None

    @property
    def chosen(self) -> Candidate | None:
        """The candidate whose plan the search returns (None if nothing fits)."""
        return next((t for t in self.trials if self.plan is not None and t.plan is self.plan), None)

    def summary(self) -> str:
        lines = []
        for t in self.trials:
            mark = "*" if self.plan is not None and t.plan is self.plan else " "
            state = "fits" if t.fits else ("over budget" if t.plan is not None or t.error is not None else "skipped")
            time = f"{t.est_step_time_s * 1e3:9.2f} ms" if math.isfinite(t.est_step_time_s) else "        -   "
            mb = format_bytes(t.min_budget_bytes) if t.plan is not None or t.error is not None else "-"
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
        cands.append(offload_decision.Offloadable(tid, spec.nbytes, lf, fb, r, clock.start[fb] - clock.end(lf), True,
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
                 root_reads: dict[str, int] | None = None, streams=None):
        """`streams(clock)`, if given, adds candidates the base's own tensors do not show: its compressed
        streams (`compress.stream_candidates`)."""
        self.route, self.base, self.ws, self.budget = route, base, ws, budget
        self.dev = get_profile(device) if isinstance(device, str) else device
        self.clock = offload_decision._clock(route, self.dev, offload_decision.copy_slack(self.dev))
        self.cands = offload_candidates(route, base, self.clock, root_reads or {})
        if streams is not None:
            self.cands = sorted(self.cands + streams(self.clock), key=lambda c: (-c.priority, -c.nbytes, c.tensor))
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
    return dataclasses.replace(sched, residencies=res, markers=list(sched.markers), host_steps=set(sched.host_steps))


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


def least_time(route: Route, device) -> float:
    """The least step time the simulator can give a plan of `route` (or of it without its rebuildable aux tensors,
    which a plan may leave out): every step on its fastest algorithm, nothing recomputed, no copy waited for
    (`simulate` only adds to this). A plan of the same network cut into micro-batches, packed or not, takes no
    less: each step's roofline cost is the larger of two sums, and summing it per micro-batch only adds."""
    dev = get_profile(device) if isinstance(device, str) else device
    rebuildable = route.rebuildable_aux()
    routes = (route, route.without_aux(rebuildable)) if rebuildable else (route,)
    return min(math.fsum(c.time_s for c in step_costs(r, dev)) for r in routes)


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms" if seconds < 1 else f"{seconds:.4g} s"


# -- rivals: the other exact policies, each one candidate -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Rival:
    """Another exact policy `auto` plans as one of its candidates: its name and planning function (the policy
    table's, `memory/policies.py`) and how to build the route `plan_network` gives that policy (its update not
    fused where `auto`'s is; the batch in packs for `packs`), so that `auto` plans wherever it does, at least as
    fast. Built only when planned (a route of a deep network takes seconds to build). `homes_weights`: its plans
    may keep weights on the host, which `PlanOptions.host_weights` off rules out. `packs_batch`: its plan is layer
    packs at a micro-batch count it chooses (`packs.plan_packs`), one of those `micro_batch_search` plans packs at."""

    name: str
    plan: Callable[[Route, "int | None", str, "CostTable | None"], Plan]
    route_of: Callable[[], Route]
    homes_weights: bool = False
    packs_batch: bool = False

    @property
    def candidate_name(self) -> str:
        return f"policy '{self.name}'"


SEARCH_MAX_STEPS = 6000
"""The longest route `auto` plans beyond its own search: rivals are planned on routes of at most this many steps
(ResNet-500 has 4,357, ResNet-1001 8,699), and once a plan fits, micro-batch counts whose route would be longer are
not searched. On ResNet-2500 (16,671 steps) at 12 GB on a K40c, policy `offload` alone plans in 170 s, `weights` in
35 s, `packs` in 24 s, `window` in 12 s, against `auto`'s own 4 s; `packs` on GPT2-XL at batch 64 searches routes of
up to 64 micro-batches for minutes (shared 2-core EPYC). Each skip is named in the plan's `decision` (`--explain`)."""


NOTE_CHARS = 140
"""The longest note a line of `AutoResult.summary` carries: with its name and figures, a line stays under 250
characters (`minidl plan --explain` prints one per candidate when nothing fits)."""


More = Callable[[Route], "list[Candidate]"]
"""Candidates a caller adds to each route `auto` searches (the route as given, and each micro-batched one), placed
and timed: `auto --lossy`'s compressed plans (`schedulers/lossy.py`)."""


# -- the search -------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Base:
    """A base schedule the search puts decisions on: plain liveness or a recomputation variant."""

    name: str
    schedule: Schedule
    own_time_s: float                  # its step time with nothing moved: no plan built on it can be faster
    root_reads: dict[str, int] = field(default_factory=dict)   # checkpoint -> first step a recomputation reads it


class AutoSearch:
    """The candidates `auto` tries under one budget, in the order the module docstring gives, each one placed and
    timed once (`consider`); `auto_search` says which stages run."""

    def __init__(self, route: Route, budget: int | None, device, costs: CostTable | None = None):
        self.route, self.budget, self.device, self.costs = route, budget, device, costs
        self.ws = workspace_choices(route, costs)
        self.iv = analyze(route)
        self.tried: list[Candidate] = []
        self.offloads: list[tuple[Base, str, OffloadSearch]] = []  # offload searches made, for the frugal stage

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def consider(self, cand: Candidate) -> Candidate:
        """Record `cand`; if placed, whether it fits and (if so) its simulated step time."""
        if cand.plan is not None:
            cand.fits = self.budget is None or cand.plan.min_budget_bytes <= self.budget
            if cand.fits:
                cand.est_step_time_s = simulate(cand.plan, self.device).est_step_time_s
        self.tried.append(cand)
        return cand

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.tried if c.fits]

    def best_time(self) -> float:
        return min((c.est_step_time_s for c in self.fitting), default=math.inf)

    def could_win(self, time_s: float) -> bool:
        """A candidate whose best possible time is `time_s` could still beat the best fitting one by more than
        `GOOD_ENOUGH`."""
        return time_s < self.best_time() * (1 - GOOD_ENOUGH)

    def result(self, frugal: bool) -> AutoResult:
        res = AutoResult(None, self.tried)
        if self.fitting:
            res.plan = min(self.fitting, key=rank).plan
        elif frugal and any(c.plan is not None or c.error is not None for c in self.tried):
            res.frugal = min((c for c in self.tried if c.plan is not None or c.error is not None),
                             key=lambda c: c.min_budget_bytes)
        return res

    # -- bases ----------------------------------------------------------------------------------------------
    def base(self, name: str, sched: Schedule, rs: RecomputeSchedule | None = None) -> Base:
        reads = {s.root: s.root_reads[0] for s in rs.segments if s.root_reads} if rs is not None else {}
        return Base(name, sched, schedule_time(self.route, sched, self.device), reads)

    def liveness_base(self) -> Base:
        return self.base("liveness", liveness_schedule(self.route, self.ws))

    def recompute_bases(self) -> list[Base]:
        """Speed-centric where the budget allows, the default (speed-centric under the bottleneck), and
        memory-centric: the variants whose segment modes differ."""
        route, ws, iv = self.route, self.ws, self.iv
        default = recompute_schedule(route, ws, limit=None, iv=iv)
        if not default.segments:
            return []
        modes = [s.mode for s in default.segments]
        under_budget = recompute_schedule(route, ws, limit=max(self.budget, default.bottleneck), iv=iv)
        memory = recompute_schedule(route, ws, mode=MEMORY, iv=iv)
        out = []
        if [s.mode for s in under_budget.segments] != modes:
            out.append(self.base("recompute (speed under budget)", under_budget.schedule, under_budget))
        out.append(self.base("recompute", default.schedule, default))
        if [s.mode for s in memory.segments] != modes:
            out.append(self.base("recompute (memory-centric)", memory.schedule, memory))
        return out

    # -- stages ---------------------------------------------------------------------------------------------
    def explore(self, bases: list[Base]) -> None:
        """Each base placed as it is (plain layout and small long-lived tensors pinned); then offload on the
        bases that do not fit, in order of their best possible time, while one could still win."""
        for b in bases:
            if compute_peak_lower_bound(self.route, b.schedule, self.ws) > self.budget:
                # cannot fit without offload (placing it would only confirm that)
                self.consider(Candidate(b.name, note="skipped: busiest step alone exceeds the budget"))
                continue
            for layout in ("", "grads+aux pinned"):
                self.consider(Candidate(b.name, layout=layout, plan=place(
                    self.route, self.ws, pin_long_lived(self.route, b.schedule, LAYOUTS[layout]), self.budget)))
        # Offload: every (base, layout) that could still win is fitted on the byte timeline (no placement) and
        # ranked by its own time; then placed in that order while its estimate beats the best plan found.
        fitted = {b.name for b in bases for c in self.fitting if c.base == b.name and not c.decisions}
        order = sorted(((b.own_time_s, i, li, b, layout) for i, b in enumerate(bases) if b.name not in fitted
                        for li, layout in enumerate(LAYOUTS)), key=lambda e: e[:3])
        for own, _, _, b, layout in order:
            if not self.could_win(own):
                break             # sorted by their best possible time: none of the rest can win (by more than a hair)
            search = OffloadSearch(self.route, pin_long_lived(self.route, b.schedule, LAYOUTS[layout]), self.ws,
                                   self.budget, self.device, b.root_reads)
            self.offloads.append((b, layout, search))
            if not self.could_win(own + search.est_exposed_s):
                continue          # its estimate already loses: not worth a placement
            cr = search.place_fitted()
            if cr is not None:
                self.consider(Candidate(b.name, ("offload",), layout, plan=cr.plan, note=(
                    f"{cr.offloaded} of {cr.candidates} candidates offloaded, copies fitted to the budget "
                    f"(estimated {search.est_exposed_s:.3g} s exposed)")))

    def tightest(self) -> None:
        """The most frugal plans (every candidate offloaded, just in time): they name the smallest budget."""
        for b, layout, search in self.offloads:
            if search.cands:
                cr = search.place_tight()
                self.consider(Candidate(b.name, ("offload (tightest)",), layout, plan=cr.plan,
                                        note=f"all {cr.candidates} candidates offloaded, prefetched just in time"))

    def weights(self, bases: list[Base]) -> None:
        """Weights on the host, on each base in order of its own time, until one fits (`weights_search`)."""
        for b in sorted(bases, key=lambda b: b.own_time_s):
            found = weights_search(self, b)
            if found is not None and found.fits:
                return

    def rivals(self, rivals: Sequence[Rival]) -> None:
        """Each other exact policy's own plan, on its own route, unless `rival_skipped` says why not."""
        for r in rivals:
            why = self.rival_skipped(r)
            if why:
                self.consider(Candidate(r.candidate_name, note=f"skipped: {why}"))
                continue
            try:
                plan = r.plan(r.route_of(), self.budget, self.device, self.costs)
            except BudgetError as e:
                self.consider(Candidate(r.candidate_name, error=e, note="its own plan does not fit"))
                continue
            self.consider(Candidate(r.candidate_name, micro_batches=plan.route.micro_batches, plan=plan,
                                    note="its own plan, on its own route"))

    def rival_skipped(self, r: Rival) -> str:
        """Why `r` is not planned, or "": it would home weights that must stay on the device; the micro-batch
        search plans its plan (`Rival.packs_batch`); the route is longer than `SEARCH_MAX_STEPS`; or its least
        possible time (`least_time`) is no less than the best plan's, so it cannot be faster."""
        if r.homes_weights and not self.route.options.host_weights:
            return "plans that keep weights on the host, and weights stay on the device here (host_weights off)"
        if r.packs_batch and splittable(self.route, self.budget):
            return "a plan of layer packs at a micro-batch count, each one planned by the micro-batch search"
        if len(self.route.steps) > SEARCH_MAX_STEPS:
            return (f"the route has {len(self.route.steps):,} steps, more than {SEARCH_MAX_STEPS:,}: the other "
                    f"policies' own searches take minutes there (SEARCH_MAX_STEPS)")
        least, best = least_time(r.route_of(), self.device), self.best_time()
        if least >= best:
            return f"cannot beat the {_time(best)} plan that fits: compute alone takes as long or longer"
        return ""


def auto_search(route: Route, budget: int | None, device: str = "cpu", costs: CostTable | None = None,
                frugal: bool = True, rivals: Sequence[Rival] = (), more: More | None = None) -> AutoResult:
    """Try the combinations (module docstring) and return the fastest that fits `budget`.

    Without a budget, the fastest plan is plain liveness with every convolution on its fastest algorithm.
    The liveness base is explored first (`AutoSearch.explore`: placed as it is, then with offload); the
    recomputation bases only if liveness' best plan is not already within `GOOD_ENOUGH` of liveness' own time,
    the least any plan can take. If nothing fits, the most frugal offload plans (`frugal`) and then weights on the
    host (fused-update routes) are tried. Then the `rivals` (`AutoSearch.rivals`), and the candidates `more` makes
    of the route (`auto --lossy`: compression), placed and timed. When nothing fits, `frugal` is the candidate with
    the smallest budget.
    """
    search = AutoSearch(route, budget, device, costs)
    if budget is None:
        search.consider(Candidate("liveness", plan=place(route, search.ws, liveness_schedule(route, search.ws))))
        return search.result(frugal)
    if not frugal and step_floor(route) > budget:
        search.consider(Candidate("any", note="skipped: the busiest step alone exceeds the budget"))
        return search.result(frugal)
    bases = [search.liveness_base()]
    search.explore(bases)
    if search.could_win(bases[0].own_time_s):
        recomputing = search.recompute_bases()
        search.explore(recomputing)
        bases += recomputing
    if not search.fitting and frugal:
        search.tightest()
    if not search.fitting and route.fused_update and route.options.host_weights:
        search.weights(bases)
    search.rivals(rivals)
    if more is not None:
        search.tried += more(route)
    return search.result(frugal)


WEIGHTS_SEARCH_STEPS = 6
"""At most this many placements of `cache_search` to find the fewest layers whose weights go to the host."""


def weights_search(search: AutoSearch, base: Base) -> Candidate | None:
    """The fewest layers whose weights and optimizer state must live on the host (largest first, host update,
    the activation cache on top) for `base` to fit the budget: every candidate first; if that fits, a binary
    search on how many; if not, the same with prefetches just in time (the most frugal weights plan)."""
    route = search.route
    layers = weights_decision.layer_candidates(route)
    if not layers:
        return None

    def trial(n: int, lead: int = 1) -> Candidate:
        sched = weights_decision.weights_schedule(route, base.schedule, layers[:n], host_update=True, lead=lead)
        cr = cache_search(route, sched, search.ws, search.budget, search.device, base.root_reads)
        return search.consider(Candidate(
            base.name, (f"weights on host ({n} of {len(layers)} layers)", "offload"), plan=cr.plan,
            note=f"{cr.offloaded} of {cr.candidates} activation candidates offloaded"
                 + ("" if lead else "; weights prefetched just in time")))

    full = trial(len(layers))
    if not full.fits:
        return trial(len(layers), lead=0)
    lo, hi, best = 0, len(layers), full
    for _ in range(WEIGHTS_SEARCH_STEPS):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        t = trial(mid)
        if t.fits:
            hi, best = mid, t
        else:
            lo = mid
    return best


# -- micro-batches: weighed by time, like every other decision --------------------------------------------------
def splittable(route: Route, budget: int | None) -> bool:
    """Whether `auto` may cut `route`'s batch itself under `budget`: a fused training route not already cut into
    micro-batches (not data parallel, `--fused-update off`, inference or the user's `--micro-batches`)."""
    return budget is not None and route.training and route.fused_update and route.packing is None


def micro_batch_counts(route: Route, budget: int | None) -> list[int]:
    """The micro-batch counts `auto` may try by itself on `route` under `budget` (`splittable`): 2, 4, 8, ...
    dividing the batch, up to the route's `PlanOptions.max_micro_batches`."""
    if not splittable(route, budget):
        return []
    batch = route.network.input_nodes[0].shape[0]
    limit = min(batch, route.options.max_micro_batches or batch)
    out, m = [], 2
    while m <= limit:
        if batch % m == 0:
            out.append(m)
        m *= 2
    return out


def micro_batch_search(route: Route, budget: int, device, costs: CostTable | None = None,
                       best_s: float = math.inf, more: More | None = None, whole_fits: bool = False) -> AutoResult:
    """The fastest plan with the batch cut into micro-batches (`micro_batch_counts`), to beat a plan of `best_s`
    seconds (inf: none fits yet): at each count, Harmony's layer packs (`schedulers/packs.py`: packs cut to fit,
    weights brought in once per pack; also at one micro-batch), and, where no plan of the batch whole fits
    (`whole_fits` false), `auto`'s own search on the micro-batched route (gradient accumulation). More
    micro-batches keep fewer activations (fewer copies, faster workspaces, or a fit where one batch has none) but
    run smaller kernels: each step's cost only grows with the count (`least_time`), so the counts are searched in
    increasing order until one's compute alone cannot beat the best plan found, or, once a plan fits, until its
    route would be longer than `SEARCH_MAX_STEPS`.

    Why `auto` does not cut a batch that fits whole by itself: a micro-batched plan trains to the bits of `none`
    with those micro-batches, not of the batch whole (BatchNorm normalizes each micro-batch), and the roofline
    charges nothing per step, so many small steps look almost free. ResNet-20 at batch 32 on the digits in 4 MiB
    (README's first command): 16 micro-batches of 2 estimated 2.5% faster than `window`'s plan (13.55 against
    13.89 ms), measured 718 against 139 ms a median step (shared 2-core EPYC). Policy `packs` cuts the batch itself:
    its plans are weighed at every count, so `auto` is never slower than it."""
    tried: list[Candidate] = []
    best: Candidate | None = None
    packs_too = route.options.host_weights   # (layer packs bring each pack's weights in from the host)
    least = least_time(route, device)
    if whole_fits and not packs_too:
        return AutoResult(None, [Candidate("any", note="micro-batches skipped: the batch fits whole")])
    if not least < best_s:   # no count can beat it: each one's compute is at least `least`
        return AutoResult(None, [Candidate("any", note=(
            f"micro-batches skipped: one batch's compute alone takes {_time(least)}, and a plan of "
            f"{_time(best_s)} fits"))])
    for m in ([1] if packs_too else []) + micro_batch_counts(route, budget):
        if m > 1:
            if math.isfinite(best_s) and m * len(route.steps) > SEARCH_MAX_STEPS:
                tried.append(Candidate("layer packs" if whole_fits else "any plan", micro_batches=m, unsearched=True,
                                       note=f"skipped: from this count on: its route would have about "
                                            f"{m * len(route.steps):,} steps, more than {SEARCH_MAX_STEPS:,} "
                                            f"(SEARCH_MAX_STEPS), and a plan fits"))
                break
            try:
                mroute = route.with_micro_batches(m)
            except PackError as e:   # a network the packed route cannot express: it stays one batch
                tried.append(Candidate("any", micro_batches=m, note=f"skipped: {e}"))
                break
            if step_floor(mroute) > budget:
                tried.append(Candidate("any", micro_batches=m,
                                       note="skipped: one micro-batch's busiest step alone exceeds the budget"))
                continue
            least = least_time(mroute, device)
            if not least < best_s:   # nor can more micro-batches: their compute only grows
                tried.append(Candidate("any plan", micro_batches=m, note=(
                    f"skipped: from this count on: its compute alone takes {_time(least)}, and a plan of "
                    f"{_time(best_s)} fits")))
                break
            if not whole_fits:
                res = auto_search(mroute, budget, device, costs, frugal=False, more=more)
                for c in res.trials:
                    c.micro_batches = m
                tried += res.trials
        if packs_too:
            try:
                packed = plan_packs(route, budget, device, costs, micro_batches=m)
            except BudgetError as e:   # (its figure in the table's min budget column)
                tried.append(Candidate("layer packs", ("weights per pack", "offload"), micro_batches=m, error=e,
                                       note="no packing fits"))
            except PackError as e:
                tried.append(Candidate("layer packs", ("weights per pack", "offload"), micro_batches=m,
                                       note=f"no packing: {e}".splitlines()[0][:NOTE_CHARS]))
            else:
                n = len(packed.route.packing.packs)
                tried.append(Candidate(f"layer packs ({n} pack{'s' if n > 1 else ''})", ("weights per pack", "offload"),
                                       micro_batches=m, plan=packed, fits=True,
                                       est_step_time_s=simulate(packed, device).est_step_time_s))
        for c in tried:
            if c.fits and (best is None or rank(c) < rank(best)):
                best = c
        if best is not None:
            best_s = min(best_s, best.est_step_time_s)
    return AutoResult(best.plan if best is not None else None, tried)


def micro_decision(micro: AutoResult, budget: int, single: AutoResult) -> str:
    """Why a micro-batched plan (`micro_batch_search`'s choice): what it beat in the search on the route as given
    (the best plan of one batch, if any fits, and a rival that cut the batch itself)."""
    c, other = micro.chosen, single.chosen
    whole = min((t for t in single.trials if t.fits and t.micro_batches == 1), default=None,
                key=lambda t: t.est_step_time_s)
    if whole is not None:
        why = f"faster than the fastest single-batch plan ({whole.name}, est {_time(whole.est_step_time_s)})"
    else:
        why = f"no single-batch plan fits {format_bytes(budget)}" + (
            f" (the most frugal needs {format_bytes(single.frugal.min_budget_bytes)})" if single.frugal else "")
    if other is not None and other.micro_batches > 1:
        why += f"; faster than {other.name} (est {_time(other.est_step_time_s)})"
    counts = sorted({t.micro_batches for t in micro.trials if t.fits})
    return (f"{c.name} (est {_time(c.est_step_time_s)}): {why}; the fastest of the "
            f"{sum(t.fits for t in micro.trials)} plans that fit at {', '.join(map(str, counts))} micro-batches")


def not_planned(*results: AutoResult) -> str:
    """What `auto` did not plan, grouped by why, one line each (for the plan's `decision`; "" if nothing): the
    rivals it skipped, and the candidates left out to keep planning time short (`Candidate.unsearched`)."""
    why: dict[str, list[str]] = {}
    for res in results:
        for t in res.trials:
            if t.unsearched or (t.name.startswith("policy '") and t.plan is None and t.error is None):
                why.setdefault(t.note.removeprefix("skipped: "), []).append(t.name.removeprefix("policy "))
    return "".join(f"\n  not planned: {', '.join(names)}: {reason}" for reason, names in why.items())


def plan_auto(route: Route, budget: int | None, device: str = "cpu", costs: CostTable | None = None,
              policy: str = "auto", rivals: Sequence[Rival] = (), more: More | None = None) -> Plan:
    """`auto_search` on `route` (with the `rivals`, and `more`'s candidates under a budget); where nothing fits and
    the route has rebuildable aux tensors (attention's scores, `Route.rebuildable_aux`: B H T^2 values a layer,
    kept until its backward whatever else moves), the search again on the route without them (backward rebuilds
    them, same bits), as policy `recompute` does: kept where they fit (backward then rebuilds nothing), left out
    where only that fits. Then the batch cut into micro-batches where that could be faster, or where nothing fits
    (`micro_batch_search`). The fastest plan is returned (`rank`); its `decision` says which and why, and which
    rivals were not planned."""
    more = more if budget is not None else None
    res = auto_search(route, budget, device, costs, rivals=rivals, more=more)
    rebuildable = route.rebuildable_aux()
    if res.plan is None and rebuildable:
        alt = auto_search(route.without_aux(rebuildable), budget, device, costs, more=more)
        if alt.plan is not None or alt.frugal.min_budget_bytes < res.frugal.min_budget_bytes:
            alt.trials = res.trials + alt.trials   # (the rivals were planned on the route as given)
            res = alt
    single = res.chosen
    micro = AutoResult(None)
    if splittable(route, budget):
        whole = any(t.fits and t.micro_batches == 1 for t in res.trials)
        micro = micro_batch_search(route, budget, device, costs,
                                   single.est_step_time_s if single is not None else math.inf, more, whole)
    if micro.plan is not None and (single is None or rank(micro.chosen) < rank(single)):
        micro.plan.decision = micro_decision(micro, budget, res) + _lossy_note(micro.chosen, res, micro) \
            + not_planned(res, micro)
        return finalize(micro.plan, budget, policy=policy)
    if res.plan is not None:
        res.plan.decision = (f"{single.name}: the fastest of {sum(t.fits for t in res.trials)} candidates that fit"
                             f" (of {len(res.trials)} tried)" + _lossy_note(single, res, micro)
                             + not_planned(res, micro))
        return finalize(res.plan, budget, policy=policy)
    f = res.frugal
    counts = micro_batch_counts(route, budget)
    tried = res.summary() + ("\n" + AutoResult(None, micro.trials).summary() if micro.trials else "")
    where = (f"with the most memory-frugal plan ({f.name}), bound at step {f.plan.binding_step} "
             f"({f.plan.binding_label})" if f.plan is not None else
             f"with {f.name}'s own plan (its figure, bound at {f.error.binding})")
    raise BudgetError(
        f"budget {format_bytes(budget)} ({budget:,} B) is too small for policy '{policy}': no combination of "
        f"liveness, recomputation, offload, weights on the host and workspace sizing fits, nor any other exact "
        f"policy's own plan" + (f", nor with the batch split into {', '.join(map(str, counts))} micro-batches"
                                if counts else "")
        + f". The smallest budget that works is {format_bytes(f.min_budget_bytes)} ({f.min_budget_bytes:,} B), "
        f"{where}.\ntried:\n{tried}", f.min_budget_bytes,
        f.plan.binding_label if f.plan is not None else f.error.binding)


def _lossy_note(chosen: Candidate, *results: AutoResult) -> str:
    """For a lossy choice: its estimate and the fastest exact plan's, which it beat ("" for an exact choice)."""
    if not chosen.lossy:
        return ""
    exact = min((t.est_step_time_s for r in results for t in r.trials if t.fits and not t.lossy), default=math.inf)
    return (f" (est {_time(chosen.est_step_time_s)} with the codec; the fastest exact plan "
            + (f"{_time(exact)})" if math.isfinite(exact) else "does not fit)"))


def auto_policy(route: Route, budget: int | None, device: str, costs: CostTable | None = None,
                rivals: Sequence[Rival] = ()) -> Plan:
    """The `auto` policy: the fastest plan that fits `budget` (liveness without one)."""
    return plan_auto(route, budget, device or "cpu", costs, rivals=rivals)
