"""Liveness (SuperNeurons): the first and last route step that touches each tensor, from the layers' declared
backward needs (an undeclared need frees a tensor early: the executor's debug mode reports it)."""
from __future__ import annotations

from dataclasses import dataclass

from ..graph.route import Route


@dataclass(slots=True)
class Interval:
    """The steps [first, last] a tensor must be resident (absent offload)."""

    tensor: str
    first: int
    last: int
    uses: tuple[int, ...]  # every step that touches it, in order


def tensor_uses(route: Route) -> dict[str, list[int]]:
    """The steps that touch each non-persistent tensor (memoized: do not modify)."""
    if "uses" in route.memo:
        return route.memo["uses"]
    uses: dict[str, list[int]] = {}

    def touch(tid: str, k: int) -> None:
        lst = uses.setdefault(tid, [])
        if not lst or lst[-1] != k:
            lst.append(k)

    for t in route.tensors.values():
        if t.role.name in ("DATA", "LABEL"):
            touch(t.id, 0)  # the batch is loaded before the first step
    for step in route.steps:
        for tid in step.reads:
            touch(tid, step.index)
        for tid in step.writes:
            touch(tid, step.index)
        for acc in step.accumulate:
            touch(acc.into, step.index)
        if step.workspace:
            touch(step.workspace, step.index)
    out = {tid: lst for tid, lst in uses.items() if not route.tensors[tid].role.persistent}
    route.memo["uses"] = out
    return out


def analyze(route: Route) -> dict[str, Interval]:
    """The live interval of every non-persistent tensor (memoized: do not modify)."""
    if "intervals" not in route.memo:
        route.memo["intervals"] = {tid: Interval(tid, lst[0], lst[-1], tuple(lst))
                                   for tid, lst in tensor_uses(route).items()}
    return route.memo["intervals"]
