"""How a plan is made beyond its policy and budget (`PlanOptions`), and the math modes it may be made in.

A value: made once where a run is described (`memory.request.PlanRequest.from_options`), carried unchanged by the
request to the planner and by every route a plan of it builds (`Route.options`). Its fields are what the command
line's --fused-update, --micro-batches, --max-micro-batches, --math, --ranks, --paged and --weights-on-device say.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import OptionError

if TYPE_CHECKING:  # pragma: no cover
    from ..memory.decisions.allreduce import DataParallel

#: The modes `--math` accepts, the default first; a mode is added here (and taught to the backends that run it,
#: and, a storage mode, to `backend.precision`).
MATH_MODES = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """`fused_update`: each layer's update right after its backward (True), one update step at the end (False),
    None: the policy decides (`PlanRequest.fused_update`). `micro_batches`: the batch cut into micro-batches
    (policy packs: layer packs, choosing the count when None; the others accumulate). `max_micro_batches`: the most
    micro-batches `auto` may cut the batch into by itself (None: any count dividing it; 1: never). `math`: the
    arithmetic the plan's kernels run in (`MATH_MODES`). `data_parallel`: one rank of several (gradient buckets
    and their all-reduce). `paged_chunk`: tensors placed by chunks of this many bytes on a paged arena (None: the
    contiguous pool). `host_weights`: a search may home weights and optimizer state on the host (auto's last
    resort)."""

    fused_update: bool | None = None
    micro_batches: int | None = None
    max_micro_batches: int | None = None
    math: str = MATH_MODES[0]
    data_parallel: DataParallel | None = None
    paged_chunk: int | None = None
    host_weights: bool = True

    def __post_init__(self) -> None:
        check_math(self.math)


def check_math(math: str) -> str:
    """`math` if it names a mode, else an OptionError naming the option and the modes."""
    if math not in MATH_MODES:
        raise OptionError(f"--math must be one of {', '.join(MATH_MODES)}, got {math!r}")
    return math
