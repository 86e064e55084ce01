"""Harmony across devices, in the simulator: layer packs spread over N devices in a pipeline (`plan --devices N`).

No multi-device executor exists: this is the simulator's view, against N data-parallel replicas (`plan_replicas`:
each the network at batch B / N planned by `auto`, plus a ring all-reduce of 2 (N - 1) / N x the gradient bytes,
un-overlapped: an upper bound).

Rules (Harmony, Li et al., VLDB 2022):
- `P = N x k` packs of consecutive layers (`CUTS`); pack i runs on device i mod N, so a pack's output goes device
  to device, never through the host. Each device runs its packs' steps of the packed route in order: its sub-route.
- A sub-route is planned by the same placement as any route (its peak exact), under the per-device budget, with the
  fewest of its layers' weights homed on the host; a tensor from another device is allocated at its first use.
- Bytes per step: host<->device is what each device plan copies; device<->device is once per (tensor, receiving
  device); inputs and labels are counted in neither.
- Step time: each device's solo timeline (`predicted_timeline`), a step waiting for tensors it receives (FIFO on
  the sender's link at `peer_bw`).
Limitations: independent device links; host stalls from solo timelines; packs never cut inside a layer; k and M
powers of two.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ...core.errors import BudgetError, OptionError
from ...graph.packs import Packing, even_packs
from ...graph.route import PlanOptions, Route
from ..decisions.weights import layer_candidates, moved_by_role, plan_weights
from ..plan import Plan
from ..pool import format_bytes
from ..simulate import DeviceProfile, get_profile, predicted_timeline, simulate
from ..workspace import workspace_choices

if TYPE_CHECKING:  # pragma: no cover
    from ...graph.network import Network


@dataclass(slots=True)
class DevicePlan:
    """One device: its packs (indices into the packing), its sub-route's plan and what it moves."""

    device: int
    packs: list[int]
    plan: Plan
    homed_layers: int                # layers whose weights live on the host
    candidate_layers: int
    host_bytes: int                  # host<->device bytes per step, both directions
    host_by_role: dict[str, int] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return self.plan.peak_bytes

    @property
    def weights_homed(self) -> bool:
        return self.homed_layers > 0


@dataclass(slots=True)
class PipelineResult:
    """A pipeline plan: M micro-batches, `packs` (layer names), pack i on device i mod N."""

    devices: int
    micro_batches: int
    packs: list[list[str]]
    device_plans: list[DevicePlan]
    p2p_bytes: int                   # device<->device bytes per step
    step_time_s: float
    profile: DeviceProfile
    budget: int
    cut: str = "weights"             # a key of `CUTS`

    @property
    def host_bytes(self) -> int:
        return sum(d.host_bytes for d in self.device_plans)

    @property
    def peak_bytes(self) -> int:
        return max(d.peak_bytes for d in self.device_plans)


@dataclass(slots=True)
class ReplicasResult:
    """N data-parallel replicas at batch B / N, each planned by `auto`; bytes are all replicas'."""

    devices: int
    plan: Plan
    host_bytes: int
    allreduce_bytes: int             # ring all-reduce of the gradients
    step_time_s: float               # a replica's step plus the all-reduce, un-overlapped
    replica_step_time_s: float

    @property
    def peak_bytes(self) -> int:
        return self.plan.peak_bytes


def pack_devices(n_packs: int, devices: int) -> list[int]:
    """Round robin: consecutive packs on different devices (when N > 1)."""
    return [i % devices for i in range(n_packs)]


def sub_routes(route: Route, devices: int) -> tuple[list[Route], list[int]]:
    """One sub-route per device (steps in order, renumbered from 0), and each step's device."""
    packing: Packing = route.packing
    if packing is None or packing.schedule != "packs":
        raise ValueError("sub_routes needs a route of layer packs (packs.build_packed with packs)")
    dev_of_pack = pack_devices(len(packing.packs), devices)
    pack_of_layer = {name: k for k, p in enumerate(packing.packs) for name in p}
    step_dev = [dev_of_pack[pack_of_layer[s.name]] for s in route.steps]
    parts: list[Route] = []
    for d in range(devices):
        ks = [k for k, dd in enumerate(step_dev) if dd == d]
        new = {k: i for i, k in enumerate(ks)}
        steps = [replace(route.steps[k], index=new[k]) for k in ks]
        used: set[str] = set()
        for s in steps:
            used.update(s.reads)
            used.update(s.writes)
            used.update(a.into for a in s.accumulate)
            if s.workspace:
                used.add(s.workspace)
        tensors = {tid: t for tid, t in route.tensors.items() if tid in used}
        mine = [k for k, dd in enumerate(dev_of_pack) if dd == d]
        # pack blocks: forward blocks in pack order, then backward blocks in reverse pack order
        n = len(packing.packs)
        blocks = [packing.blocks[k] for k in mine] + [packing.blocks[n + (n - 1 - k)] for k in reversed(mine)]
        sub = Route(route.network, route.training, steps, tensors, route.optimizer_slots, route.requires_grad,
                    route.menu, route.fused_update, math=route.math,
                    copies={m: c for m, c in route.copies.items() if c in tensors})
        sub.packing = Packing(packing.micro_batches, packing.micro_batch, [packing.packs[k] for k in mine],
                              [(new[lo], new[hi]) for lo, hi in blocks], packing.shapes)
        parts.append(sub)
    return parts, step_dev


def _writers(route: Route, step_dev: list[int]) -> dict[str, tuple[int, int]]:
    """tensor -> (first step that writes it, its device)."""
    out: dict[str, tuple[int, int]] = {}
    for s in route.steps:
        for tid in list(s.writes) + [a.into for a in s.accumulate]:
            out.setdefault(tid, (s.index, step_dev[s.index]))
    return out


def transfers(route: Route, step_dev: list[int]) -> list[tuple[int, int, int, str, int]]:
    """(writer step, reader step, receiving device, tensor, bytes) per (tensor, device); weights never move."""
    writers = _writers(route, step_dev)
    seen: set[tuple[str, int]] = set()
    out = []
    for s in route.steps:
        d = step_dev[s.index]
        for tid in list(s.reads) + [a.into for a in s.accumulate]:
            w = writers.get(tid)
            spec = route.tensors[tid]
            if w is None or w[1] == d or spec.role.persistent or (tid, d) in seen:
                continue
            seen.add((tid, d))
            out.append((w[0], s.index, d, tid, spec.nbytes))
    out.sort()
    return out


def _plan_device(sub: Route, budget: int, device: str, costs, d: int,
                 weights: str = "fit") -> tuple[Plan, int, int]:
    """(plan, homed, candidates): the fewest layers homed for the device to fit; "host" homes all (Harmony's)."""
    ws = workspace_choices(sub, costs)
    cands = layer_candidates(sub)

    def attempt(n: int) -> Plan | None:
        try:
            return plan_weights(sub, budget, device, workspace=ws, layers=cands[:n], policy="pipeline")
        except BudgetError:
            return None

    plan = attempt(0) if weights == "fit" else None
    if plan is not None:
        return plan, 0, len(cands)
    try:
        best = plan_weights(sub, budget, device, workspace=ws, layers=cands, policy="pipeline")
    except BudgetError as e:
        raise BudgetError(f"device {d} of the pipeline: {e}", e.min_budget_bytes, e.binding) from None
    if weights == "host":
        return best, len(cands), len(cands)
    lo, hi = 0, len(cands)          # homing lo layers does not fit; homing hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = attempt(mid)
        if p is None:
            lo = mid
        else:
            hi, best = mid, p
    return best, hi, len(cands)


def pipeline_time(route: Route, step_dev: list[int], plans: list[Plan], profile: DeviceProfile) -> float:
    """Each device's solo timeline, stretched where a step waits for a tensor from another device."""
    devices = len(plans)
    dur: list[list[float]] = []
    for p in plans:
        tl = predicted_timeline(p, profile)
        prev, ds = 0.0, []
        for _, end in tl.steps:
            ds.append(end - prev)   # the step's compute plus the copy stalls before it
            prev = end
        dur.append(ds)
    local = [0] * devices
    pos = [0] * len(route.steps)
    for k, d in enumerate(step_dev):
        pos[k] = local[d]
        local[d] += 1
    incoming: dict[int, list[tuple[int, int]]] = {}
    for w, r, _, _, nbytes in transfers(route, step_dev):
        incoming.setdefault(r, []).append((w, nbytes))
    end = [0.0] * len(route.steps)
    clock = [0.0] * devices
    link = [0.0] * devices   # each device's outgoing peer link: FIFO
    arrive: dict[tuple[int, int], float] = {}
    for k, d in enumerate(step_dev):
        ready = clock[d]
        for w, nbytes in incoming.get(k, ()):
            key = (w, k)
            if key not in arrive:
                src = step_dev[w]
                start = max(end[w], link[src])
                link[src] = start + nbytes / profile.peer_bw
                arrive[key] = link[src]
            ready = max(ready, arrive[key])
        end[k] = ready + dur[d][pos[k]]
        clock[d] = end[k]
    # after-events of a device's last step (a final copy back) are inside its solo timeline's last duration
    return max(clock) if clock else 0.0


def plan_pipeline_fixed(net: "Network", devices: int, micro_batches: int, n_packs: int, budget: int,
                        device: str = "k40c", optimizer_slots=(), costs=None, cut: str = "weights",
                        weights: str = "fit", math: str = "fp32") -> PipelineResult:
    """The pipeline plan with M = `micro_batches` and `n_packs` packs cut by `cut` (a key of `CUTS`); `weights`:
    "fit" keeps a device's weights resident where they fit, "host" homes every layer's weights on the host;
    `math` the math mode whose dtypes the tensors have (`backend.precision`)."""
    if weights not in ("fit", "host"):
        raise OptionError(f"weights must be 'fit' or 'host', got {weights!r}")
    profile = get_profile(device)
    packs = CUTS[cut](net, n_packs)
    route = net.route(optimizer_slots=optimizer_slots, micro_batches=micro_batches, packs=packs, math=math)
    parts, step_dev = sub_routes(route, devices)
    dplans: list[DevicePlan] = []
    dev_of_pack = pack_devices(len(packs), devices)
    for d, sub in enumerate(parts):
        plan, homed, cands = _plan_device(sub, budget, device, costs, d, weights)
        moved = moved_by_role(plan)
        dplans.append(DevicePlan(d, [k for k, dd in enumerate(dev_of_pack) if dd == d], plan, homed, cands,
                                 sum(moved.values()), moved))
    p2p = sum(t[4] for t in transfers(route, step_dev))
    t = pipeline_time(route, step_dev, [dp.plan for dp in dplans], profile)
    return PipelineResult(devices, micro_batches, [list(p) for p in packs], dplans, p2p, t, profile, budget, cut)


def min_max_cut(costs: list[float], n_packs: int) -> list[int]:
    """First indices of at most `n_packs` runs minimizing the largest run's cost (bisection, greedy fill)."""
    lo, hi = max(costs, default=0.0), sum(costs)
    for _ in range(60):
        mid = (lo + hi) / 2
        runs, acc = 1, 0.0
        for c in costs:
            if acc + c > mid and acc > 0:
                runs, acc = runs + 1, 0.0
            acc += c
        lo, hi = (mid, hi) if runs > n_packs else (lo, mid)
    starts, acc = [0], 0.0
    for i, c in enumerate(costs):
        if acc + c > hi and acc > 0:
            starts.append(i)
            acc = 0.0
        acc += c
    return starts


def _layer_costs(net: "Network") -> tuple[list[float], list[float]]:
    """Per layer: its share of forward + backward FLOPs and of trainable weight bytes."""
    route = net.route()
    flops, wbytes = [], []
    for n in net.layer_nodes:
        ins, out = route.shapes_of(n.index)
        flops.append(float(n.layer.flops(ins, out) + n.layer.backward_flops(ins, out)))
        wbytes.append(float(sum(math.prod(p.shape) for p in n.params.values() if p.trainable)))
    return [f / (sum(flops) or 1.0) for f in flops], [w / (sum(wbytes) or 1.0) for w in wbytes]


def _packs_from(net: "Network", costs: list[float], n_packs: int) -> list[list[str]]:
    names = [n.name for n in net.layer_nodes]
    starts = min_max_cut(costs, max(1, min(n_packs, len(names)))) + [len(names)]
    return [names[a:b] for a, b in zip(starts, starts[1:])]


def compute_packs(net: "Network", n_packs: int) -> list[list[str]]:
    """Packs minimizing the largest pack's FLOPs: balanced stages when weights stay resident."""
    return _packs_from(net, _layer_costs(net)[0], n_packs)


def mixed_packs(net: "Network", n_packs: int) -> list[list[str]]:
    """Packs balanced on FLOPs share plus weight-bytes share (a VGG computes early and holds weights late)."""
    f, w = _layer_costs(net)
    return _packs_from(net, [a + b for a, b in zip(f, w)], n_packs)


CUTS = {"weights": even_packs, "compute": compute_packs, "mixed": mixed_packs}



def _powers(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


OBJECTIVES = {
    "time": lambda r: (r.step_time_s, r.host_bytes + r.p2p_bytes),
    "swap": lambda r: (r.host_bytes, r.p2p_bytes, r.step_time_s),
}
"""Ranking of fitting candidates: the fastest step, or the fewest host bytes (Harmony's swap volume)."""


def search_pipeline(net: "Network", devices: int, budget: int | None = None, device: str = "k40c",
                    optimizer_slots=(), micro_batches: int | None = None, costs=None,
                    max_packs_per_device: int = 4) -> list[PipelineResult]:
    """Every plan that fits over M, k packs per device and `CUTS` (`budget` per device); else BudgetError."""
    if devices < 1:
        raise OptionError(f"--devices must be at least 1, got {devices}")
    profile = get_profile(device)
    budget = profile.memory_bytes if budget is None else budget
    batch = net.input_nodes[0].shape[0]
    n_layers = len(net.layer_nodes)
    ms = [micro_batches] if micro_batches else [m for m in _powers(batch) if batch % m == 0]
    found: list[PipelineResult] = []
    floor: BudgetError | None = None
    for m in ms:
        for k in _powers(max_packs_per_device):
            if devices * k > n_layers:
                break
            for cut in CUTS:
                try:
                    found.append(plan_pipeline_fixed(net, devices, m, devices * k, budget, device, optimizer_slots,
                                                     costs, cut))
                except BudgetError as e:
                    if floor is None or (e.min_budget_bytes or 0) < (floor.min_budget_bytes or 0):
                        floor = e
    if found:
        return found
    if floor is None:
        raise BudgetError(f"'{net.name}' has {n_layers} layers: too few for {devices} devices")
    raise BudgetError(f"no pipeline of '{net.name}' over {devices} devices fits {format_bytes(budget)} per device "
                      f"(micro-batches tried: {ms}); the closest: {floor}", floor.min_budget_bytes, floor.binding)


def plan_pipeline(net: "Network", devices: int, budget: int | None = None, device: str = "k40c",
                  optimizer_slots=(), micro_batches: int | None = None, costs=None,
                  max_packs_per_device: int = 4, objective: str = "time") -> PipelineResult:
    """The best plan of `search_pipeline` by `objective` (a key of `OBJECTIVES`)."""
    found = search_pipeline(net, devices, budget, device, optimizer_slots, micro_batches, costs,
                            max_packs_per_device)
    return min(found, key=OBJECTIVES[objective])


def plan_replicas(replica: "Network", devices: int, budget: int | None = None, device: str = "k40c",
                  optimizer_slots=(), costs=None) -> ReplicasResult:
    """The data-parallel baseline: `replica` (batch B / N) planned by `auto`, times N."""
    from .auto import plan_auto

    profile = get_profile(device)
    budget = profile.memory_bytes if budget is None else budget
    # replicas keep their batch whole (data parallel has no micro-batches)
    route = replica.route(optimizer_slots=optimizer_slots, fused_update=True).with_options(
        PlanOptions(max_micro_batches=1))
    plan = plan_auto(route, budget, device, costs)
    sim = simulate(plan, profile)
    grad = sum(t.nbytes for t in route.tensors.values() if t.role.name == "GRADIENT")
    ring = 2 * (devices - 1) * grad // devices
    return ReplicasResult(devices, plan, devices * sum(moved_by_role(plan).values()), devices * ring,
                          sim.est_step_time_s + ring / profile.peer_bw, sim.est_step_time_s)


def pipeline_json(pipe: PipelineResult, base: ReplicasResult | None) -> dict:
    """The figures of `comparison_lines` as JSON (bytes exact, times in seconds)."""
    out = {"devices": pipe.devices, "budget_per_device": pipe.budget, "micro_batches": pipe.micro_batches,
           "packs": pipe.packs, "cut": pipe.cut,
           "per_device": [{"device": d.device, "packs": d.packs, "peak_bytes": d.peak_bytes,
                           "min_budget_bytes": d.plan.min_budget_bytes, "weights_homed": d.weights_homed,
                           "homed_layers": d.homed_layers, "candidate_layers": d.candidate_layers,
                           "host_bytes": d.host_bytes, "host_bytes_by_role": d.host_by_role}
                          for d in pipe.device_plans],
           "pipeline": {"host_bytes": pipe.host_bytes, "device_bytes": pipe.p2p_bytes,
                        "peak_bytes": pipe.peak_bytes, "est_step_time_s": pipe.step_time_s}}
    if base is not None:
        out["replicas"] = {"host_bytes": base.host_bytes, "device_bytes": base.allreduce_bytes,
                           "peak_bytes": base.peak_bytes, "policy": base.plan.policy,
                           "est_step_time_s": base.step_time_s, "est_replica_step_time_s": base.replica_step_time_s}
    return out


def least_swap_lines(lean: PipelineResult, fast: PipelineResult) -> list[str]:
    """One line on the candidate that moves the fewest bytes through the host, when it is not the fastest."""
    if OBJECTIVES["swap"](lean) == OBJECTIVES["swap"](fast):
        return ["  (the fastest pipeline is also the one that swaps least)"]
    return [f"least host swap instead: {lean.micro_batches} micro-batches, {len(lean.packs)} packs cut by "
            f"{lean.cut}: host<->device {format_bytes(lean.host_bytes)}, device<->device "
            f"{format_bytes(lean.p2p_bytes)}, estimated step time {lean.step_time_s * 1e3:.1f} ms"]


def comparison_lines(pipe: PipelineResult, base: ReplicasResult | None) -> list[str]:
    """`minidl plan --devices N`'s words: per device, then the pipeline against the replicas."""
    lines = [f"pipeline over {pipe.devices} x {pipe.profile.name} ({format_bytes(pipe.budget)} each): "
             f"{pipe.micro_batches} micro-batches, {len(pipe.packs)} packs cut by {pipe.cut} (pack i on device i mod "
             f"{pipe.devices})"]
    for d in pipe.device_plans:
        lines.append(f"  device {d.device}: packs {d.packs}, peak {format_bytes(d.peak_bytes)}, weights "
                     + (f"of {d.homed_layers} of {d.candidate_layers} layers homed on the host, swapped per pack"
                        if d.weights_homed else "resident")
                     + f", host<->device {format_bytes(d.host_bytes)} per step")
    lines.append(f"  per step: host<->device {format_bytes(pipe.host_bytes)}, device<->device "
                 f"{format_bytes(pipe.p2p_bytes)}, estimated step time {pipe.step_time_s * 1e3:.1f} ms")
    if base is not None:
        lines.append(f"{base.devices} data-parallel replicas (policy auto, same budget each): peak "
                     f"{format_bytes(base.peak_bytes)}, host<->device {format_bytes(base.host_bytes)} per step, "
                     f"all-reduce {format_bytes(base.allreduce_bytes)}, estimated step time "
                     f"{base.step_time_s * 1e3:.1f} ms ({base.replica_step_time_s * 1e3:.1f} ms + all-reduce)")
        ratio = (f"{base.host_bytes / pipe.host_bytes:.1f}x" if pipe.host_bytes else
                 "the pipeline swaps nothing through the host")
        lines.append(f"  host swap volume: replicas / pipeline = {ratio}; step time: replicas / pipeline = "
                     f"{base.step_time_s / pipe.step_time_s:.2f}x")
    return lines


__all__ = ["CUTS", "OBJECTIVES", "DevicePlan", "PipelineResult", "ReplicasResult", "comparison_lines",
           "compute_packs", "least_swap_lines", "min_max_cut", "mixed_packs", "pack_devices", "pipeline_json",
           "pipeline_time", "plan_pipeline", "plan_pipeline_fixed", "plan_replicas", "search_pipeline", "sub_routes",
           "transfers"]
