"""The memory report, read from a `Plan` only (its figures are exact): where the bytes go at the peak, by role,
and what bound the budget."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..plan import Plan
from ..pool import format_bytes


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
                        plan.arena_bytes, plan.peak_label, plan.binding_label, plan.by_role_at_peak(), largest,
                        plan.fragmentation,
                        plan.offloaded_bytes, plan.prefetched_bytes)
