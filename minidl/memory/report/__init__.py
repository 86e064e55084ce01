"""A plan or a run for a person to read: `summary` by role, `timeline` (and its PNG), the Perfetto `trace`,
`explain` in words. Nothing here changes a plan."""
from .explain import decision_lines, explain, tensor_decisions
from .summary import MemoryReport, memory_report
from .timeline import plot_timeline, role_timeline
from .trace import write_trace

__all__ = ["MemoryReport", "decision_lines", "explain", "memory_report", "plot_timeline", "role_timeline",
           "tensor_decisions", "write_trace"]
