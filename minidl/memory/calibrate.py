"""A measured device profile: the simulator's CUDA timing from measurement instead of the datasheet.

`calibrated_profile` takes a `backend.cuda.calibrate.LinkMeasurement` (each direction's bandwidth with both
busy, the per-copy latency: `link_bw` the slower, `duplex=True`) and optionally fits the one scalar
`efficiency` so the route's convolutions take their autotuned times; `fit_profile` fits it to a measured
per-layer profile (benchmarks/gpu_profile.py). `auto` then weighs offload against recompute at that machine's
costs. Only `measured_profile` needs a GPU; the rest is arithmetic, host-tested.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..graph.route import Phase, Route
from .simulate import DeviceProfile, get_profile
from .workspace import CostTable, cost_key

#: Efficiency fitted from measurements is clamped here: a fit outside means the cache does not match the route.
EFFICIENCY_RANGE = (0.01, 1.0)


def calibrated_profile(base: DeviceProfile | str, link, costs: CostTable | None = None, route: Route | None = None,
                       name: str = "measured") -> DeviceProfile:
    """`base` with `link`'s figures and, given `costs` and `route`, its fitted efficiency."""
    prof = get_profile(base) if isinstance(base, str) else base
    bw = min(float(link.duplex_h2d_bw), float(link.duplex_d2h_bw))
    if not bw > 0:
        raise ValueError(f"a measured link needs positive bandwidths, got {link}")
    eff = prof.efficiency
    if costs is not None and route is not None:
        fitted = fit_efficiency(route, costs, prof.flops)
        if fitted is not None:
            eff = fitted
    note = (f"measured on {link.device or 'this GPU'}: link {bw / 1e9:.1f} GB/s each way with both busy, "
            f"{link.latency_s * 1e6:.1f} us per copy; efficiency {eff:.3f}; compute from {prof.name}")
    return replace(prof, name=name, link_bw=bw, link_latency_s=float(link.latency_s), duplex=True,
                   efficiency=eff, note=note)


def fit_efficiency(route: Route, costs: CostTable, peak_flops: float) -> float | None:
    """The efficiency at which the roofline's FLOP time of the route's measured convolutions (fastest
    algorithm each) equals their measured time; None when the cache covers none."""
    flops = seconds = 0.0
    net = route.network
    for step in route.steps:
        if step.workspace is None:
            continue
        node = net.nodes[step.node]
        layer = node.layer
        in_shapes, out_shape = route.shapes_of(node.index)
        phase = "fwd" if step.phase is Phase.FORWARD else "bwd"
        entry = costs.seconds.get(cost_key(layer, phase, in_shapes, out_shape, net.dtype.itemsize,
                                           route.backend_name, step.accumulates_into))
        if not entry:
            continue
        seconds += min(entry.values())
        flops += layer.flops(in_shapes, out_shape) if phase == "fwd" else layer.backward_flops(in_shapes, out_shape)
    if seconds <= 0 or flops <= 0:
        return None
    lo, hi = EFFICIENCY_RANGE
    return min(hi, max(lo, flops / seconds / peak_flops))


def measured_profile(backend, base: DeviceProfile | str | None = None, costs: CostTable | None = None,
                     route: Route | None = None) -> DeviceProfile:
    """Measure `backend`'s link (a GPU) and return the calibrated profile."""
    return calibrated_profile(base or backend.profile, backend.measure_link(), costs, route)


@dataclass(slots=True)
class KindFit:
    """A measured profile row against the roofline: the shares of peak FLOP/s and bandwidth reached."""

    kind: str
    phase: str
    measured_s: float
    sim_s: float
    flops_efficiency: float       # FLOPs / (measured seconds x peak FLOP/s)
    bandwidth_efficiency: float   # bytes touched / (measured seconds x memory bandwidth)
    bound: str                    # "flops" or "bytes": the larger of the roofline's two times

    @property
    def sim_error(self) -> float | None:
        """(simulated - measured) / measured; None where nothing was measured."""
        return (self.sim_s - self.measured_s) / self.measured_s if self.measured_s > 0 else None


def fit_profile(rows, base: DeviceProfile | str) -> tuple[list[KindFit], DeviceProfile]:
    """Each measured row's reached efficiencies, and `base` with the one `efficiency` at which the
    roofline's time of all rows equals theirs (bisection, clamped to EFFICIENCY_RANGE)."""
    prof = get_profile(base) if isinstance(base, str) else base
    rows = [r if isinstance(r, dict) else {"kind": r.kind, "phase": r.phase, "seconds": r.seconds, "flops": r.flops,
                                           "bytes": r.bytes, "sim_s": r.sim_s} for r in rows]
    rows = [r for r in rows if (r["flops"] or r["bytes"]) and r["seconds"] > 0]
    if not rows:
        raise ValueError("fit_profile: no measured row has FLOPs or bytes (a profile made without a device profile?)")
    fits = []
    for r in rows:
        s = float(r["seconds"])
        flop_t, byte_t = r["flops"] / prof.flops, r["bytes"] / prof.mem_bw
        fits.append(KindFit(r["kind"], r["phase"], s, float(r.get("sim_s", 0.0)), flop_t / s, byte_t / s,
                            "flops" if flop_t / prof.efficiency >= byte_t else "bytes"))
    measured = sum(float(r["seconds"]) for r in rows)

    def roofline(eff: float) -> float:
        return sum(max(r["flops"] / (prof.flops * eff), r["bytes"] / prof.mem_bw) for r in rows)

    lo, hi = EFFICIENCY_RANGE
    if roofline(hi) >= measured:        # measured faster than the roofline allows even at full efficiency
        eff = hi
    elif roofline(lo) <= measured:      # measured slower than the roofline at the least efficiency
        eff = lo
    else:
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if roofline(mid) > measured else (lo, mid)
        eff = (lo + hi) / 2
    note = f"efficiency {eff:.3f} fitted to a measured per-layer profile; compute from {prof.name}"
    return fits, replace(prof, name=f"{prof.name}-profiled", efficiency=eff, note=note)
