"""The simulator: the planner on shape-only tensors, plus a roofline cost model of a device.

It answers "what would this network need, and how fast would it run, on a GPU we do not have?". Peak memory
needs no model at all: the plan is computed by the same planner the executor replays, so the simulated peak
*is* the executor's pool peak (tests hold this byte for byte). Step time is an estimate: each route step takes
max(FLOPs / (peak FLOP/s x efficiency), bytes touched / memory bandwidth), and host transfers run on the link
at its bandwidth, overlapped with compute where the plan allows (`link_timeline`): only the time a RELEASE or
WAIT event must block for its copy adds to the step. A half-precision plan's layers compute at the device's half
rate (`DeviceProfile.half_flops`: tensor cores) and move the bytes of their half tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..graph.network import Network
from ..graph.route import Phase, Route
from .plan import Plan
from .profiles import PROFILES, DeviceProfile, get_profile
from .replay import replay_peak

__all__ = ["PROFILES", "DeviceProfile", "SimResult", "StepCost", "get_profile", "link_timeline", "simulate",
           "step_costs"]


@dataclass(slots=True)
class StepCost:
    flops: int
    bytes: int
    time_s: float


@dataclass(slots=True)
class SimResult:
    plan: Plan
    device: DeviceProfile
    step_costs: list[StepCost] = field(default_factory=list)
    compute_time_s: float = 0.0
    transfer_time_s: float = 0.0
    est_step_time_s: float = 0.0
    exposed_transfer_s: float = 0.0   # in est_step_time_s
    recompute_flops: int = 0          # in compute_time_s
    step_flops: int = 0               # recomputation included
    _peak: int | None = None

    @property
    def recompute_flops_share(self) -> float:
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    @property
    def transfer_hidden_fraction(self) -> float:
        """Share of link time overlapped with compute (1.0 when nothing moves: nothing is exposed)."""
        if self.transfer_time_s <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.exposed_transfer_s / self.transfer_time_s))

    @property
    def peak_bytes(self) -> int:
        """Replayed on a shape-only pool (memory.replay), not read from the plan: tests compare the two."""
        if self._peak is None:
            self._peak = replay_peak(self.plan)
        return self._peak

    @property
    def fits_device(self) -> bool:
        return self.plan.min_budget_bytes <= self.device.usable_bytes


def step_costs(route: Route, device: DeviceProfile) -> list[StepCost]:
    """Roofline estimate of each step on `device`: fresh records each call (callers add to them), memoized math."""
    key = ("step_costs", device)
    if key not in route.memo:
        route.memo[key] = [(c.flops, c.bytes, c.time_s) for c in _step_costs(route, device)]
    return [StepCost(f, b, t) for f, b, t in route.memo[key]]


def _step_costs(route: Route, device: DeviceProfile) -> list[StepCost]:
    net: Network = route.network
    out: list[StepCost] = []
    layer_flops = device.flops_half if route.precision.half is not None else device.flops   # half operands
    for step in route.steps:
        touched = set(step.reads) | set(step.writes)
        nbytes = sum(route.tensors[t].nbytes for t in touched)
        if step.phase is Phase.UPDATE:
            flops = 4 * sum(route.tensors[t].nbytes // route.tensors[t].dtype.itemsize for t in step.writes)
        else:
            node = net.nodes[step.node]
            in_shapes, out_shape = route.shapes_of(node.index)  # a micro-batch's, on a packed route
            fwd = node.layer.flops(in_shapes, out_shape)
            flops = fwd if step.phase is Phase.FORWARD else node.layer.backward_flops(in_shapes, out_shape)
        rate = device.flops if step.phase is Phase.UPDATE else layer_flops   # updates: float32 masters
        t = max(flops / (rate * device.efficiency), nbytes / device.mem_bw)
        out.append(StepCost(int(flops), int(nbytes), t))
    return out


def simulate(plan: Plan, device: DeviceProfile | str = "k40c") -> SimResult:
    """Estimate the step time of `plan` on `device`, once per plan and device (`Plan.memo`)."""
    dev = get_profile(device) if isinstance(device, str) else device
    key = ("simulate", dev)
    if key not in plan.memo:
        plan.memo[key] = _simulate(plan, dev)
    return plan.memo[key]


def _simulate(plan: Plan, dev: DeviceProfile) -> SimResult:
    costs = step_costs(plan.route, dev)
    rflops = add_plan_costs(plan, costs)
    compute = math.fsum(c.time_s for c in costs)
    link = link_timeline(plan, dev, costs)
    return SimResult(plan, dev, costs, compute, link.transfer_s, compute + link.exposed_s, link.exposed_s, rflops,
                     sum(c.flops for c in costs))


def add_plan_costs(plan: Plan, costs: list[StepCost]) -> int:
    """Add a RECOMPUTE's forward cost, and scale slower workspace algorithms by `est_cost`; the recomputed FLOPs."""
    from .plan import EventKind

    route = plan.route
    fwd = {s.node: s.index for s in route.steps if s.phase is Phase.FORWARD}
    extra = 0
    for k, (step, sp) in enumerate(zip(route.steps, plan.steps)):
        if sp.algo is not None and step.workspace is not None:
            cost = {o.algo: o.est_cost for o in step.workspace_options}
            best = min(cost.values()) if cost else 0.0
            if best > 0 and sp.algo in cost:
                costs[k].time_s *= cost[sp.algo] / best
        for ev in sp.before + sp.after:
            if ev.kind is EventKind.RECOMPUTE:
                src = costs[fwd[route.network.node(route.tensors[ev.tensor].owner).index]]
                costs[k].time_s += src.time_s
                costs[k].flops += src.flops
                costs[k].bytes += src.bytes
                extra += src.flops
    return extra


@dataclass(slots=True)
class LinkTimeline:
    transfer_s: float   # total copy time on the link
    exposed_s: float    # time the compute stream spent blocked on a copy


@dataclass(slots=True)
class PredictedTimeline:
    """When each step computes and each copy is on the link (seconds from the step's start); `write_trace` draws it."""

    steps: list[tuple[float, float]] = field(default_factory=list)             # (start, end) per route step
    copies: list[tuple[str, str, float, float, int]] = field(default_factory=list)  # (kind, tensor, start, end, bytes)
    boundaries: list[tuple[float, float]] = field(default_factory=list)        # (before-events at, after-events at)


def predicted_timeline(plan: Plan, device: DeviceProfile | str = "k40c") -> PredictedTimeline:
    """Step and copy times exactly as `simulate` estimates them (same costs, same link model)."""
    dev = get_profile(device) if isinstance(device, str) else device
    costs = step_costs(plan.route, dev)
    add_plan_costs(plan, costs)
    out = PredictedTimeline()
    link_timeline(plan, dev, costs, record=out)
    return out


def link_timeline(plan: Plan, dev: DeviceProfile, costs: list[StepCost] | None = None,
                  record: PredictedTimeline | None = None) -> LinkTimeline:
    """Replay the plan on the compute clock and the link (a FIFO stream, one per direction if `dev.duplex`):
    OFFLOAD / PREFETCH queue a copy; RELEASE / WAIT block compute until it ends (the exposed time)."""
    from .plan import EventKind

    costs = step_costs(plan.route, dev) if costs is None else costs
    now = total = exposed = 0.0
    free = {EventKind.OFFLOAD: 0.0, EventKind.PREFETCH: 0.0}   # when each direction's stream is free
    done: dict[str, float] = {}

    def apply(ev) -> None:
        nonlocal now, total, exposed
        if ev.kind in (EventKind.OFFLOAD, EventKind.PREFETCH):
            d = dev.link_latency_s + ev.nbytes / dev.link_bw
            lane = ev.kind if dev.duplex else EventKind.OFFLOAD
            start = max(now, free[lane])
            link_free = free[lane] = start + d
            done[ev.tensor] = link_free
            total += d
            if record is not None:
                record.copies.append((ev.kind.value, ev.tensor, start, link_free, ev.nbytes))
        elif ev.kind in (EventKind.RELEASE, EventKind.WAIT):
            t = done.pop(ev.tensor, None)
            if t is not None and t > now:
                exposed += t - now
                now = t

    for sp, c in zip(plan.steps, costs):
        before_at = now
        for ev in sp.before:
            apply(ev)
        if record is not None:
            record.steps.append((now, now + c.time_s))
            record.boundaries.append((before_at, now + c.time_s))
        now += c.time_s
        for ev in sp.after:
            apply(ev)
    return LinkTimeline(total, exposed)
