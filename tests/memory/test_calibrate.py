"""The measured profile (memory/calibrate.py): link figures and efficiency from measurements, the duplex link
model, and `auto` recomputing where a measured link cannot hide a copy. Measurements are given (no GPU here)."""
from __future__ import annotations

from dataclasses import replace

import pytest

import minidl as dl
from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.cuda.calibrate import LinkMeasurement
from minidl.graph.route import Phase
from minidl.memory.calibrate import calibrated_profile, fit_efficiency, measured_profile
from minidl.memory.plan import EventKind
from minidl.memory.simulate import get_profile, link_timeline, simulate
from minidl.memory.workspace import CostTable, cost_key
from minidl.models import build_model
from tests.planning import planned


def _net():
    return build_model("resnet", depth=20, batch=32, image_size=32, in_channels=3, num_classes=10)


def _opt():
    return dl.SGD(lr=0.1, momentum=0.9)


FAST = LinkMeasurement(h2d_bw=55e9, d2h_bw=54e9, duplex_h2d_bw=50e9, duplex_d2h_bw=48e9, latency_s=1e-5,
                       device="NVIDIA H100 80GB HBM3")
SLOW = LinkMeasurement(h2d_bw=0.6e9, d2h_bw=0.6e9, duplex_h2d_bw=0.5e9, duplex_d2h_bw=0.5e9, latency_s=1e-3)


def test_profile_takes_the_slower_duplex_direction_and_the_latency():
    p = calibrated_profile("h100", FAST)
    h = get_profile("h100")
    assert (p.name, p.link_bw, p.link_latency_s, p.duplex) == ("measured", 48e9, 1e-5, True)
    assert (p.flops, p.mem_bw, p.memory_bytes, p.efficiency) == (h.flops, h.mem_bw, h.memory_bytes, h.efficiency)
    assert "48.0 GB/s" in p.note and "10.0 us" in p.note and "H100" in p.note
    with pytest.raises(ValueError, match="positive bandwidths"):
        calibrated_profile("h100", replace(FAST, duplex_d2h_bw=0.0))
    with pytest.raises(ValueError, match="cannot measure a host link"):
        measured_profile(CPUBackend())


def test_efficiency_is_fitted_to_the_autotune_cache():
    route = planned(_net(), _opt(), "liveness").route
    net, peak = route.network, get_profile("h100").flops
    seconds = {}
    for step in route.steps:
        if step.workspace is None:
            continue
        node = net.nodes[step.node]
        ins, out = route.shapes_of(node.index)
        fwd = step.phase is Phase.FORWARD
        flops = node.layer.flops(ins, out) if fwd else node.layer.backward_flops(ins, out)
        key = cost_key(node.layer, "fwd" if fwd else "bwd", ins, out, net.dtype.itemsize, route.backend_name)
        # every algorithm measured; the fastest runs at 20% of peak
        seconds[key] = {"slow": 2 * flops / (0.2 * peak), "fast": flops / (0.2 * peak)}
    assert seconds
    costs = CostTable(seconds=seconds)
    assert fit_efficiency(route, costs, peak) == pytest.approx(0.2, rel=1e-9)
    assert calibrated_profile("h100", FAST, costs, route).efficiency == pytest.approx(0.2, rel=1e-9)
    assert fit_efficiency(route, CostTable(), peak) is None       # nothing measured: the datasheet's kept


def test_the_duplex_link_queues_each_direction_apart():
    net = _net()
    live = planned(net, _opt(), "liveness").min_budget_bytes
    plan = planned(_net(), _opt(), "offload", int(live * 0.8), device="h100")
    copies = [ev for sp in plan.steps for ev in (*sp.before, *sp.after)
              if ev.kind in (EventKind.OFFLOAD, EventKind.PREFETCH)]
    assert {ev.kind for ev in copies} == {EventKind.OFFLOAD, EventKind.PREFETCH}
    one = get_profile("h100")
    two = replace(one, duplex=True)
    a, b = link_timeline(plan, one), link_timeline(plan, two)
    assert a.transfer_s == pytest.approx(b.transfer_s) and b.exposed_s <= a.exposed_s
    lat = replace(two, link_latency_s=1e-3)            # each copy pays its latency
    assert link_timeline(plan, lat).transfer_s == pytest.approx(b.transfer_s + len(copies) * 1e-3)
    # the datasheet profiles keep the single FIFO model exactly
    assert simulate(plan, "h100").est_step_time_s == simulate(plan, one).est_step_time_s


def _kinds(plan):
    out = {}
    for sp in plan.steps:
        for ev in (*sp.before, *sp.after):
            out[ev.kind] = out.get(ev.kind, 0) + 1
    return out


def test_auto_recomputes_where_the_measured_link_cannot_hide_a_copy():
    """Just below the liveness minimum, where a few copies suffice: with a fast measured link `auto` offloads
    (and recomputes nothing); with a slow one, at the same budget, it recomputes instead. (The budget is searched
    near the top, since which one first needs a copy depends on the CPU's algorithm menu of the day; the batch is
    kept whole, where micro-batches would need neither.)"""
    live = planned(_net(), _opt(), "liveness").min_budget_bytes
    fast_dev, slow_dev = calibrated_profile("h100", FAST), calibrated_profile("h100", SLOW)
    for frac in (0.96, 0.94, 0.92, 0.9, 0.88):
        budget = int(live * frac)
        fast = _kinds(planned(_net(), _opt(), "auto", budget, device=fast_dev, max_micro_batches=1))
        if fast.get(EventKind.OFFLOAD, 0) and not fast.get(EventKind.RECOMPUTE, 0):
            break
    else:
        pytest.fail("no budget near the liveness minimum where auto offloads over a fast link")
    slow = _kinds(planned(_net(), _opt(), "auto", budget, device=slow_dev, max_micro_batches=1))
    assert slow.get(EventKind.OFFLOAD, 0) == 0         # a slow link cannot hide the copies: recompute instead
    assert slow.get(EventKind.RECOMPUTE, 0) > 0


def test_the_cli_measures_the_link_and_fits_efficiency_to_autotuned_convolutions():
    """`minidl train --device measured --autotune`: the link from the backend, the convolutions measured (on
    the CPU backend here, standing in for the GPU) and the efficiency fitted to them."""
    from minidl.cli.common import measured_device

    class Measured(CPUBackend):
        profile = "cpu"

        def measure_link(self):
            return FAST

    be = Measured()
    net = build_model("lenet", batch=4, image_size=8, in_channels=1, num_classes=10)
    costs = CostTable(autotune=True, backend=be, repeats=1)
    prof = measured_device(net, _opt(), be, costs)
    assert (prof.link_bw, prof.duplex, prof.link_latency_s) == (48e9, True, 1e-5)
    assert costs.measured > 0 and prof.efficiency != get_profile("cpu").efficiency
    assert measured_device(net, _opt(), be, None).efficiency == get_profile("cpu").efficiency


def test_a_measured_per_layer_profile_fits_the_rooflines_efficiency():
    from minidl.memory.calibrate import fit_profile
    from minidl.memory.simulate import get_profile

    h100 = get_profile("h100")
    # a synthetic profile measured at 30% of the peak FLOP/s: convolutions FLOP-bound, batch norm byte-bound
    rows = [{"kind": "conv", "phase": "forward", "flops": 4e12, "bytes": 2e9, "sim_s": 0.1},
            {"kind": "batchnorm", "phase": "forward", "flops": 1e9, "bytes": 6e9, "sim_s": 0.002},
            {"kind": "other", "phase": "step", "flops": 0, "bytes": 0, "seconds": 0.5, "sim_s": 0.0}]
    for r in rows[:2]:
        r["seconds"] = max(r["flops"] / (h100.flops * 0.3), r["bytes"] / h100.mem_bw)
    fits, prof = fit_profile(rows, "h100")
    assert prof.efficiency == pytest.approx(0.3, rel=1e-9) and prof.name == "h100-profiled"
    conv, bn = fits
    assert (conv.kind, conv.bound, bn.kind, bn.bound) == ("conv", "flops", "batchnorm", "bytes")
    assert conv.flops_efficiency == pytest.approx(0.3) and bn.bandwidth_efficiency == pytest.approx(1.0)
    assert conv.sim_error == pytest.approx(0.1 / conv.measured_s - 1)
    slow = [dict(rows[0], seconds=rows[0]["seconds"] * 1000)]   # slower than any efficiency in range explains
    assert fit_profile(slow, "h100")[1].efficiency == pytest.approx(0.01)
    with pytest.raises(ValueError, match="no measured row"):
        fit_profile(rows[2:], "h100")
