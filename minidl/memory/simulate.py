"""The simulator: the planner on shape-only tensors, plus a roofline cost model of a device.

It answers "what would this network need, and how fast would it run, on a GPU we do not have?". Peak memory
needs no model at all: the plan is computed by the same planner the executor replays, so the simulated peak
*is* the executor's pool peak (tests hold this byte for byte). Step time is an estimate: each route step takes
max(FLOPs / (peak FLOP/s x efficiency), bytes touched / memory bandwidth), and host transfers run on the link
at its bandwidth, overlapped with compute where the plan allows (`link_timeline`): only the time a RELEASE or
WAIT event must block for its copy adds to the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..core.errors import OptionError
from ..graph.network import Network
from ..graph.route import Phase, Route
from .plan import Plan
from .replay import replay_peak


@dataclass(slots=True, frozen=True)
class DeviceProfile:
    name: str
    memory_bytes: int
    flops: float          # peak float32 FLOP/s
    mem_bw: float         # device memory bandwidth, bytes/s
    link_bw: float        # host <-> device bandwidth, bytes/s (one direction)
    efficiency: float = 0.5  # share of peak FLOP/s dense layers reach in practice
    note: str = ""
    # device <-> device bandwidth, bytes/s, one direction (`--devices`); default 8.2 GiB/s: Harmony's simulator's
    # GPU-to-GPU figure (PCIe 3 peer to peer), kept for every PCIe profile; the h100 gets NVLink 4's 450 GB/s
    peer_bw: float = 8.2 * (1 << 30)
    # A measured profile (memory/calibrate.py) sets these: each copy's fixed cost (launch + DMA setup), and whether
    # offloads and prefetches run on separate streams (the CUDA backend: one per direction; `link_bw` is then what
    # each direction reaches while the other is busy). The defaults are the datasheet profiles' one FIFO stream.
    link_latency_s: float = 0.0
    duplex: bool = False
    # Device memory the process holds before the first tensor: the CUDA context and the cuBLAS/cuDNN handles
    # (their kernels' code and static buffers). Reserved from the memory a plan may use (`usable_bytes`); 0 for the
    # CPU, and for a profile whose memory is set by `NAME:SIZE` (SIZE is then what the plan may use).
    context_bytes: int = 0
    # A GPU: plans made here for it size convolution workspaces with the cuDNN model (`cudnn_model`), not the
    # CPU's menu.
    gpu: bool = False

    @property
    def usable_bytes(self) -> int:
        """The memory left to the plan's arena once the context and library handles are loaded."""
        return self.memory_bytes - self.context_bytes

    def model_label(self) -> str:
        """What a step time estimated on this profile is: a roofline model of the profile's device, where its
        figures come from, and that it is no measurement (a plan never runs a step)."""
        return (f"a roofline model of profile {self.name} ({self.flops / 1e9:g} GFLOP/s x {self.efficiency:g}, "
                f"{self.mem_bw / 1e9:g} GB/s; {self.note}), not a measurement"
                + ("" if self.gpu else " of this machine; it counts no per-layer overhead: `minidl train` times "
                   "the steps"))


GiB = 1 << 30
MiB = 1 << 20

# CUDA context + cuBLAS + cuDNN handles, per GPU generation. ESTIMATES, to be checked on a lent GPU (free memory
# from cudaMemGetInfo before cuInit and after creating both handles and running one convolution):
# - Kepler (K40c) and Maxwell (TITAN X), the CUDA 8-9 / cuDNN 5-7 of SuperNeurons' time: nvidia-smi commonly shows
#   ~70-100 MiB for a bare context and ~250-400 MiB once cuBLAS and cuDNN have loaded their kernels; 320 MiB.
# - Volta (V100), CUDA 10-11 / cuDNN 7-8: larger kernel images (more architectures, tensor-core kernels); 480 MiB.
# - Hopper (H100), CUDA 12 / cuDNN 8-9 with lazy module loading (CUDA_MODULE_LOADING=LAZY, the default since
#   12.2): a ~500 MiB context + handles is typical; without lazy loading cuDNN alone can exceed 1 GiB. 512 MiB.
CONTEXT_KEPLER = 320 * MiB
CONTEXT_MAXWELL = 320 * MiB
CONTEXT_VOLTA = 480 * MiB
CONTEXT_HOPPER = 512 * MiB

PROFILES: dict[str, DeviceProfile] = {
    # Measured on the development machine (2 cores): numpy sgemm 2048^3 at ~65 GFLOP/s, np.copyto at ~22 GB/s
    # read+write (so ~11 GB/s for a one-way host "transfer", which is a memcpy on the CPU).
    "cpu": DeviceProfile("cpu", 24 * GiB, 65e9, 22e9, 11e9, 0.6, "measured on a 2-core AMD EPYC VM, 2026-11-22"),
    # SuperNeurons' GPU: Tesla K40c, 12 GB, 4.29 TFLOP/s fp32, 288 GB/s, PCIe 3 x16 ~10 GB/s effective.
    "k40c": DeviceProfile("k40c", 12 * 10**9, 4.29e12, 288e9, 10e9, 0.5, "datasheet",
                          context_bytes=CONTEXT_KEPLER, gpu=True),
    # GeForce GTX TITAN X (Maxwell): 12 GB, 6.6 TFLOP/s, 336 GB/s, PCIe 3.
    "titanx": DeviceProfile("titanx", 12 * 10**9, 6.6e12, 336e9, 10e9, 0.5, "datasheet",
                            context_bytes=CONTEXT_MAXWELL, gpu=True),
    # Tesla V100 16 GB (PCIe): 14 TFLOP/s fp32, 900 GB/s, PCIe 3 ~12 GB/s.
    "v100": DeviceProfile("v100", 16 * 10**9, 14e12, 900e9, 12e9, 0.5, "datasheet",
                          context_bytes=CONTEXT_VOLTA, gpu=True),
    # H100 80 GB SXM: 67 TFLOP/s fp32 (non-tensor), 3.35 TB/s HBM3, PCIe 5 x16 ~50 GB/s.
    "h100": DeviceProfile("h100", 80 * 10**9, 67e12, 3.35e12, 50e9, 0.5, "datasheet", peer_bw=450e9,
                          context_bytes=CONTEXT_HOPPER, gpu=True),
    # Harmony's simulator (Li et al., VLDB 2022; shared/PAPERS.md): 11.5 GiB/s host swap and 8.2 GiB/s GPU-to-GPU
    # (PCIe 3 peer to peer), here on a K40c's compute and 12 GB, for `--devices` tables in the paper's terms.
    "harmony": DeviceProfile("harmony", 12 * 10**9, 4.29e12, 288e9, 11.5 * GiB, 0.5,
                             "k40c datasheet; host and peer links as Harmony's simulator assumes", 8.2 * GiB,
                             context_bytes=CONTEXT_KEPLER, gpu=True),
    # Harmony's own machine (Li et al., VLDB 2022): GeForce GTX 1080 Ti (Pascal), 11 GiB GDDR5X, 11.3 TFLOP/s fp32
    # at boost clock, 484 GB/s; the links as Harmony's simulator assumes them, per direction (its scheduler's
    # --bw_swap 11.5 GiB/s and --bw_p2p 8.2 GiB/s; the GPU copies both ways at once: duplex). Harmony's scheduler
    # plans each GPU under a 10 GiB cap (--memory_cap), leaving the rest to the CUDA context, NCCL and allocator
    # slack: that 1 GiB is reserved here, so a plan gets the 10 GiB Harmony's own plans get.
    "gtx1080ti": DeviceProfile("gtx1080ti", 11 * GiB, 11.3e12, 484e9, 11.5 * GiB, 0.5,
                               "datasheet; host and peer links (per direction) and the 10 GiB usable per GPU as "
                               "Harmony's scheduler assumes", 8.2 * GiB, duplex=True, context_bytes=GiB, gpu=True),
}


def get_profile(name: str) -> DeviceProfile:
    """A profile by name; `NAME:SIZE` (e.g. `k40c:64GB`) is that device with its memory raised or lowered, to
    ask what a network would do on a device big enough to hold it (the in-memory estimate). SIZE is the memory
    the plan may use: no CUDA context is reserved from it."""
    base, sep, mem = name.partition(":")
    try:
        prof = PROFILES[base]
    except KeyError:
        raise OptionError(f"unknown device profile {name!r}: expected one of {', '.join(PROFILES)}, optionally "
                          f"with ':SIZE' (e.g. k40c:64GB)") from None
    if not sep:
        return prof
    from dataclasses import replace

    from .pool import parse_size

    try:
        size = parse_size(mem)
    except ValueError as e:
        raise OptionError(f"device profile {name!r}: {e}") from None
    return replace(prof, memory_bytes=size, context_bytes=0,
                   note=f"{prof.note}; memory set to {mem}, all of it the plan's (no context reserved)")


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
    exposed_transfer_s: float = 0.0   # transfer time not hidden behind compute (included in est_step_time_s)
    recompute_flops: int = 0          # forward FLOPs re-run by RECOMPUTE events (included in compute_time_s)
    step_flops: int = 0               # FLOPs of the whole step, recomputation included
    _peak: int | None = None          # peak_bytes, replayed once on first use

    @property
    def recompute_flops_share(self) -> float:
        """Share of the step's FLOPs spent recomputing dropped activations."""
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    @property
    def transfer_hidden_fraction(self) -> float:
        """Share of link time overlapped with compute (1.0 when nothing moves: nothing is exposed)."""
        if self.transfer_time_s <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.exposed_transfer_s / self.transfer_time_s))

    @property
    def peak_bytes(self) -> int:
        """Derived by replaying the plan's events on a shape-only pool of the simulator's own (memory.replay),
        not read from the plan: tests hold plan = simulator = executor, three numbers computed apart."""
        if self._peak is None:
            self._peak = replay_peak(self.plan)
        return self._peak

    @property
    def fits_device(self) -> bool:
        """Whether the plan's arena fits the memory the device leaves once its context is loaded."""
        return self.plan.min_budget_bytes <= self.device.usable_bytes


def step_costs(route: Route, device: DeviceProfile) -> list[StepCost]:
    """Roofline estimate of each route step on `device` (fresh records each call: callers add plan costs to
    them; the arithmetic is done once per route and device)."""
    key = ("step_costs", device)
    if key not in route.memo:
        route.memo[key] = [(c.flops, c.bytes, c.time_s) for c in _step_costs(route, device)]
    return [StepCost(f, b, t) for f, b, t in route.memo[key]]


def _step_costs(route: Route, device: DeviceProfile) -> list[StepCost]:
    net: Network = route.network
    out: list[StepCost] = []
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
        t = max(flops / (device.flops * device.efficiency), nbytes / device.mem_bw)
        out.append(StepCost(int(flops), int(nbytes), t))
    return out


def simulate(plan: Plan, device: DeviceProfile | str = "k40c") -> SimResult:
    """Estimate the step time of `plan` on `device`. The peak is the plan's own (exact)."""
    dev = get_profile(device) if isinstance(device, str) else device
    costs = step_costs(plan.route, dev)
    rflops = add_plan_costs(plan, costs)
    compute = math.fsum(c.time_s for c in costs)
    # Transfers overlap compute on their own stream; only what cannot hide adds to the step.
    link = link_timeline(plan, dev, costs)
    return SimResult(plan, dev, costs, compute, link.transfer_s, compute + link.exposed_s, link.exposed_s, rflops,
                     sum(c.flops for c in costs))


def add_plan_costs(plan: Plan, costs: list[StepCost]) -> int:
    """Charge each step what the plan adds to it; return the recomputed FLOPs.

    - A RECOMPUTE event before step k re-runs that layer's forward: its forward step's cost is added to step k.
    - A workspace algorithm slower than the layer's fastest (chosen for lack of memory) scales the step's time
      by the ratio of their estimated costs (`WorkspaceOption.est_cost`, the layer's deterministic estimate).
    """
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
    """The simulator's timeline of one step: when each route step computes and when each copy is on the link
    (seconds from the step's start). `write_trace` draws it, so a plan's trace is the predicted timeline."""

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
    """Replay the plan on two clocks: the compute stream and the host link (one FIFO copy stream).

    OFFLOAD and PREFETCH queue a copy of `link_latency_s + nbytes / link_bw` seconds that starts when the link
    is free and the event is reached; RELEASE and WAIT advance the compute clock to the end of that tensor's
    copy if it has not finished yet. That blocked time is the exposed transfer time; the rest of the copy time
    hid behind compute. This is the executor's transfer engine, modelled: copies in issue order, waits only
    where the plan says the data is needed. With `dev.duplex` (a measured CUDA profile) offloads and prefetches
    queue on two clocks, one per direction, as the CUDA backend's two copy streams do.
    """
    from .plan import EventKind

    costs = step_costs(plan.route, dev) if costs is None else costs
    now = total = exposed = 0.0
    free = {EventKind.OFFLOAD: 0.0, EventKind.PREFETCH: 0.0}   # when each direction's stream is free
    done: dict[str, float] = {}

    def apply(ev) -> None:
        nonlocal now, total, exposed
        if ev.kind in (EventKind.OFFLOAD, EventKind.PREFETCH):
            d = dev.link_latency_s + ev.nbytes / dev.link_bw
            lane = ev.kind if dev.duplex else EventKind.OFFLOAD   # one FIFO stream unless duplex
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


def transfer_seconds(plan: Plan, dev: DeviceProfile) -> float:
    from .plan import EventKind

    moved = sum(ev.nbytes for sp in plan.steps for ev in sp.before + sp.after
                if ev.kind in (EventKind.OFFLOAD, EventKind.PREFETCH))
    return moved / dev.link_bw
