"""`auto --lossy`: policy `auto`, allowed to weigh compression of stored activations against its exact plans.

Compression is never chosen silently: only the `auto-lossy` policy (`--policy auto --lossy` on the command line)
looks at it. It runs `auto`'s own search (liveness, recomputation, offload, workspace sizing, weights on the
host), then plans `compress` on the liveness base and on the memory-centric recomputation base, and keeps the
fastest plan that fits the budget, by estimated step time:

- an exact plan: the simulator's estimate (compute, recomputation, exposed copies), as `auto` ranks them;
- a compress plan: the simulator's estimate of its steps, plus the codec's time, which the simulator does not
  model: raw bytes compressed x `codec_s_per_byte(device)` (encode + decode, measured on the CPU codec).

So compression wins where it saves a transfer or a recomputation that costs more than encoding and decoding the
same bytes, or where no exact plan fits at all. Reserved stream sizes come from `decisions.compress`
(`DEFAULT_RATIO` with its margin; a stream that comes out larger spills to the host, never over the budget).
"""
from __future__ import annotations

import math

from ...core.errors import BudgetError
from ...graph.route import Route
from ..decisions.compress import compressed_tensors, plan_compress
from ..decisions.recompute import MEMORY, recompute_schedule
from ..liveness import analyze
from ..plan import Plan
from ..planner import finalize, liveness_schedule
from ..pool import format_bytes
from ..simulate import get_profile, simulate
from ..workspace import CostTable, workspace_choices
from .auto import Trial, auto_search

CPU_CODEC_S_PER_BYTE = 1 / 43e6 + 1 / 52e6
"""Encode + decode time per raw byte of the numpy codec (ReLU maps, bound 1e-2; 43 MB/s and 52 MB/s measured on
the shared 2-core development machine, 2026-11-23)."""

GPU_CODEC_PASSES = 16
"""On a GPU profile the codec is assumed to stream its data this many times through device memory (quantize,
encode, compact; decode, scatter: reads and writes): an estimate until kernels/compress.cu is timed on a GPU."""


def codec_s_per_byte(device) -> float:
    dev = get_profile(device) if isinstance(device, str) else device
    return CPU_CODEC_S_PER_BYTE if dev.name == "cpu" else GPU_CODEC_PASSES / dev.mem_bw


def compress_trials(route: Route, budget: int | None, device, costs: CostTable | None = None) -> list[Trial]:
    ws = workspace_choices(route, costs)
    bases = [("liveness", liveness_schedule(route, ws))]
    rs = recompute_schedule(route, ws, mode=MEMORY, iv=analyze(route))
    if rs.segments:
        bases.append(("recompute (memory-centric)", rs.schedule))
    per_byte = codec_s_per_byte(device)
    out = []
    for name, base in bases:
        plan = plan_compress(route, None, device, costs, workspace=ws, base=base, policy="auto-lossy")
        raw = sum(plan.sizes[t] for t in compressed_tensors(plan))
        t = Trial(f"{name} + compress", plan, budget is None or plan.min_budget_bytes <= budget,
                  plan.min_budget_bytes, note=f"{len(compressed_tensors(plan))} tensors compressed, codec est "
                                              f"{raw * per_byte:.3g} s")
        if t.fits:
            t.est_step_time_s = simulate(plan, device).est_step_time_s + raw * per_byte
        out.append(t)
    return out


def plan_auto_lossy(route: Route, budget: int | None, device: str = "cpu", costs: CostTable | None = None) -> Plan:
    """The fastest plan that fits `budget` among `auto`'s exact ones and the compress plans."""
    res = auto_search(route, budget, device, costs)
    trials = [t for t in res.trials if t.fits] + compress_trials(route, budget, device, costs)
    fitting = [t for t in trials if t.fits]
    if budget is None:
        fitting = [t for t in fitting if t.plan is res.plan]    # without a budget nothing needs compressing
    if not fitting:
        cands = [t for t in trials if t.plan is not None] + ([res.frugal] if res.frugal else [])
        best = min(cands, key=lambda t: t.min_budget_bytes)
        raise BudgetError(
            f"budget {format_bytes(budget)} ({budget:,} B) is too small for policy 'auto-lossy': the smallest "
            f"budget that works is {format_bytes(best.min_budget_bytes)} ({best.min_budget_bytes:,} B), with "
            f"{best.name}", best.min_budget_bytes, best.plan.binding_label)
    # the exact plan auto itself returns first: a compress plan must be strictly faster to replace it
    best = min(fitting, key=lambda t: (t.est_step_time_s if math.isfinite(t.est_step_time_s) else math.inf,
                                       t.plan is not res.plan, t.min_budget_bytes))
    return finalize(best.plan, budget, policy="auto-lossy")


def auto_lossy_policy(route: Route, budget: int | None, device: str, costs: CostTable | None = None) -> Plan:
    return plan_auto_lossy(route, budget, device or "cpu", costs)
