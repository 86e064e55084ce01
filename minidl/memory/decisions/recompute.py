"""Cost-aware recomputation (SuperNeurons): drop the outputs of cheap layers after forward, rebuild them in backward.

Vocabulary: a **member** is a droppable tensor (the output of a single-input, non-checkpoint layer with no workspace
whose aux tensors are planned); members descend, through members only, from one kept tensor, their **root**; a
root's members form its **segment** (a tree). A segment is dropped only where the members backward reads outweigh
keeping the root longer (a ResNet add's ReLU saves nothing).

Vocabulary used below.

- A **member** is a droppable tensor: the output of a single-input, non-checkpoint layer that needs no
  workspace nor staging (the float32 copies a half mode's kernels take on the CPU: `Step.staging`) and whose
  saved aux tensors (BN's batch statistics) are planned.
- Every member descends, through members only, from exactly one kept tensor, its **root** (the checkpoint).
  The members of one root form its **segment**: a tree (cheap layers have one input, but their output may feed
  several layers, e.g. the ReLU that feeds both the next block and the shortcut of a ResNet).
- A segment is **dropped** only if that saves memory across the forward->backward turn: the members that
  backward reads must outweigh what keeping the root longer costs. (A ResNet's add feeds one ReLU: dropping the
  ReLU's output would only swap it for the add's output of the same size, for nothing.) That is the first half
  of "cost-aware".
- **Recomputing** a member before backward step `j` needs its parent resident: either the parent is itself
  resident at `j` (recomputed earlier and still kept) or it is rebuilt first, transiently, and freed as soon as
  its children are rebuilt. So each recomputation at a step boundary is a little sequence, root first:

      before step j:  recompute bn1 (reads conv1) -> recompute relu1 (reads bn1) -> free bn1 -> step j

  The planner places such events in exactly this order (`Residency.start_seq` / `end_seq`): at one boundary,
  explicit sequences run after the frees and before the plain allocations, and the executor applies events in
  list order. The root must stay resident until its last recomputation reads it, so its residency is extended
  when liveness alone would have freed it earlier.

The two ways to rebuild a segment (the second half of "cost-aware"):

- **speed-centric**: at the first backward step that reads any member, rebuild the whole segment once and keep
  each member until its last backward use. Every cheap layer runs forward once more: the least extra compute.
- **memory-centric**: each member is rebuilt right before each run of consecutive backward steps that read it,
  and freed right after; its ancestors are rebuilt transiently each time (a chain of k layers costs up to
  k(k+1)/2 forward passes). The least memory: at any step only what that step reads is resident.

The policy plans every dropped segment memory-centric first; the highest point of that timeline is the plan's
**bottleneck**, which no choice of segment modes can go below. Then, segment by segment in backward order, it
switches a segment to speed-centric if the timeline stays at or under the bottleneck (or under a caller's
`limit`, e.g. a budget). Most segments of real networks are short chains whose two modes coincide.

The timeline used for that decision (`Timeline`) sums rounded block sizes per *slot*: six slots per route step
(before-step frees, before-step sequence, the step's compute, after-step frees, after-step sequence,
after-step allocations); a sequence slot holds the highest point reached inside the sequence. Placement then
turns the final schedule into offsets with the real allocator, and the peak it reports is exact.

Recomputation never changes results (tested bit for bit against policy `none`): the executor re-runs the
layer's forward with `ctx.recompute=True`, BN normalizes with the batch statistics it saved in forward and does
not update its running statistics again, and dropout regenerates the same mask from the same key.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...core.errors import BudgetError
from ...core.tensors import Role, act_id
from ...graph.route import Phase, Route
from ..liveness import analyze
from ..plan import EventKind, Plan
from ..planner import Residency, Schedule, WorkspaceChoice, liveness_schedule, make_plan
from ..pool import align_up
from ..workspace import workspace_choices

SPEED, MEMORY = "speed", "memory"


@dataclass(slots=True)
class Segment:
    """The droppable members hanging off one kept tensor (`root`), and how backward rebuilds them."""

    root: str
    members: list[str]                       # act ids, in route order
    parent: dict[str, str]                   # member -> the tensor its layer reads
    first: dict[str, int]                    # member -> its forward step
    fwd_last: dict[str, int]
    bwd_uses: dict[str, list[int]]
    root_bwd: bool                           # backward reads the root anyway
    saved_bytes: int = 0                     # bytes not held across the forward->backward turn
    dropped: bool = False
    mode: str = MEMORY
    root_reads: list[int] = field(default_factory=list)

    @property
    def needed(self) -> list[str]:
        return [m for m in self.members if self.bwd_uses[m]]

    @property
    def first_bwd(self) -> int:
        return min(u[0] for u in self.bwd_uses.values() if u)


def find_segments(route: Route, iv: dict | None = None) -> list[Segment]:
    """Every kept tensor with droppable descendants, with the cost-aware decision whether to drop them."""
    net = route.network
    iv = analyze(route) if iv is None else iv
    n_fwd = sum(1 for s in route.steps if s.phase is Phase.FORWARD)
    fwd_step = {s.node: s for s in route.steps if s.phase is Phase.FORWARD}

    def droppable(node) -> bool:
        layer = node.layer
        if layer is None or layer.checkpoint or len(node.inputs) != 1 or layer.is_loss:
            return False
        tid = act_id(node.name)
        spec = route.tensors.get(tid)
        if spec is None or spec.role is not Role.ACTIVATION or tid not in iv:
            return False
        step = fwd_step.get(node.index)
        if step is None or step.workspace is not None or step.staging is not None:
            return False  # a recomputed layer runs without workspace, and without staging (a half mode's, CPU)
        in_shapes = [net.nodes[i].shape for i in node.inputs]
        aux = layer.aux_specs(in_shapes, training=True)
        return all(f"aux:{node.name}.{a}" in route.tensors for a in aux)

    parent: dict[str, str] = {}
    root_of: dict[str, str] = {}
    order: list[str] = []
    for node in net.nodes:
        if not droppable(node):
            continue
        tid = act_id(node.name)
        src = act_id(net.nodes[node.inputs[0]].name)
        if src not in iv:
            continue
        parent[tid] = src
        root_of[tid] = root_of.get(src, src)
        order.append(tid)

    segs: dict[str, Segment] = {}
    for tid in order:
        root = root_of[tid]
        seg = segs.get(root)
        if seg is None:
            seg = segs[root] = Segment(root, [], {}, {}, {}, {}, root_bwd=iv[root].last >= n_fwd)
        uses = iv[tid].uses
        seg.members.append(tid)
        seg.parent[tid] = parent[tid]
        seg.first[tid] = iv[tid].first
        fwd = [u for u in uses if u < n_fwd]
        seg.fwd_last[tid] = fwd[-1] if fwd else iv[tid].first
        seg.bwd_uses[tid] = [u for u in uses if u >= n_fwd]
    for seg in segs.values():
        held = sum(align_up(route.tensors[m].nbytes) for m in seg.needed)
        extra_root = 0 if seg.root_bwd else align_up(route.tensors[seg.root].nbytes)
        seg.saved_bytes = held - extra_root
        seg.dropped = bool(seg.needed) and seg.saved_bytes > 0
    return sorted(segs.values(), key=lambda s: (iv[s.root].first, s.root))


# -- one segment's residencies
@dataclass(slots=True)
class SegmentPlan:
    """A dropped segment's residencies under one mode."""

    residencies: dict[str, list[Residency]] = field(default_factory=dict)
    root_end: tuple[int, str, int] | None = None   # (step, at, seq) of the root's last recompute read
    root_reads: list[int] = field(default_factory=list)
    recomputes: int = 0


def _groups(seg: Segment, mode: str) -> dict[str, list[tuple[int, int]]]:
    """Per needed member, the backward intervals [a, b] during which it must be resident."""
    out: dict[str, list[tuple[int, int]]] = {}
    if mode == SPEED:
        j0 = seg.first_bwd
        for m in seg.needed:
            out[m] = [(j0, seg.bwd_uses[m][-1])]
        return out
    for m in seg.needed:
        runs: list[tuple[int, int]] = []
        for u in seg.bwd_uses[m]:
            if runs and u == runs[-1][1] + 1:
                runs[-1] = (runs[-1][0], u)
            else:
                runs.append((u, u))
        out[m] = runs
    return out


def plan_segment(seg: Segment, mode: str, seq_base: dict[int, int] | None = None) -> SegmentPlan:
    """Residencies of a dropped segment under `mode`; `seq_base` numbers sequences per boundary across segments,
    so two chains rebuilt before one step never interleave."""
    seq_base = {} if seq_base is None else seq_base
    out = SegmentPlan()
    pos = {m: i for i, m in enumerate(seg.members)}
    for m in seg.needed:
        out.residencies[m] = [Residency(
            seg.first[m], "before", EventKind.ALLOC, seg.fwd_last[m], "after", EventKind.FREE,
            f"dropped after its last forward use; rebuilt in backward from checkpoint '{seg.root}' ({mode}-centric)")]
    for m in seg.members:  # members backward never reads: plain liveness (they die in forward)
        if not seg.bwd_uses[m]:
            out.residencies[m] = [Residency(seg.first[m], "before", EventKind.ALLOC, seg.fwd_last[m], "after",
                                            EventKind.FREE)]
    groups = _groups(seg, mode)
    by_start: dict[int, list[tuple[str, int]]] = {}
    for m, gs in groups.items():
        for a, b in gs:
            by_start.setdefault(a, []).append((m, b))

    def resident_at(m: str, a: int) -> bool:
        return any(s < a <= e for s, e in groups.get(m, ()))

    why_target = ("speed-centric: the segment of '{root}' is rebuilt once, kept for its backward"
                  if mode == SPEED else "memory-centric: rebuilt for the steps that read it, freed after")
    for a in sorted(by_start):
        targets = dict(by_start[a])
        needed = set(targets)
        for t in targets:
            p = seg.parent[t]
            while p != seg.root and p not in needed and not resident_at(p, a):
                needed.add(p)
                p = seg.parent[p]
        chain = sorted(needed, key=pos.__getitem__)
        base = seq_base.get(a, 0)
        seq = {m: base + 2 * i + 2 for i, m in enumerate(chain)}
        seq_base[a] = base + 2 * len(chain) + 2
        last_reader: dict[str, int] = {}
        for m in chain:
            last_reader[seg.parent[m]] = seq[m] + 1
        for m in chain:
            out.recomputes += 1
            if m in targets:
                res = Residency(a, "before", EventKind.RECOMPUTE, targets[m], "after", EventKind.FREE,
                                why_target.format(root=seg.root), start_seq=seq[m])
            else:
                res = Residency(a, "before", EventKind.RECOMPUTE, a, "before", EventKind.FREE,
                                f"rebuilt only as the input of {', '.join(c for c in chain if seg.parent[c] == m)}"
                                f" (freed at once)", start_seq=seq[m], end_seq=last_reader[m])
            out.residencies[m].append(res)
        if seg.root in last_reader:
            out.root_reads.append(a)
            end = (a, "before", last_reader[seg.root])
            if out.root_end is None or end > out.root_end:
                out.root_end = end
    return out


def _root_residency(root_iv, root_end: tuple[int, str, int] | None) -> Residency:
    """The root's liveness residency, extended to its last recomputation read if that comes later."""
    first, last = root_iv.first, root_iv.last
    if root_end is None or root_end[0] <= last:
        return Residency(first, "before", EventKind.ALLOC, last, "after", EventKind.FREE)
    return Residency(first, "before", EventKind.ALLOC, root_end[0], "before", EventKind.FREE,
                     "checkpoint kept until its dropped segment is rebuilt for backward", end_seq=root_end[2])


# -- the timeline the speed/memory decision reads
SLOTS = 6  # per step: before-ends, before-sequence, compute, after-ends, after-sequence, after-starts


def _start_slot(step: int, at: str, seq: int) -> int:
    return step * SLOTS + ((1 if seq else 2) if at == "before" else (4 if seq else 5))


def _end_slot(step: int, at: str, seq: int) -> int:
    """First slot at which the tensor is gone (a sequenced end still counts inside its sequence slot)."""
    return step * SLOTS + ((2 if seq else 0) if at == "before" else (5 if seq else 3))


class Timeline:
    """Bytes resident per slot (upper bound inside sequence slots), for cheap what-if questions."""

    def __init__(self, n_steps: int):
        self.diff = np.zeros(n_steps * SLOTS + 1, np.int64)
        self.values: np.ndarray | None = None

    def add(self, r: Residency, nbytes: int) -> None:
        self.diff[_start_slot(r.start, r.start_at, r.start_seq)] += nbytes
        self.diff[_end_slot(r.end, r.end_at, r.end_seq)] -= nbytes

    def freeze(self) -> np.ndarray:
        self.values = np.cumsum(self.diff)[:-1]
        return self.values


def _window(seg: Segment, plans: list[tuple["SegmentPlan", Residency]]) -> tuple[int, int]:
    """Slots [lo, hi) where the segment's modes can differ, over the given plans."""
    lo = _start_slot(seg.first_bwd, "before", 1)
    hi = max(_end_slot(r.end, r.end_at, r.end_seq) for sp, rr in plans
             for r in [rr] + [r for lst in sp.residencies.values() for r in lst])
    return lo, max(hi, lo + 1)


def segment_profile(sp: SegmentPlan, root: str, root_res: Residency, sizes: dict[str, int], lo: int,
                    hi: int) -> np.ndarray:
    """Bytes the segment (root included) holds per slot in [lo, hi); a sequence slot gets its highest point."""
    prof = np.zeros(hi - lo, np.int64)
    seq_events: dict[int, list[tuple[int, int, int]]] = {}
    for tid, lst in list(sp.residencies.items()) + [(root, [root_res])]:
        nb = sizes[tid]
        for r in lst:
            s = _start_slot(r.start, r.start_at, r.start_seq)
            e = _end_slot(r.end, r.end_at, r.end_seq)
            if e <= lo or s >= hi:
                continue
            a, b = max(s, lo), min(e, hi)
            if r.start_seq:                      # appears inside the sequence slot s
                seq_events.setdefault(s, []).append((r.start_seq, 0, nb))
                a = s + 1
            if r.end_seq and e - 1 < hi:         # disappears inside the sequence slot e - 1
                seq_events.setdefault(e - 1, []).append((r.end_seq, 1, -nb))
                b = e - 1
            if a < b:
                prof[a - lo:b - lo] += nb
    for slot, evs in seq_events.items():
        run = best = int(prof[slot - lo])        # held through the whole slot
        for _, _, d in sorted(evs):
            run += d
            best = max(best, run)
        prof[slot - lo] = best
    return prof


@dataclass(slots=True)
class RecomputeSchedule:


    schedule: Schedule
    segments: list[Segment]
    bottleneck: int                 # top of the all-memory-centric timeline
    limit: int
    timeline_peak: int
    recomputes: int                 # RECOMPUTE events per training step


def recompute_schedule(route: Route, ws: dict[int, WorkspaceChoice], limit: int | None = None,
                       mode: str | None = None, iv: dict | None = None) -> RecomputeSchedule:
    """Policy `recompute`'s schedule; `mode` forces one mode, else speed-centric under `limit` (the bottleneck)."""
    iv = analyze(route) if iv is None else iv
    sched = liveness_schedule(route, ws)
    segs = [s for s in find_segments(route, iv) if s.dropped]
    sizes = {tid: align_up(t.nbytes) for tid, t in route.tensors.items()}
    for k, c in ws.items():
        sizes[route.steps[k].workspace] = align_up(c.nbytes)

    def build(seg: Segment, m: str, seq_base=None) -> tuple[SegmentPlan, Residency]:
        sp = plan_segment(seg, m, seq_base)
        return sp, _root_residency(iv[seg.root], sp.root_end)

    # The timeline: all but the dropped segments' backward windows (the same in both modes)...
    seg_tids = {s.root for s in segs} | {m for s in segs for m in s.members}
    tl = Timeline(len(route.steps))
    for tid, lst in sched.residencies.items():
        if tid not in seg_tids:
            for r in lst:
                tl.add(r, sizes[tid])
    start = mode or MEMORY
    plans = []
    for seg in segs:
        seg.mode = start
        sp, rr = build(seg, start)
        lo, hi = _window(seg, [(sp, rr)])
        for tid, r in [(seg.root, rr)] + [(t, r) for t, lst in sp.residencies.items() for r in lst]:
            s0 = _start_slot(r.start, r.start_at, r.start_seq)
            if s0 < lo:
                tl.diff[s0] += sizes[tid]
                tl.diff[min(_end_slot(r.end, r.end_at, r.end_seq), lo)] -= sizes[tid]
        plans.append((sp, rr, lo, hi))
    values = tl.freeze() + sum(sizes[t.id] for t in route.tensors.values() if t.role.persistent)
    # ...plus each segment's backward window in its starting mode.
    profiles: list[tuple[int, int, np.ndarray]] = []
    for seg, (sp, rr, lo, hi) in zip(segs, plans):
        prof = segment_profile(sp, seg.root, rr, sizes, lo, hi)
        values[lo:hi] += prof
        profiles.append((lo, hi, prof))
    bottleneck = int(values.max()) if len(values) else 0
    cap = bottleneck if limit is None else int(limit)

    if mode is None:
        # greedy, in the order backward meets the segments
        for i in sorted(range(len(segs)), key=lambda i: -segs[i].first_bwd):
            seg = segs[i]
            sp, rr = build(seg, SPEED)
            lo, hi, prof_m = profiles[i]
            lo2, hi2 = _window(seg, [(sp, rr)])
            lo2, hi2 = min(lo, lo2), max(hi, hi2)
            prof_s = segment_profile(sp, seg.root, rr, sizes, lo2, hi2)
            trial = values[lo2:hi2].copy()
            trial[lo - lo2:hi - lo2] -= prof_m
            trial += prof_s
            if trial.max() <= cap:
                values[lo2:hi2] = trial
                seg.mode = SPEED
                profiles[i] = (lo2, hi2, prof_s)

    # assemble, numbering sequences per boundary so chains never interleave
    seq_base: dict[int, int] = {}
    total = 0
    for seg in segs:
        sp, rr = build(seg, seg.mode, seq_base)
        seg.root_reads = sp.root_reads
        total += sp.recomputes
        sched.residencies.update(sp.residencies)
        sched.residencies[seg.root] = [rr]
    return RecomputeSchedule(sched, segs, bottleneck, cap, int(values.max()) if len(values) else 0, total)


def recompute_plan(route: Route, budget: int | None = None, ws: dict[int, WorkspaceChoice] | None = None,
                   limit: int | None = None, mode: str | None = None, policy: str = "recompute") -> Plan:
    """Plan `route` with cost-aware recomputation."""
    ws = workspace_choices(route) if ws is None else ws
    rs = recompute_schedule(route, ws, limit=limit, mode=mode)
    return make_plan(route, policy, budget, workspace=ws, schedule=rs.schedule)


def recompute_policy(route: Route, budget: int | None, device: str, costs=None) -> Plan:
    """Also planned without the rebuildable aux tensors (attention's scores), if any: the lower peak wins (the
    scores kept on a tie); under a budget, the one that fits."""
    plan, err = _attempt(route, budget, costs)
    rebuildable = route.rebuildable_aux()
    if not rebuildable:
        if err is not None:
            raise err
        return plan
    alt, alt_err = _attempt(route.without_aux(rebuildable), budget, costs)
    if plan is None and alt is None:
        raise alt_err
    if plan is None or (alt is not None and alt.peak_bytes < plan.peak_bytes):
        return alt
    return plan


def _attempt(route: Route, budget: int | None, costs) -> tuple[Plan | None, BudgetError | None]:
    try:
        return recompute_plan(route, budget, workspace_choices(route, costs)), None
    except BudgetError as e:
        return None, e


def recompute_flops(plan: Plan) -> int:
    """Forward FLOPs the plan's RECOMPUTE events cost per training step."""
    net = plan.route.network
    total = 0
    for sp in plan.steps:
        for ev in sp.before + sp.after:
            if ev.kind is EventKind.RECOMPUTE:
                node = net.node(plan.route.tensors[ev.tensor].owner)
                total += node.layer.flops([net.nodes[i].shape for i in node.inputs], node.shape)
    return total


def compute_peak_lower_bound(route: Route, sched: Schedule, ws: dict[int, WorkspaceChoice]) -> int:
    """Bytes in use while the busiest step computes, smallest workspaces: a lower bound of any placement's arena."""
    sizes = {tid: align_up(t.nbytes) for tid, t in route.tensors.items()}
    for k, c in ws.items():
        small = min([c.nbytes] + [o.workspace_bytes for o in c.options or ()])
        sizes[route.steps[k].workspace] = align_up(small)
    tl = Timeline(len(route.steps))
    for tid, lst in sched.residencies.items():
        for r in lst:
            tl.add(r, sizes[tid])
    values = tl.freeze()
    persistent = sum(sizes[t.id] for t in route.tensors.values()
                     if t.role.persistent and t.id not in sched.residencies)  # else: homed on the host
    return int(values[2::SLOTS].max()) + persistent if len(values) else persistent
