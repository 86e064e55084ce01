"""Everything that turns a plan (or a run) into something a person reads: the summary by role (`summary`), the
per-step timeline and its PNG (`timeline`), the Perfetto trace (`trace`) and the explanation in words (`explain`).
Nothing here changes a plan."""
from .explain import decision_lines, explain, tensor_decisions
from .summary import MemoryReport, memory_report
from .timeline import plot_timeline, role_timeline
from .trace import write_trace

__all__ = ["MemoryReport", "decision_lines", "explain", "memory_report", "plot_timeline", "role_timeline",
           "tensor_decisions", "write_trace"]
