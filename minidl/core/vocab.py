"""Records several floors speak, on the lowest floor so that no floor imports a higher one."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class WorkspaceOption:
    """One algorithm for a layer's phase: its scratch and estimated cost."""

    algo: str
    workspace_bytes: int
    est_cost: float = 0.0  # relative cost (seconds once measured); lower is faster


@dataclass(slots=True)
class TraceEvent:
    """One timed event of a run, for the Perfetto trace and the memory timeline."""

    name: str
    track: str        # "compute", "transfer" or "allreduce"
    start_s: float
    dur_s: float
    step: int
    in_use: int
