"""Memory reports: where the bytes go at the peak, the timeline over route steps, and a Perfetto trace.

Everything here reads a `Plan` (and, for traces, the executor's timed events); nothing measures memory on its
own, because the plan's numbers are exact.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..route import Phase
from ..tensors import Role
from .plan import EventKind, Plan
from .pool import align_up, format_bytes


@dataclass(slots=True)
class MemoryReport:
    policy: str
    peak_bytes: int
    min_budget_bytes: int
    lower_bound_bytes: int
    arena_bytes: int
    peak_at: str       # the step at which the most bytes are in use
    binding_step: str  # the step whose allocation needs the most arena
    by_role: dict[str, int]
    largest_at_peak: list[tuple[str, str, int]] = field(default_factory=list)  # (tensor, role, bytes)
    fragmentation: float = 0.0
    offloaded_bytes: int = 0   # per training step, to the host store
    prefetched_bytes: int = 0  # per training step, back from it

    def to_json(self) -> dict:
        return {
            "policy": self.policy, "peak_bytes": self.peak_bytes, "min_budget_bytes": self.min_budget_bytes,
            "lower_bound_bytes": self.lower_bound_bytes, "arena_bytes": self.arena_bytes,
            "peak_at": self.peak_at, "binding_step": self.binding_step, "by_role": self.by_role,
            "largest_at_peak": [{"tensor": t, "role": r, "bytes": b} for t, r, b in self.largest_at_peak],
            "fragmentation": self.fragmentation,
            "offloaded_bytes": self.offloaded_bytes, "prefetched_bytes": self.prefetched_bytes,
        }

    def format(self) -> str:
        lines = [
            f"memory report (policy '{self.policy}')",
            f"  peak in use      {format_bytes(self.peak_bytes):>12}  ({self.peak_bytes:,} B) at {self.peak_at}",
            f"  smallest budget  {format_bytes(self.min_budget_bytes):>12}  ({self.min_budget_bytes:,} B), bound at "
            f"{self.binding_step}; fragmentation {self.fragmentation:.1%}",
            f"  lower bound      {format_bytes(self.lower_bound_bytes):>12}  (params + grads + optimizer state + "
            f"largest layer's working set)",
        ]
        if self.offloaded_bytes or self.prefetched_bytes:
            lines.append(f"  host transfers   {format_bytes(self.offloaded_bytes):>12} offloaded, "
                         f"{format_bytes(self.prefetched_bytes)} prefetched per step")
        lines.append("  at the peak, by role:")
        for role, b in sorted(self.by_role.items(), key=lambda kv: -kv[1]):
            if b:
                lines.append(f"    {role:<11} {format_bytes(b):>12}  {b / max(1, self.peak_bytes):6.1%}")
        if self.largest_at_peak:
            lines.append("  largest tensors live at the peak:")
            for t, r, b in self.largest_at_peak:
                lines.append(f"    {format_bytes(b):>12}  {r:<10} {t}")
        return "\n".join(lines)


def memory_report(plan: Plan, top: int = 8) -> MemoryReport:
    largest = [(t, plan.role_of(t).value, plan.sizes.get(t, 0)) for t in plan.peak_live[:top]]
    return MemoryReport(plan.policy, plan.peak_bytes, plan.min_budget_bytes, plan.lower_bound_bytes,
                        plan.arena_bytes, plan.peak_label, plan.binding_label, plan.by_role_at_peak(), largest, plan.fragmentation,
                        plan.offloaded_bytes, plan.prefetched_bytes)


def role_timeline(plan: Plan) -> tuple[list[str], dict[str, list[int]]]:
    """Bytes resident per role while each step computes (what the timeline plot stacks)."""
    labels = [s.label for s in plan.route.steps]
    series = {r.value: [0] * len(labels) for r in Role}
    cur = {r.value: 0 for r in Role}
    resident: dict[str, int] = {}

    def apply(ev):
        role = plan.role_of(ev.tensor).value
        if ev.kind in (EventKind.ALLOC, EventKind.PREFETCH, EventKind.RECOMPUTE):
            resident[ev.tensor] = ev.nbytes
            cur[role] += align_up(ev.nbytes)
        elif ev.kind in (EventKind.FREE, EventKind.RELEASE):
            cur[role] -= align_up(resident.pop(ev.tensor, ev.nbytes))

    for ev in plan.setup:
        apply(ev)
    for k, sp in enumerate(plan.steps):
        for ev in sp.before:
            apply(ev)
        for role, b in cur.items():
            series[role][k] = b
        for ev in sp.after:
            apply(ev)
    return labels, series


def plot_timeline(plan: Plan, path: str | Path, title: str | None = None) -> Path:
    """A PNG of resident bytes over route steps, stacked by role, with the peak marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, series = role_timeline(plan)
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(11, 4.5), dpi=110)
    order = [r for r in series if any(series[r])]
    ax.stackplot(xs, [[b / 2**20 for b in series[r]] for r in order], labels=order, alpha=0.85)
    k = plan.binding_step if plan.steps else 0
    peak_k = plan.peak_step
    ax.axvline(peak_k, color="k", lw=0.8, ls="--")
    ax.annotate(f"peak {format_bytes(plan.peak_bytes)}\n{labels[peak_k] if labels else ''}",
                (peak_k, plan.peak_bytes / 2**20), textcoords="offset points", xytext=(8, -20), fontsize=8)
    n_fwd = sum(1 for s in plan.route.steps if s.phase is Phase.FORWARD)
    ax.axvspan(0, n_fwd - 0.5, color="0.93", zorder=-1)
    ax.set_xlabel(f"route step (shaded: forward; then backward and update); budget binds at step {k}")
    ax.set_ylabel("MiB resident")
    ax.set_title(title or f"memory timeline, policy '{plan.policy}'")
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.set_xlim(0, max(1, len(labels) - 1))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_trace(path: str | Path, plan: Plan, events=None) -> Path:
    """A Chrome/Perfetto trace: compute (and transfer) tracks from timed events, and a memory counter track.

    Without timed events (plan only), steps are laid out one microsecond apart so the memory track still
    reads as a function of the route.
    """
    trace = []
    if events:
        for e in events:
            trace.append({"name": e.name, "ph": "X", "ts": e.start_s * 1e6, "dur": max(e.dur_s * 1e6, 0.01),
                          "pid": 1, "tid": 1 if e.track == "compute" else 2, "args": {"step": e.step}})
            if e.track == "compute":  # transfer events (tid 2) carry no pool reading
                trace.append({"name": "pool in use", "ph": "C", "ts": e.start_s * 1e6, "pid": 1,
                              "args": {"bytes": e.in_use}})
    else:
        copying: dict[str, float] = {}  # transfer track: from OFFLOAD/PREFETCH to the RELEASE/WAIT that ends it
        for k, (step, sp) in enumerate(zip(plan.route.steps, plan.steps)):
            trace.append({"name": step.label, "ph": "X", "ts": float(k), "dur": 1.0, "pid": 1, "tid": 1})
            trace.append({"name": "pool in use", "ph": "C", "ts": float(k), "pid": 1, "args": {"bytes": sp.in_use}})
            for ev, ts in [(ev, float(k)) for ev in sp.before] + [(ev, k + 1.0) for ev in sp.after]:
                if ev.kind in (EventKind.OFFLOAD, EventKind.PREFETCH):
                    copying[ev.tensor] = ts
                elif ev.kind in (EventKind.RELEASE, EventKind.WAIT) and ev.tensor in copying:
                    t0 = copying.pop(ev.tensor)
                    name = ("offload " if ev.kind is EventKind.RELEASE else "prefetch ") + ev.tensor
                    trace.append({"name": name, "ph": "X", "ts": t0, "dur": max(ts - t0, 0.01), "pid": 1, "tid": 2,
                                  "args": {"bytes": plan.sizes.get(ev.tensor, ev.nbytes)}})
    meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "transfer"}},
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"minidl ({plan.policy})"}}]
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": meta + trace, "displayTimeUnit": "ms"}))
    return path


def explain(plan: Plan, max_steps: int | None = None) -> str:
    """Step by step, in words: what is allocated, freed and why."""
    route = plan.route
    from .liveness import analyze

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
                     + (f" (refused for lack of memory: {'; '.join(sp.refused)})" if sp.refused else ""))
        for ev in sp.before:  # a recomputation sequence may free a transient input before the step: "-"
            lines.append(f"    {'-' if ev.kind in (EventKind.FREE, EventKind.RELEASE) else '+'} {ev.kind.value:<9} {ev.tensor:<40} {format_bytes(ev.nbytes):>11} @{ev.offset}  "
                         f"{_why_alloc(ev, route, iv)}")
        for ev in sp.after:
            lines.append(f"    - {ev.kind.value:<9} {ev.tensor:<40} {format_bytes(ev.nbytes):>11}  "
                         f"{_why_free(ev, route, iv)}")
    from .auto import decision_lines

    lines += decision_lines(plan)  # per tensor: kept / offloaded / recomputed, and why; per conv: its algorithm
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
