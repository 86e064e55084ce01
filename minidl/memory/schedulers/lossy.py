"""`auto --lossy`: policy `auto`, allowed to weigh compression of stored activations against its exact plans.

Compression is never chosen silently: only the `auto-lossy` policy (`--policy auto --lossy` on the command line)
looks at it. It is `auto`'s own search (liveness, recomputation, offload, workspace sizing, weights on the host,
the other exact policies, micro-batches) with `compress` planned on each route that search plans, the batch whole
or cut into micro-batches: on the liveness base and on the memory-centric recomputation base (and, where neither
fits, on liveness with the weights on the host). It keeps the fastest plan that fits the budget, by estimated step
time:

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

from typing import Sequence

from ...core.tensors import compressed_source
from ...graph.route import Route
from ..decisions.compress import compress_schedule, find_candidates, stream_candidates
from ..decisions.recompute import MEMORY, recompute_schedule
from ..decisions.weights import layer_candidates, weights_schedule
from ..liveness import analyze
from ..plan import EventKind, Plan
from ..planner import Schedule, liveness_schedule, place
from ..pool import format_bytes
from ..simulate import get_profile, simulate
from ..workspace import CostTable, workspace_choices
from .auto import Candidate, OffloadSearch, Rival, plan_auto

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
    compressed streams (compressed *and* offloaded: fewer bytes on the link than the tensors). Where none of these
    fits, compression on liveness with every layer's weights and optimizer state on the host (a fused training
    route that may home them). `auto --lossy` calls it on each route it searches, micro-batched ones included."""
    ws = workspace_choices(route, costs)
    live = liveness_schedule(route, ws)
    bases = [("liveness", live, {})]
    rs = recompute_schedule(route, ws, mode=MEMORY, iv=analyze(route))
    if rs.segments:
        bases.append(("recompute (memory-centric)", rs.schedule,
                      {s.root: s.root_reads[0] for s in rs.segments if s.root_reads}))
    out = [c for name, base, reads in bases for c in _compressed(route, name, base, reads, ws, budget, device)]
    layers = layer_candidates(route)
    if (budget is not None and not any(c.fits for c in out) and layers and route.training and route.fused_update
            and route.options.host_weights):
        homed = weights_schedule(route, live, layers, host_update=True)
        out += _compressed(route, f"liveness + weights on host ({len(layers)} of {len(layers)} layers)", homed, {},
                           ws, budget, device)
    return out


def _compressed(route: Route, name: str, base: Schedule, reads: dict[str, int], ws, budget: int | None,
                device) -> list[Candidate]:
    """`base` with every tensor the bound allows compressed; where that misses the budget, offload on top."""
    chosen = find_candidates(route, base, exclude=reads)
    codec_s = sum(c.nbytes for c in chosen) * codec_s_per_byte(device)
    sched = compress_schedule(base, chosen, offloadable=True)
    plan = place(route, ws, sched, budget, policy="auto-lossy")
    out = [_timed(Candidate(name, ("compress",), plan=plan, lossy=True, note=(
        f"{len(chosen)} tensors compressed, codec est {codec_s:.3g} s")), budget, device, codec_s)]
    if budget is None or out[-1].fits or not chosen:
        return out
    search = OffloadSearch(route, sched, ws, budget, device, reads,
                           streams=lambda clock: stream_candidates(route, sched, chosen, clock))
    cr = search.place_fitted() or search.place_tight()
    streams = sum(1 for ev in _offloads(cr.plan) if compressed_source(ev.tensor) is not None)
    moved = cr.plan.offloaded_bytes + cr.plan.prefetched_bytes
    out.append(_timed(Candidate(name, ("compress", "offload"), plan=cr.plan, lossy=True, note=(
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


def plan_auto_lossy(route: Route, budget: int | None, device: str = "cpu", costs: CostTable | None = None,
                    rivals: Sequence[Rival] = ()) -> Plan:
    """`auto`'s search (`plan_auto`) with the compressed plans (`compress_trials`) among its candidates on every
    route it searches, the batch whole or cut into micro-batches: the fastest plan that fits `budget`, an exact one
    where a compressed one is not strictly faster (`auto.rank`)."""
    return plan_auto(route, budget, device, costs, policy="auto-lossy", rivals=rivals,
                     more=lambda r: compress_trials(r, budget, device, costs))


def auto_lossy_policy(route: Route, budget: int | None, device: str, costs: CostTable | None = None,
                      rivals: Sequence[Rival] = ()) -> Plan:
    return plan_auto_lossy(route, budget, device or "cpu", costs, rivals)
