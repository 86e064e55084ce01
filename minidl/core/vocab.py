"""Small records that several floors speak, kept on the lowest floor so that no floor imports a higher one.

A backend offers `WorkspaceOption`s (its convolution algorithms), layers declare them, the planner chooses among
them; the executor and the host store both append `TraceEvent`s to a run's trace. Defining them here, beneath
all of those modules, is what keeps the import graph free of circles (checked by import-linter, see
docs/architecture.md).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class WorkspaceOption:
    """One algorithm a layer can run a phase with: how much scratch it needs and what it is estimated to cost."""

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
