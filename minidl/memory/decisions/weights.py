"""The weights decision: parameters and optimizer state that live on the host and visit the device.

The training state alone sets a floor no activation decision lowers (VGG-16 with SGD momentum: 1.55 GiB); Harmony
and ZeRO-Offload lift it. Weight movements are ordinary PREFETCH / WAIT / OFFLOAD / RELEASE / FREE events.

Rules the code keeps:
- A *host-homed* tensor has no block at setup: its home between steps is the host store (the executor writes
  its initial value there). Within a step it is on the device only for *visits*: runs of its uses with no gap of
  two steps or more (else bringing it back costs nothing in memory and only adds a copy). A visit starts with a
  PREFETCH `lead` steps before its first use (so the copy hides behind the previous step) and a WAIT right before
  it; it ends with FREE if the visit only read the tensor (the host copy is still exact: nothing to copy back) or
  with OFFLOAD + RELEASE if it wrote it (the update).
- In a half-precision mode the kernels read each weight's half copy (`Role.WEIGHT_COPY`), which is homed with its
  master and visits the device for the forward and backward in the master's place (half the bytes); the master
  then visits only for a device update (which rewrites the copy there), and never with a host update, which
  rewrites the copy's host value.
- Which layers: those whose outputs recomputation keeps (`layer.checkpoint`: convolutions and fully connected
  layers, which hold nearly all the weights). A recomputed layer (BN) re-runs its forward at a point of the step
  only the recomputation schedule knows, so its parameters stay resident; they are small.
- **Host update** (`host_update=True`, needs the fused-update route): the layer's update step runs on the host's
  copies. The gradient is offloaded right after the layer's backward (the only copy that goes out), the
  optimizer slots never come to the device, and the parameter's device visits are all read-only (FREE, no copy
  back). On the CPU backend the host *is* the device memory's neighbour on the same bus, so this moves the least:
  per step, weights in twice (forward, backward) and the gradient out once, against weights in twice, weights
  out once and every slot in and out once for a device update. The update runs the same kernel on the same
  values, so parameters stay bit-identical.
- **Device update** (`host_update=False`): the slots visit the device for the update step like the parameter
  does, and the parameter's last visit writes it, so it is copied back: what a GPU wants when its update is much
  faster than the host's.

Limitations: the simulator charges a host update the device's own update time (on the CPU profile that is
right; on a GPU profile the host update would be slower, and is not modelled). Buffers (BN running statistics)
always stay resident.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...core.tensors import Role, compressed_source
from ...graph.route import Phase, Route
from ..plan import EventKind, Plan
from ..planner import Marker, Residency, Schedule

_WEIGHT_ROLES = (Role.PARAMETER, Role.WEIGHT_COPY)


@dataclass(slots=True)
class Visit:
    """One stay of a host-homed tensor on the device, steps `first` to `last`."""

    first: int
    last: int
    dirty: bool  # written during the visit: copied back at its end


def layer_candidates(route: Route) -> list[str]:
    """Layers whose weights may live on the host, largest weights first."""
    net = route.network
    sizes: dict[str, int] = {}
    for t in route.tensors.values():
        if t.role is Role.PARAMETER:
            node = net.node(t.owner)
            if node.layer is not None and node.layer.checkpoint:
                sizes[t.owner] = sizes.get(t.owner, 0) + t.nbytes
    return sorted(sizes, key=lambda n: (-sizes[n], n))


def _uses(route: Route) -> dict[str, list[tuple[int, bool]]]:
    """(step, writes it) for every use of every persistent tensor, in step order; memoized on the route."""
    if "persistent_uses" not in route.memo:
        route.memo["persistent_uses"] = _persistent_uses(route)
    return route.memo["persistent_uses"]


def _persistent_uses(route: Route) -> dict[str, list[tuple[int, bool]]]:
    out: dict[str, list[tuple[int, bool]]] = {}
    for step in route.steps:
        touched = dict.fromkeys(step.reads, False)
        touched.update(dict.fromkeys(step.writes, True))
        for tid, w in touched.items():
            spec = route.tensors.get(tid)
            if spec is not None and spec.role.persistent:
                out.setdefault(tid, []).append((step.index, w))
    return out


def visits(uses: list[tuple[int, bool]], block_of: dict[int, int] | None = None) -> list[Visit]:
    """Uses grouped into visits: a gap of two steps sends the tensor home, except within one pack block (`block_of`)."""
    out: list[Visit] = []
    block_of = block_of or {}
    for k, w in uses:
        same = out and block_of.get(k, -1) >= 0 and block_of.get(k) == block_of.get(out[-1].last)
        if out and (k - out[-1].last < 2 or same):
            out[-1].last, out[-1].dirty = k, out[-1].dirty or w
        else:
            out.append(Visit(k, k, w))
    return out


def weights_schedule(route: Route, base: Schedule, layers: list[str], *, host_update: bool = True,
                     lead: int = 1) -> Schedule:
    """`base` with `layers`' parameters and optimizer slots homed; prefetches `lead` steps early (0: just in time)."""
    if host_update and not route.fused_update:
        raise ValueError("a host update needs the fused-update route (one update step per layer)")
    chosen = set(layers)
    uses = _uses(route)
    update_of = {s.name: s.index for s in route.steps if s.phase is Phase.UPDATE and s.node is not None}
    res = dict(base.residencies)
    markers = list(base.markers)
    host_steps = set(base.host_steps)
    packing = route.packing
    block_of = {k: b for b, (lo, hi) in enumerate(packing.blocks) for k in range(lo, hi + 1)} if packing else None
    for tid, spec in route.tensors.items():
        if spec.owner not in chosen or spec.role not in (*_WEIGHT_ROLES, Role.OPTIMIZER, Role.GRADIENT):
            continue
        upd = update_of.get(spec.owner)
        if host_update and upd is None:
            continue  # no trainable parameters: nothing to update
        if spec.role is Role.GRADIENT:
            if host_update and tid in route.steps[upd].reads:
                a, b = grad_span(route, tid)
                res[tid] = [Residency(a, "before", EventKind.ALLOC, b, "after", EventKind.RELEASE,
                                      f"copied out for the host update of {spec.owner}")]
                markers.append(Marker(b, "after", EventKind.OFFLOAD, tid,
                                      f"the update of {spec.owner} runs on the host"))
            continue
        own = [(k, w) for k, w in uses.get(tid, ()) if not (host_update and k == upd)]
        res[tid] = []
        prev_end = -1
        for v in visits(own, block_of):
            start = max(v.first - lead, prev_end + 1)
            what = "weights" if spec.role in _WEIGHT_ROLES else "optimizer state"
            label = route.steps[v.first].label
            end_kind = EventKind.RELEASE if v.dirty else EventKind.FREE
            res[tid].append(Residency(
                start, "before", EventKind.PREFETCH, v.last, "after", end_kind,
                f"{what} homed on the host: on the device for '{label}'"
                + (f" .. '{route.steps[v.last].label}'" if v.last != v.first else "")
                + ("; written there, so copied back" if v.dirty else "; read only, the host copy stays exact")))
            markers.append(Marker(v.first, "before", EventKind.WAIT, tid,
                                  f"{what} prefetched before step {start} must have landed"))
            if v.dirty:
                markers.append(Marker(v.last, "after", EventKind.OFFLOAD, tid, f"{what} written: copy back"))
            prev_end = v.last
        if host_update and spec.role is Role.PARAMETER:
            host_steps.add(upd)
    return Schedule(res, markers, host_steps)


def grad_span(route: Route, tid: str) -> tuple[int, int]:
    """The first and last backward step that write gradient `tid` or add a micro-batch's part into it."""
    return grad_spans(route)[tid]


def grad_spans(route: Route) -> dict[str, tuple[int, int]]:
    """`grad_span` of every gradient, in one pass over the backward steps; memoized on the route."""
    if "grad_spans" not in route.memo:
        spans: dict[str, tuple[int, int]] = {}
        for s in route.steps:
            if s.phase is not Phase.BACKWARD:
                continue
            for tid in [t for t in s.writes if route.tensors[t].role is Role.GRADIENT] + [a.into for a in s.accumulate]:
                spans[tid] = (spans[tid][0] if tid in spans else s.index, s.index)
        route.memo["grad_spans"] = spans
    return route.memo["grad_spans"]


def host_homed(plan: Plan) -> set[str]:
    """Persistent tensors the plan keeps on the host between steps (no block at setup)."""
    resident = {ev.tensor for ev in plan.setup}
    return {t.id for t in plan.route.tensors.values() if t.role.persistent and t.id not in resident}


MOVED_ROLES = {Role.PARAMETER: "weights", Role.WEIGHT_COPY: "weights", Role.OPTIMIZER: "optimizer_state",
               Role.GRADIENT: "gradients"}


def moved_by_role(plan: Plan) -> dict[str, int]:
    """Bytes copied device<->host per training step by role; compressed streams counted at their reserved bytes."""
    out = {"weights": 0, "optimizer_state": 0, "gradients": 0, "activations": 0, "compressed_activations": 0}
    for sp in plan.steps:
        for ev in sp.before + sp.after:
            if ev.kind in (EventKind.OFFLOAD, EventKind.PREFETCH):
                what = "compressed_activations" if compressed_source(ev.tensor) is not None else \
                    MOVED_ROLES.get(plan.role_of(ev.tensor), "activations")
                out[what] += ev.nbytes
    return out


def moved_words(moved: dict[str, int]) -> dict[str, int]:
    """`moved_by_role` as the text reports say it: compressed activations only where some moved."""
    return {k: v for k, v in moved.items() if v or k != "compressed_activations"}


def plan_weights(route: Route, budget: int | None, device: str = "cpu", *, workspace=None, layers=None,
                 lead: int = 1, policy: str = "weights") -> Plan:
    """Liveness with `layers` (default: all) homed and the activation cache on top; just in time if need be."""
    from ...core.errors import BudgetError
    from ..planner import default_workspace, liveness_schedule
    from .offload import plan_offload

    ws = default_workspace(route) if workspace is None else workspace
    layers = layer_candidates(route) if layers is None else layers

    def plan(lead: int) -> Plan:
        base = weights_schedule(route, liveness_schedule(route, ws), layers, host_update=route.fused_update,
                                lead=lead)
        return plan_offload(route, budget, device, base=base, workspace=ws, policy=policy)

    try:
        return plan(lead)
    except BudgetError:
        if lead == 0:
            raise
        return plan(0)


def weights_floor(route: Route, workspace) -> int:
    """A floor under every `plan_weights` arena, without placing: its most frugal schedule's busiest moment."""
    from ..planner import liveness_schedule
    from .offload import find_candidates, offload_schedule, tight_timing
    from .recompute import compute_peak_lower_bound

    base = weights_schedule(route, liveness_schedule(route, workspace), layer_candidates(route),
                            host_update=route.fused_update, lead=0)
    cands = find_candidates(route, base)
    return compute_peak_lower_bound(route, offload_schedule(route, base, cands, tight_timing(cands)), workspace)


def weights_policy(route: Route, budget: int | None, device: str, costs=None) -> Plan:
    from ..planner import default_workspace

    return plan_weights(route, budget, device or "cpu", workspace=default_workspace(route, costs))


def weights_lines(plan: Plan) -> list[str]:
    """`--explain`'s words on the weights: what is homed, its visits, the bytes moved by role."""
    from ..pool import format_bytes

    homed = host_homed(plan)
    moved = moved_by_role(plan)
    lines = ["weights and optimizer state: "
             + (f"{len(homed)} tensors homed on the host "
                f"({format_bytes(sum(plan.route.tensors[t].nbytes for t in homed))}), the rest resident"
                if homed else "all resident for the whole run")]
    visits_of: dict[str, int] = {}
    for sp in plan.steps:
        for ev in sp.before:
            if ev.kind is EventKind.PREFETCH and ev.tensor in homed:
                visits_of[ev.tensor] = visits_of.get(ev.tensor, 0) + 1
    owners: dict[str, list[str]] = {}
    for tid in sorted(homed):
        owners.setdefault(plan.route.tensors[tid].owner, []).append(tid)
    host_updates = {plan.route.steps[k].name for k, sp in enumerate(plan.steps) if sp.on_host}
    for owner, tids in owners.items():
        v = ", ".join(f"{t.split(':', 1)[1]} " + (f"x{visits_of[t]}" if visits_of.get(t) else "never")
                      for t in tids)
        lines.append(f"    {owner:<24} visits: {v}; update "
                     + ("on the host (gradient copied out)" if owner in host_updates else "on the device"))
    lines.append("    bytes moved per step: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}"
                                                         for k, v in moved_words(moved).items()))
    return lines
