"""`--explain`: a plan in words: step by step what is allocated and freed and why; per tensor, kept,
offloaded or recomputed and why; per convolution, its algorithm and the faster ones the budget refused.
Rule: decisions are read back from the plan's events, never from the policy that made them.
"""
from __future__ import annotations

import fnmatch

from ...core.errors import OptionError
from ...core.tensors import Role, id_name
from ..decisions.weights import weights_lines
from ..liveness import analyze
from ..plan import EventKind, Plan
from ..pool import align_up, format_bytes

SUMMARY_STEPS = 600  # route steps (~300 layers) above which a summary: ResNet-2500's full text is 120,000 lines


def parse_steps(spec: str) -> tuple[int, int]:
    """`A:B` (either side may be empty) -> the half-open step range [A, B)."""
    a, sep, b = spec.partition(":")
    try:
        lo = int(a) if a.strip() else 0
        hi = int(b) if b.strip() else 1 << 62
    except ValueError:
        raise OptionError(f"--explain-steps {spec!r}: expected A:B, e.g. 100:200 (steps A to B-1)") from None
    if not sep or lo < 0 or hi <= lo:
        raise OptionError(f"--explain-steps {spec!r}: expected A:B with 0 <= A < B, e.g. 100:200")
    return lo, hi


def _matches(pattern: str, *names: str) -> bool:
    """A layer or tensor name, exactly or as a glob; a tensor id matches by its name too ('conv1' matches
    'act:conv1' and 'param:conv1.weight')."""
    for n in names:
        for cand in (n, id_name(n)):
            if cand == pattern or fnmatch.fnmatchcase(cand, pattern):
                return True
            if not any(ch in pattern for ch in "*?[") and cand.split(".")[0:len(pattern.split("."))] == \
                    pattern.split("."):
                return True
    return False


def explain(plan: Plan, max_steps: int | None = None, select: str | None = None,
            steps: tuple[int, int] | None = None, full: bool | None = None) -> str:
    """Step by step, what is allocated, freed and why; `select` (a name or glob) and `steps` [A, B) filter;
    a plan over `SUMMARY_STEPS` steps is summarized unless `full`."""
    route = plan.route
    iv = analyze(route)
    n = len(route.steps)
    lines = [f"plan '{plan.policy}': {n} steps, arena {format_bytes(plan.arena_bytes)}",
             f"setup: {len(plan.setup)} tensors allocated once "
             f"({format_bytes(sum(align_up(e.nbytes) for e in plan.setup))})"
             + (": parameters, buffers and optimizer state live for the whole run" if plan.policy != "none"
                else ": under policy 'none' every tensor is allocated here and never freed")]
    if plan.decision:
        lines.insert(1, f"chosen: {plan.decision}")
    summary = full is None and select is None and steps is None and n > SUMMARY_STEPS
    if full is False:
        summary = True
    if summary:
        keep = set(range(min(n, 12)))
        for k in (plan.binding_step, plan.peak_step):
            keep |= set(range(max(0, k - 2), min(n, k + 3)))
        shown = sorted(keep)
        lines.append(f"summary of {n} steps (the first ones, and around the binding step {plan.binding_step} and "
                     f"the peak step {plan.peak_step}); the full listing: --explain-full; one layer or tensor: "
                     f"--explain NAME (a glob works); a range: --explain-steps A:B")
    else:
        lo, hi = steps if steps is not None else (0, n)
        shown = range(lo, min(hi, n))
    prev = -1
    for k in shown:
        if max_steps is not None and k >= max_steps:
            lines.append(f"... ({n - k} more steps)")
            break
        step, sp = route.steps[k], plan.steps[k]
        evs_before = [ev for ev in sp.before if select is None or _matches(select, ev.tensor)]
        evs_after = [ev for ev in sp.after if select is None or _matches(select, ev.tensor)]
        if select is not None and not evs_before and not evs_after and not _matches(select, step.name or ""):
            continue
        if summary and prev >= 0 and k != prev + 1:
            lines.append(f"... (steps {prev + 1} to {k - 1})")
        prev = k
        mark = "  <- binding step" if k == plan.binding_step else ("  <- peak" if k == plan.peak_step else "")
        into = [a.into for a in step.accumulate if a.in_place]
        lines.append(f"step {k:>4} {step.label}   [in use {format_bytes(sp.in_use)}]"
                     + (f"  algo {sp.algo}" if sp.algo else "")
                     + (f"  (adds its input delta into {', '.join(into)} in the same call)" if into else "")
                     + (f" (refused for lack of memory: {'; '.join(sp.refused)})" if sp.refused else "")
                     + ("  [runs on the host's copies: host update]" if sp.on_host else "") + mark)
        if sp.note:
            lines.append(f"    = {sp.note}")
        for ev in evs_before:  # a recomputation sequence may free a transient input before the step: "-"
            lines.append(f"    {'-' if ev.kind.frees else '+'} {ev.kind.value:<9} "
                         f"{ev.tensor:<40} {_size(plan, ev):>11} @{ev.offset}  "
                         f"{_why_alloc(ev, route, iv)}")
        for ev in evs_after:  # "*": starts a collective (data parallel), frees nothing
            mark = "*" if ev.kind is EventKind.ALLREDUCE else "-"
            lines.append(f"    {mark} {ev.kind.value:<9} {ev.tensor:<40} {_size(plan, ev):>11}  "
                         f"{_why_free(ev, route, iv, sp)}")
    if summary and prev < n - 1:
        lines.append(f"... (steps {prev + 1} to {n - 1})")
    # per tensor: kept / offloaded / recomputed, and why; per conv: its algorithm
    lines += decision_lines(plan, select=select, totals_only=summary)
    lines += weights_lines(plan)   # parameters and optimizer state homed on the host; bytes moved by role
    return "\n".join(lines)


def _size(plan: Plan, ev) -> str:
    """The planned size; both where the pool rounds it (a 0-byte workspace takes one 512 B block)."""
    want = plan.sizes.get(ev.tensor, ev.nbytes)
    got = align_up(want)
    return format_bytes(want) if got == want else f"{format_bytes(want)} ({format_bytes(got)} block)"


def _why_alloc(ev, route, iv) -> str:
    if ev.reason and ev.reason not in ("first use",):
        return ev.reason
    spec = route.tensors.get(ev.tensor)
    role = spec.role.value if spec else "workspace"
    i = iv.get(ev.tensor)
    last = route.steps[i.last].label if i else "?"
    return f"{role}, first used here; it will live until '{last}'"


def _why_free(ev, route, iv, sp=None) -> str:
    spec = route.tensors.get(ev.tensor)
    if sp is not None and sp.algo and (spec is None or spec.role is Role.WORKSPACE) \
            and ev.reason.startswith("workspace of"):
        return f"workspace of {sp.algo}"   # the algorithm placement chose, not the one the schedule started from
    if ev.reason and ev.reason != "last use":
        return ev.reason
    i = iv.get(ev.tensor)
    if i is None:
        return ""
    return "no later step reads it (last use here)"


def tensor_decisions(plan: Plan) -> list[tuple[str, str, str]]:
    """(tensor, decision, why) for every activation and data tensor in forward order, from the
    plan's events: "recomputed", "offloaded", "kept" or "freed in forward"."""

    route = plan.route
    iv = analyze(route)
    n_fwd = route.turn  # the first backward step (a packed route's re-forwards belong to backward)
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


def decision_lines(plan: Plan, select: str | None = None, totals_only: bool = False) -> list[str]:
    """Per-tensor decisions and per-convolution algorithms as report lines; `select`: one name or
    glob; `totals_only`: counts."""
    lines = ["per tensor: why each activation is kept, offloaded or recomputed"]
    counts: dict[str, int] = {}
    for tid, what, why in tensor_decisions(plan):
        counts[what] = counts.get(what, 0) + 1
        if not totals_only and (select is None or _matches(select, tid)):
            lines.append(f"    {what:<16} {tid:<40} {why}")
    lines.append("    totals: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    algos = [(k, sp) for k, sp in enumerate(plan.steps) if sp.algo]
    if algos:
        lines.append("per convolution step: the algorithm it runs, and faster ones refused for lack of memory")
        if totals_only:
            by_algo: dict[str, int] = {}
            for _, sp in algos:
                by_algo[sp.algo] = by_algo.get(sp.algo, 0) + 1
            refused = sum(1 for _, sp in algos if sp.refused)
            lines.append("    " + ", ".join(f"{v} x {k}" for k, v in sorted(by_algo.items()))
                         + f"; {refused} steps refused a faster algorithm for lack of memory")
            return lines
        for k, sp in algos:
            if select is not None and not _matches(select, plan.route.steps[k].name or ""):
                continue
            refused = f"  refused: {'; '.join(sp.refused)}" if sp.refused else ""
            lines.append(f"    step {k:>4} {plan.route.steps[k].label:<36} {sp.algo:<16} workspace "
                         f"{format_bytes(sp.workspace_bytes):>11}{refused}")
    return lines
