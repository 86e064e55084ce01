"""The baseline Harmony is measured against (Li et al., VLDB 2022): a swapper that moves each micro-batch's weights
and activations through the host, simulated on a device profile with the simulator's roofline (`step_costs`).

Rules, per micro-batch of `u` samples on the plain route at batch `u`:
- forward step: its parameters swapped in; activations backward reads swapped out once written. Backward step:
  parameters and stashed activations in; weight gradients out (summed on the host, the all-reduce free: this favours
  the baseline). Deltas stay.
- update on the host, at the device's update time (as the simulator charges every host update).
- timeline: compute and one copy stream per direction; a step's inputs are prefetched while the step before computes
  (double buffering), its outputs copied out once computed: the baseline hides every copy it can.
- micro-batch size: the fastest power of two dividing the batch whose working set (twice `packs.step_floor`) fits.
Over N devices: `dp`, N replicas of B / N; `pp`, GPipe with swapping, N stages of balanced FLOPs, activations and
deltas device to device at the peer bandwidth.
Limitations: nothing stays resident between a layer's uses (the baseline's definition); no per-copy latency;
independent host links.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..core.errors import BudgetError, OptionError
from ..core.tensors import Role
from ..graph.route import Phase, Route
from .pool import format_bytes
from .schedulers.packs import step_floor
from .simulate import DeviceProfile, get_profile, step_costs

if TYPE_CHECKING:  # pragma: no cover
    from ..graph.network import Network

MODES = ("dp", "pp")
_WEIGHTS = (Role.PARAMETER, Role.BUFFER, Role.WEIGHT_COPY)   # a half mode's layers read the weights' copies
_STASHED = (Role.ACTIVATION, Role.AUX)


@dataclass(slots=True)
class SwapTask:
    """One step under the swapper: its compute time and the bytes it swaps in before and out after."""

    step: int
    phase: Phase
    layer: str
    compute_s: float
    in_bytes: dict[str, int] = field(default_factory=dict)    # by role word
    out_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def swap_in(self) -> int:
        return sum(self.in_bytes.values())

    @property
    def swap_out(self) -> int:
        return sum(self.out_bytes.values())


@dataclass(slots=True)
class SwapperResult:
    """The baseline: `micro_batches` of `micro_batch` samples per device (dp) or in all (pp)."""

    mode: str
    devices: int
    micro_batch: int
    micro_batches: int
    host_bytes: int                  # per training step, all devices
    host_by_role: dict[str, int]
    p2p_bytes: int                   # pp only
    step_time_s: float
    compute_time_s: float            # the busiest device's compute alone
    working_set_bytes: int           # twice the busiest step's bytes (double buffered)
    profile: DeviceProfile


def swap_tasks(route: Route, profile: DeviceProfile) -> list[SwapTask]:
    """The route's steps with what the swapper moves at each."""
    costs = step_costs(route, profile)
    read_in_bwd: set[str] = set()
    for s in route.steps:
        if s.phase is Phase.BACKWARD:
            read_in_bwd.update(s.reads)
    brought: set[str] = set()
    out: list[SwapTask] = []
    for s, c in zip(route.steps, costs):
        t = SwapTask(s.index, s.phase, s.name, c.time_s)
        role = {tid: route.tensors[tid].role for tid in set(s.reads) | set(s.writes)}
        if s.phase is Phase.FORWARD:
            t.in_bytes["weights"] = sum(route.tensors[x].nbytes for x in set(s.reads) if role[x] in _WEIGHTS)
            t.out_bytes["weights"] = sum(route.tensors[x].nbytes for x in set(s.writes) if role[x] is Role.BUFFER)
            t.out_bytes["activations"] = sum(route.tensors[x].nbytes for x in set(s.writes)
                                             if role[x] in _STASHED and x in read_in_bwd)
        elif s.phase is Phase.BACKWARD:
            stashed = {x for x in set(s.reads) if role[x] in _STASHED and x not in brought}
            brought.update(stashed)
            t.in_bytes["weights"] = sum(route.tensors[x].nbytes for x in set(s.reads) if role[x] in _WEIGHTS)
            t.in_bytes["activations"] = sum(route.tensors[x].nbytes for x in stashed)
            grads = {x for x in s.writes if route.tensors[x].role is Role.GRADIENT}
            grads.update(a.into for a in s.accumulate if route.tensors[a.into].role is Role.GRADIENT)
            t.out_bytes["gradients"] = sum(route.tensors[x].nbytes for x in grads)
        out.append(t)
    return out


def timeline(tasks: list[SwapTask], profile: DeviceProfile, start: float = 0.0) -> float:
    """End time of `tasks` in order on one device; a task's inputs come in once the task two before has computed."""
    bw = profile.link_bw
    lanes = [start, start]                     # when the copy stream in, and the one out, are free
    out_lane = 1 if profile.duplex else 0
    compute = start
    ends: list[float] = []
    for k, t in enumerate(tasks):
        free_buffer = ends[k - 2] if k >= 2 else start
        lanes[0] = max(lanes[0], free_buffer) + t.swap_in / bw
        compute = max(compute, lanes[0]) + t.compute_s
        ends.append(compute)
        if t.swap_out:
            lanes[out_lane] = max(lanes[out_lane], compute) + t.swap_out / bw
    return max(compute, *lanes)


def _sum_roles(tasks: list[SwapTask], times: int = 1) -> dict[str, int]:
    out = {"weights": 0, "gradients": 0, "activations": 0}
    for t in tasks:
        for d in (t.in_bytes, t.out_bytes):
            for k, v in d.items():
                out[k] += v * times
    return out


def micro_batch_sizes(build: Callable[[int], "Network"], batch: int, profile: DeviceProfile,
                      optimizer_slots=(), math: str = "fp32") -> list[tuple[int, Route, int]]:
    """The powers of two dividing `batch` whose double-buffered working set fits the profile's usable memory,
    largest first, each with its plain route and working set. BudgetError if not even one sample fits."""
    u = batch & -batch                       # the largest power of two dividing the batch
    out: list[tuple[int, Route, int]] = []
    while u >= 1:
        route = build(u).route(optimizer_slots=optimizer_slots, fused_update=True, math=math)
        need = 2 * step_floor(route)
        if need <= profile.usable_bytes:
            out.append((u, route, need))
        elif out:
            break
        u //= 2
    if not out:
        raise BudgetError(f"the swapper baseline: one sample's busiest step needs {format_bytes(need // 2)} twice "
                          f"(double buffered), more than the {format_bytes(profile.usable_bytes)} a "
                          f"{profile.name} leaves", need, "one sample")
    return out


def simulate_swapper(build: Callable[[int], "Network"], batch: int, devices: int, device: DeviceProfile | str,
                     mode: str = "dp", optimizer_slots=(), math: str = "fp32") -> SwapperResult:
    """The swapper baseline (module doc) for the network `build(b)` builds at batch b, trained at minibatch `batch`
    over `devices` devices of profile `device`: of the micro-batch sizes that fit, the fastest (ties: the larger);
    `math` the math mode (a half mode swaps the weights' half copies in, the float32 gradients out)."""
    if mode not in MODES:
        raise OptionError(f"swapper mode must be one of {MODES}, got {mode!r}")
    if devices < 1 or (mode == "dp" and batch % devices):
        raise OptionError(f"the swapper baseline: {devices} devices must divide the batch of {batch} (mode dp)")
    profile = get_profile(device) if isinstance(device, str) else device
    per_device = batch // devices if mode == "dp" else batch
    best: SwapperResult | None = None
    for u, route, need in micro_batch_sizes(build, per_device, profile, optimizer_slots, math):
        tasks = swap_tasks(route, profile)
        r = _data_parallel(tasks, per_device // u, u, devices, profile, need) if mode == "dp" else \
            _gpipe(route, tasks, batch // u, u, devices, profile, need)
        if best is None or r.step_time_s < best.step_time_s:
            best = r
    return best


def _data_parallel(tasks: list[SwapTask], m: int, u: int, devices: int, profile: DeviceProfile,
                   need: int) -> SwapperResult:
    """N replicas, each `m` micro-batches of `u` samples."""
    train = [t for t in tasks if t.phase is not Phase.UPDATE]
    update = [t for t in tasks if t.phase is Phase.UPDATE]
    t = timeline(train * m + update, profile)
    roles = _sum_roles(train, m * devices)
    compute = m * math.fsum(x.compute_s for x in train) + math.fsum(x.compute_s for x in update)
    return SwapperResult("dp", devices, u, m, sum(roles.values()), roles, 0, t, compute, need, profile)


def _gpipe(route: Route, tasks: list[SwapTask], m: int, u: int, devices: int, profile: DeviceProfile,
           need: int) -> SwapperResult:
    """GPipe with swapping."""
    from .schedulers.pipeline import compute_packs

    stages = compute_packs(route.network, devices)
    n = len(stages)
    stage_of = {name: k for k, names in enumerate(stages) for name in names}
    per = [[t for t in tasks if t.phase is ph and stage_of[t.layer] == k] for k in range(n)
           for ph in (Phase.FORWARD, Phase.BACKWARD, Phase.UPDATE)]
    fwd, bwd, upd = per[0::3], per[1::3], per[2::3]
    f = [timeline(x, profile) for x in fwd]
    b = [timeline(x, profile) for x in bwd]
    up = [timeline(x, profile) for x in upd]
    # bytes crossing stage boundaries per micro-batch: a tensor written on one stage, read on another
    writer: dict[str, int] = {}
    for s in route.steps:
        if s.phase is not Phase.UPDATE:
            for tid in list(s.writes) + [a.into for a in s.accumulate]:
                writer.setdefault(tid, stage_of[s.name])
    cross_f = [0] * n   # into stage k in forward
    cross_b = [0] * n   # into stage k in backward
    seen: set[tuple[str, int]] = set()
    for s in route.steps:
        if s.phase is Phase.UPDATE:
            continue
        k = stage_of[s.name]
        for tid in s.reads:
            w = writer.get(tid)
            spec = route.tensors[tid]
            if w is None or w == k or spec.role.persistent or (tid, k) in seen:
                continue
            seen.add((tid, k))
            (cross_f if s.phase is Phase.FORWARD else cross_b)[k] += spec.nbytes
    fe = [[0.0] * m for _ in range(n)]
    for j in range(m):
        for k in range(n):
            ready = fe[k][j - 1] if j else 0.0
            if k:
                ready = max(ready, fe[k - 1][j] + cross_f[k] / profile.peer_bw)
            fe[k][j] = ready + f[k]
    be = [[0.0] * m for _ in range(n)]
    for jj, j in enumerate(reversed(range(m))):
        for k in reversed(range(n)):
            ready = be[k][m - jj] if jj else fe[k][m - 1]
            if k < n - 1:
                ready = max(ready, be[k + 1][j] + cross_b[k] / profile.peer_bw)
            be[k][j] = ready + b[k]
    end = max(be[k][0] + up[k] for k in range(n))
    roles = _sum_roles([t for t in tasks if t.phase is not Phase.UPDATE], m)
    compute = max(m * math.fsum(t.compute_s for t in fwd[k] + bwd[k]) + math.fsum(t.compute_s for t in upd[k])
                  for k in range(n))
    return SwapperResult("pp", n, u, m, sum(roles.values()), roles, m * (sum(cross_f) + sum(cross_b)), end,
                         compute, need, profile)


__all__ = ["MODES", "SwapTask", "SwapperResult", "micro_batch_sizes", "simulate_swapper", "swap_tasks", "timeline"]
