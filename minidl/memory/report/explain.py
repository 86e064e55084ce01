"""`--explain`: a plan in words. Step by step what is allocated and freed and why; then, per tensor, whether it
is kept, offloaded or recomputed and why; then, per convolution, the algorithm it runs and the faster ones the
budget refused.

The decisions are read back from the plan's events, never from the policy that made them, so the explanation
holds for every policy, including ones added later.
"""
from __future__ import annotations

from ...tensors import Role
from ..decisions.weights import weights_lines
from ..liveness import analyze
from ..plan import EventKind, Plan
from ..pool import align_up, format_bytes


def explain(plan: Plan, max_steps: int | None = None) -> str:
    """Step by step, in words: what is allocated, freed and why."""
    route = plan.route
    iv = analyze(route)
    lines = [f"plan '{plan.policy}': {len(route.steps)} steps, arena {format_bytes(plan.arena_bytes)}",
             f"setup: {len(plan.setup)} tensors allocated once "
             f"({format_bytes(sum(align_up(e.nbytes) for e in plan.setup))})"
             + (": parameters, buffers and optimizer state live for the whole run" if plan.policy != "none"
                else ": under policy 'none' every tensor is allocated here and never freed")]
    for k, (step, sp) in enumerate(zip(route.steps, plan.steps)):
        if max_steps is not None and k >= max_steps:
            lines.append(f"... ({len(route.steps) - k} more steps)")
            break
        lines.append(f"step {k:>4} {step.label}   [in use {format_bytes(sp.in_use)}]"
                     + (f"  algo {sp.algo}" if sp.algo else "")
                     + (f" (refused for lack of memory: {'; '.join(sp.refused)})" if sp.refused else "")
                     + ("  [runs on the host's copies: host update]" if sp.on_host else ""))
        if sp.note:
            lines.append(f"    = {sp.note}")
        for ev in sp.before:  # a recomputation sequence may free a transient input before the step: "-"
            lines.append(f"    {'-' if ev.kind in (EventKind.FREE, EventKind.RELEASE) else '+'} {ev.kind.value:<9} "
                         f"{ev.tensor:<40} {format_bytes(ev.nbytes):>11} @{ev.offset}  "
                         f"{_why_alloc(ev, route, iv)}")
        for ev in sp.after:  # "*": starts a collective (data parallel), frees nothing
            mark = "*" if ev.kind is EventKind.ALLREDUCE else "-"
            lines.append(f"    {mark} {ev.kind.value:<9} {ev.tensor:<40} {format_bytes(ev.nbytes):>11}  "
                         f"{_why_free(ev, route, iv)}")
    lines += decision_lines(plan)  # per tensor: kept / offloaded / recomputed, and why; per conv: its algorithm
    lines += weights_lines(plan)   # parameters and optimizer state homed on the host; bytes moved by role
    return "\n".join(lines)


def _why_alloc(ev, route, iv) -> str:
    if ev.reason and ev.reason not in ("first use",):
        return ev.reason
    spec = route.tensors.get(ev.tensor)
    role = spec.role.value if spec else "workspace"
    i = iv.get(ev.tensor)
    last = route.steps[i.last].label if i else "?"
    return f"{role}, first used here; it will live until '{last}'"


def _why_free(ev, route, iv) -> str:
    if ev.reason and ev.reason != "last use":
        return ev.reason
    i = iv.get(ev.tensor)
    if i is None:
        return ""
    return "no later step reads it (last use here)"


def tensor_decisions(plan: Plan) -> list[tuple[str, str, str]]:
    """(tensor, decision, why) for every activation and data tensor, in forward order.

    The decision is read back from the plan's events, so it holds for any policy: "recomputed" (a RECOMPUTE
    event rebuilds it in backward), "offloaded" (an OFFLOAD event moves it to the host), "kept" (resident from
    forward into backward), or "freed in forward" (no backward step reads it: liveness frees it early).
    """

    route = plan.route
    iv = analyze(route)
    n_fwd = sum(1 for s in route.steps if s.phase.value == "forward")
    events: dict[str, list] = {}
    for k, sp in enumerate(plan.steps):
        for ev in sp.before + sp.after:
            events.setdefault(ev.tensor, []).append((k, ev))
    readers: dict[str, list[int]] = {}
    for tid, i in iv.items():
        readers[tid] = [u for u in i.uses if u >= n_fwd]
    out = []
    for tid in sorted((t for t, s in route.tensors.items() if s.role in (Role.ACTIVATION, Role.DATA) and t in iv),
                      key=lambda t: (iv[t].first, t)):
        evs = events.get(tid, [])
        rec = [(k, ev) for k, ev in evs if ev.kind is EventKind.RECOMPUTE]
        off = [(k, ev) for k, ev in evs if ev.kind is EventKind.OFFLOAD]
        bwd = readers.get(tid, [])
        if rec:
            dropped = next((ev.reason for k, ev in evs if ev.kind is EventKind.FREE and k < n_fwd), "")
            if not bwd:
                dropped = "backward never reads it: freed after forward"
            steps = ", ".join(route.steps[k].label for k, _ in rec[:4]) + (" ..." if len(rec) > 4 else "")
            out.append((tid, "recomputed", f"{dropped}; rebuilt {len(rec)}x in backward (before {steps}): "
                                           f"{rec[0][1].reason}"))
        elif off:
            out.append((tid, "offloaded", off[0][1].reason))
        elif bwd or any(ev.kind is EventKind.FREE and k >= n_fwd for k, ev in evs):
            ext = next((ev.reason for k, ev in evs if ev.kind is EventKind.FREE and "checkpoint" in ev.reason), "")
            why = (f"backward reads it at '{route.steps[bwd[0]].label}'" if bwd else "")
            if ext:
                why = (why + "; " if why else "") + ext
            if plan.policy == "none":
                why = "policy none keeps every tensor for the whole step"
            out.append((tid, "kept", why or "resident into backward"))
        else:
            out.append((tid, "freed in forward", "no backward step reads it; freed after its last forward use"))
    return out


def decision_lines(plan: Plan) -> list[str]:
    """The per-tensor decisions and the per-convolution algorithms, as report lines (used by `explain`)."""
    lines = ["per tensor: why each activation is kept, offloaded or recomputed"]
    counts: dict[str, int] = {}
    for tid, what, why in tensor_decisions(plan):
        counts[what] = counts.get(what, 0) + 1
        lines.append(f"    {what:<16} {tid:<40} {why}")
    lines.append("    totals: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    algos = [(k, sp) for k, sp in enumerate(plan.steps) if sp.algo]
    if algos:
        lines.append("per convolution step: the algorithm it runs, and faster ones refused for lack of memory")
        for k, sp in algos:
            refused = f"  refused: {'; '.join(sp.refused)}" if sp.refused else ""
            lines.append(f"    step {k:>4} {plan.route.steps[k].label:<36} {sp.algo:<16} workspace "
                         f"{format_bytes(sp.workspace_bytes):>11}{refused}")
    return lines
