"""`auto --lossy`: policy `auto`, allowed to weigh compression of stored activations against its exact plans.

Compression is never chosen silently: only the `auto-lossy` policy (`--policy auto --lossy` on the command line)
looks at it. It runs `auto`'s own search (liveness, recomputation, offload, workspace sizing, weights on the
host), then plans `compress` on the liveness base and on the memory-centric recomputation base, and keeps the
fastest plan that fits the budget, by estimated step time:

- an exact plan: the simulator's estimate (compute, recomputation, exposed copies), as `auto` ranks them;
- a compress plan: the simulator's estimate of its steps, plus the codec's time, which the simulator does not
  model: raw bytes compressed x `codec_s_per_byte(device)` (encode + decode, measured on the CPU codec).

Where compression alone does not fit, the tensor cache runs on top of the compressed plan, its candidates
including the compressed streams (`decisions.compress.stream_candidates`): compressed *and* offloaded, the link
moves the reserved stream instead of the tensor. So compression wins where it saves a transfer or a recomputation
that costs more than encoding and decoding the same bytes, or where no exact plan fits at all. Reserved
stream sizes come from `decisions.compress` (`DEFAULT_RATIO` with its margin; a stream that comes out larger
spills to the host, never over the budget).
"""
from __future__ import annotations

import math

from ...core.errors import BudgetError
from ...core.tensors import compressed_source
from ...graph.route import Route
from ..decisions.compress import compress_schedule, find_candidates, stream_candidates
from ..decisions.recompute import MEMORY, recompute_schedule
from ..liveness import analyze
from ..plan import EventKind, Plan
from ..planner import finalize, liveness_schedule, place
from ..pool import format_bytes
from ..simulate import get_profile, simulate
from ..workspace import CostTable, workspace_choices
from .auto import Candidate, OffloadSearch, auto_search, micro_batch_search, micro_decision

CPU_CODEC_S_PER_BYTE = 1 / 43e6 + 1 / 52e6
"""Encode + decode time per raw byte of the numpy codec (ReLU maps, bound 1e-2; 43 MB/s and 52 MB/s measured on
the shared 2-core development machine, 2026-11-23)."""

GPU_CODEC_PASSES = 16
"""On a GPU profile the codec is assumed to stream its data this many times through device memory (quantize,
encode, compact; decode, scatter: reads and writes): an estimate until kernels/compress.cu is timed on a GPU."""


def codec_s_per_byte(device) -> float:
    dev = get_profile(device) if isinstance(device, str) else device
    return CPU_CODEC_S_PER_BYTE if dev.name == "cpu" else GPU_CODEC_PASSES / dev.mem_bw


def compress_trials(route: Route, budget: int | None, device, costs: CostTable | None = None) -> list[Candidate]:
    """Compression on the liveness base and on the memory-centric recomputation base; under a budget that a base
    with compression alone does not fit, the same with the tensor cache on top, whose candidates include the
    compressed streams (compressed *and* offloaded: fewer bytes on the link than the tensors)."""
    ws = workspace_choices(route, costs)
    bases = [("liveness", liveness_schedule(route, ws), {})]
    rs = recompute_schedule(route, ws, mode=MEMORY, iv=analyze(route))
    if rs.segments:
        bases.append(("recompute (memory-centric)", rs.schedule,
                      {s.root: s.root_reads[0] for s in rs.segments if s.root_reads}))
    per_byte = codec_s_per_byte(device)
    out = []
    for name, base, reads in bases:
        chosen = find_candidates(route, base, exclude=reads)
        codec_s = sum(c.nbytes for c in chosen) * per_byte
        sched = compress_schedule(base, chosen, offloadable=True)
        plan = place(route, ws, sched, budget, policy="auto-lossy")
        out.append(_timed(Candidate(name, ("compress",), plan=plan, note=(
            f"{len(chosen)} tensors compressed, codec est {codec_s:.3g} s")), budget, device, codec_s))
        if budget is None or out[-1].fits or not chosen:
            continue
        search = OffloadSearch(route, sched, ws, budget, device, reads,
                               streams=lambda clock, sched=sched, chosen=chosen: stream_candidates(
                                   route, sched, chosen, clock))
        cr = search.place_fitted() or search.place_tight()
        streams = sum(1 for ev in _offloads(cr.plan) if compressed_source(ev.tensor) is not None)
        moved = cr.plan.offloaded_bytes + cr.plan.prefetched_bytes
        out.append(_timed(Candidate(name, ("compress", "offload"), plan=cr.plan, note=(
            f"{len(chosen)} tensors compressed, {streams} of them and {cr.offloaded - streams} exact tensors "
            f"offloaded: {format_bytes(moved)} on the link, codec est {codec_s:.3g} s")), budget, device, codec_s))
    return out


def _timed(c: Candidate, budget: int | None, device, codec_s: float) -> Candidate:
    """`c` with whether it fits and, if so, its estimated time: the simulator's plus the codec's."""
    c.fits = budget is None or c.plan.min_budget_bytes <= budget
    if c.fits:
        c.est_step_time_s = simulate(c.plan, device).est_step_time_s + codec_s
    return c


def _offloads(plan: Plan):
    return [ev for sp in plan.steps for ev in sp.before + sp.after if ev.kind is EventKind.OFFLOAD]


def plan_auto_lossy(route: Route, budget: int | None, device: str = "cpu", costs: CostTable | None = None) -> Plan:
    """The fastest plan that fits `budget` among `auto`'s exact ones and the compress plans; where none fits one
    batch, `auto`'s micro-batched plan (exact: compression is not tried on micro-batched routes)."""
    res = auto_search(route, budget, device, costs)
    trials = [t for t in res.trials if t.fits] + compress_trials(route, budget, device, costs)
    fitting = [t for t in trials if t.fits]
    if budget is None:
        fitting = [t for t in fitting if t.plan is res.plan]    # without a budget nothing needs compressing
    if not fitting:
        cands = [t for t in trials if t.plan is not None] + ([res.frugal] if res.frugal else [])
        best = min(cands, key=lambda t: t.min_budget_bytes)
        micro = micro_batch_search(route, budget, device, costs)
        if micro.plan is not None:
            micro.plan.decision = micro_decision(micro, budget, best.min_budget_bytes)
            return finalize(micro.plan, budget, policy="auto-lossy")
        raise BudgetError(
            f"budget {format_bytes(budget)} ({budget:,} B) is too small for policy 'auto-lossy': the smallest "
            f"budget that works is {format_bytes(best.min_budget_bytes)} ({best.min_budget_bytes:,} B), with "
            f"{best.name}", best.min_budget_bytes, best.plan.binding_label)
    # the exact plan auto itself returns first: a compress plan must be strictly faster to replace it
    best = min(fitting, key=lambda t: (t.est_step_time_s if math.isfinite(t.est_step_time_s) else math.inf,
                                       t.plan is not res.plan, t.min_budget_bytes))
    exact = min((t.est_step_time_s for t in fitting if "compress" not in t.decisions), default=math.inf)
    best.plan.decision = f"{best.name}: the fastest of {len(fitting)} candidates that fit" + (
        "" if "compress" not in best.decisions else
        f" (est {best.est_step_time_s * 1e3:.3g} ms with the codec; the fastest exact plan "
        + (f"{exact * 1e3:.3g} ms)" if math.isfinite(exact) else "does not fit)"))
    return finalize(best.plan, budget, policy="auto-lossy")


def auto_lossy_policy(route: Route, budget: int | None, device: str, costs: CostTable | None = None) -> Plan:
    return plan_auto_lossy(route, budget, device or "cpu", costs)
