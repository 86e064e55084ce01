"""How a plan is made beyond its policy and budget (`PlanOptions`): a value made once by
`PlanRequest.from_options` and carried unchanged to the planner and every route it builds.
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
    """`fused_update` None: the policy decides. `micro_batches` None: packs chooses. `max_micro_batches`: the
    most `auto` may cut the batch into. `paged_chunk`: bytes per chunk (None: contiguous arena)."""

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
    """`math`, or an OptionError naming the modes."""
    if math not in MATH_MODES:
        raise OptionError(f"--math must be one of {', '.join(MATH_MODES)}, got {math!r}")
    return math
