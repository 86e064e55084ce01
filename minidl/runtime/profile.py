"""Where a step's time goes: the traced calls (`Backend.call_clock`) summed per (layer kind, phase), median over
steps, beside the route's FLOPs and bytes and the simulator's estimate.

Rules: a fused ReLU counts under the layer it was folded into; time outside the traced calls is the row `other`.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from ..graph.route import Phase
from ..memory.simulate import DeviceProfile, get_profile, step_costs

OTHER = "other"
PHASES = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward", Phase.UPDATE: "update"}


@dataclass(slots=True)
class ProfileRow:
    """One (layer kind, phase): calls, median seconds, FLOPs, bytes and simulated seconds per step."""

    kind: str
    phase: str
    calls: int
    seconds: float
    flops: int = 0
    bytes: int = 0
    sim_s: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def step_kind(route, index: int) -> tuple[str, str]:
    """(layer kind or `update`, phase) of route step `index`."""
    step = route.steps[index]
    phase = PHASES[step.phase]
    if step.phase is Phase.UPDATE:
        return "update", phase
    return route.network.nodes[step.node].type_name, phase


def profile_steps(executor, batches, device: DeviceProfile | str | None = None) -> tuple[list[ProfileRow], list[float]]:
    """Train a step per batch on a tracing `executor`; (rows largest first, `other` last; each step's wall time).
    Simulated figures are `device`'s (None: 0)."""
    if not executor.tracing:
        raise ValueError("profile_steps needs a tracing executor (RunConfig(trace=True)): its calls are what is timed")
    route = executor.route
    per_step: list[dict[tuple[str, str], list[float]]] = []
    walls = []
    for x, y in batches:
        mark = len(executor.trace)
        t = time.perf_counter()
        executor.train_step(x, y)
        walls.append(time.perf_counter() - t)
        sums: dict[tuple[str, str], list[float]] = {}
        for ev in executor.trace[mark:]:
            if ev.track != "compute":
                continue
            acc = sums.setdefault(step_kind(route, ev.step), [0.0, 0])
            acc[0] += ev.dur_s
            acc[1] += 1
        per_step.append(sums)
    if not per_step:
        raise ValueError("profile_steps needs at least one batch")
    if isinstance(device, str):
        device = get_profile(device)
    costs = step_costs(route, device) if device is not None else None
    static: dict[tuple[str, str], list] = {}
    for st in route.steps:
        acc = static.setdefault(step_kind(route, st.index), [0, 0, 0.0])
        if costs is not None:
            c = costs[st.index]
            acc[0] += c.flops
            acc[1] += c.bytes
            acc[2] += c.time_s
    keys = sorted({k for s in per_step for k in s})
    rows = []
    for key in keys:
        seconds = statistics.median(s.get(key, [0.0, 0])[0] for s in per_step)
        calls = max(s.get(key, [0.0, 0])[1] for s in per_step)
        flops, nbytes, sim = static.get(key, [0, 0, 0.0])
        rows.append(ProfileRow(key[0], key[1], calls, seconds, int(flops), int(nbytes), float(sim)))
    rows.sort(key=lambda r: -r.seconds)
    wall = statistics.median(walls)
    rows.append(ProfileRow(OTHER, "step", 0, max(0.0, wall - sum(r.seconds for r in rows))))
    return rows, walls
