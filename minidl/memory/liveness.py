"""Liveness analysis: for every tensor, the first and the last route step that touches it.

This is the whole of SuperNeurons' first idea. A training step's tensors are born and die at predictable
steps: an activation is born at its layer's forward and must survive until the last backward step that declared
it needs it; a delta is born at the first backward contribution and dies at its producer's backward; a
workspace lives inside one step. Allocating each tensor just before its first use and freeing it right after
its last turns "the sum of every tensor" into "the tensors alive at the busiest step".

Nothing here runs a kernel: the analysis reads only the route's per-step read/write lists, which come from each
layer's declared backward needs. A tensor whose need is not declared would be freed too early; the executor's
debug mode catches that as a residency error.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..graph.route import Route


@dataclass(slots=True)
class Interval:
    """The closed range of steps [first, last] during which a tensor must be resident (absent offload)."""

    tensor: str
    first: int
    last: int
    uses: tuple[int, ...]  # every step that reads or writes it, in order


def tensor_uses(route: Route) -> dict[str, list[int]]:
    """Every step index at which each non-persistent tensor is read or written (computed once per route:
    callers must not modify the lists)."""
    if "uses" in route.memo:
        return route.memo["uses"]
    uses: dict[str, list[int]] = {}

    def touch(tid: str, k: int) -> None:
        lst = uses.setdefault(tid, [])
        if not lst or lst[-1] != k:
            lst.append(k)

    for t in route.tensors.values():
        if t.role.name in ("DATA", "LABEL"):
            touch(t.id, 0)  # the executor loads the batch just before the first step
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
    """The live interval of every non-persistent tensor of the route (computed once per route: callers must not
    modify the result)."""
    if "intervals" not in route.memo:
        route.memo["intervals"] = {tid: Interval(tid, lst[0], lst[-1], tuple(lst))
                                   for tid, lst in tensor_uses(route).items()}
    return route.memo["intervals"]
