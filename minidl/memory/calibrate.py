"""A measured device profile: the simulator's CUDA timing from measurement instead of the datasheet.

`auto` decides between offloading a tensor and recomputing it by simulating both on a device profile. With the
datasheet profiles a copy costs `nbytes / link_bw` on one FIFO stream; on the GPU each copy also pays a fixed
cost, the two directions run on their own streams, and each direction is slower while the other is busy. So
`calibrated_profile` builds a profile from:

* a `backend.cuda_calibrate.LinkMeasurement` (each direction's bandwidth with both busy, and the per-copy
  latency): `link_bw` = the slower direction's duplex bandwidth, `link_latency_s`, `duplex=True`;
* optionally the autotune cache (`workspace.CostTable` with measured seconds, `--autotune CACHE.json`): the
  profile's `efficiency` (the share of peak FLOP/s the roofline assumes) is fitted so that the route's
  convolutions, at their fastest measured algorithm, take the time they were measured to take. Convolutions
  are most of a CNN step, and the fit is one scalar: layers the cache does not cover keep the roofline's shape.

A copy the link cannot hide then costs what it costs on that machine, and `auto` recomputes instead
(tests/memory/test_calibrate.py shows the switch with two given measurements). `measured_profile(backend)` does
the measuring (a GPU only); everything else here is arithmetic, host-tested. `fit_profile` fits the same scalar
to a measured per-layer profile (benchmarks/gpu_profile.py) instead, and says per layer kind and phase how far
each row is from the roofline.
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
    """`base` with the link figures of `link` (a LinkMeasurement) and, given `costs` and `route`, its efficiency
    fitted to the measured convolution times (see the module docstring)."""
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
    """The efficiency at which the roofline's FLOP time of the route's measured convolutions equals their
    measured time (fastest algorithm of each, from `costs.seconds`); None when the cache covers none of them."""
    flops = seconds = 0.0
    net = route.network
    for step in route.steps:   # the steps, keys and item size `workspace.workspace_choices` ranks by
        if step.workspace is None:
            continue
        node = net.nodes[step.node]
        layer = node.layer
        in_shapes, out_shape = route.shapes_of(node.index)
        phase = "fwd" if step.phase is Phase.FORWARD else "bwd"
        entry = costs.seconds.get(cost_key(layer, phase, in_shapes, out_shape, net.dtype.itemsize,
                                           route.backend_name))
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
    """Measure `backend`'s link (`backend.measure_link()`, a GPU) and return the calibrated profile; `base`
    defaults to the backend's nearest datasheet profile."""
    return calibrated_profile(base or backend.profile, backend.measure_link(), costs, route)


@dataclass(slots=True)
class KindFit:
    """A measured profile row against the roofline: the share of the device's peak FLOP/s and of its memory
    bandwidth the row's calls reached, which of the two the roofline says binds it, and the simulator's error."""

    kind: str
    phase: str
    measured_s: float
    sim_s: float
    flops_efficiency: float       # FLOPs / (measured seconds x peak FLOP/s)
    bandwidth_efficiency: float   # bytes touched / (measured seconds x memory bandwidth)
    bound: str                    # "flops" or "bytes": the larger of the roofline's two times

    @property
    def sim_error(self) -> float | None:
        """(simulated - measured) / measured (None where nothing was measured)."""
        return (self.sim_s - self.measured_s) / self.measured_s if self.measured_s > 0 else None


def fit_profile(rows, base: DeviceProfile | str) -> tuple[list[KindFit], DeviceProfile]:
    """The rows of a measured per-layer profile (benchmarks/results/gpu_profile_*.json: dicts or
    `runtime.profile.ProfileRow`s with kind, phase, seconds, flops, bytes, sim_s) fitted to `base`'s roofline:
    each row's reached efficiencies, and `base` with the one `efficiency` at which the roofline's time of all
    rows, max(FLOPs / (peak x efficiency), bytes / bandwidth) row by row, equals their measured time (bisection:
    that time falls as the efficiency rises; clamped to EFFICIENCY_RANGE). Rows without FLOPs and bytes (`other`)
    are left out of both."""
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
