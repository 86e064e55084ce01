"""Policy `packs` (Harmony): choose the micro-batch count and the layer packs, then home the weights per pack.

The route is `graph/packs.py`'s; the weights decision (`decisions/weights.py`) brings a pack's weights in once per
block and updates on the host; the activation cache offloads the stashes. This module searches what that leaves open:
- Packs: the weights move the same bytes whatever the packing; fewer packs stash fewer pack inputs but need a larger
  working set. So: the fewest packs (1, 2, 4, ..., cut to equal weight bytes by `even_packs`) that fit.
- Micro-batches (when not given): 1, 2, 4, ... dividing the batch; the count whose fitting packing moves the fewest
  bytes (ties: fewer micro-batches). Stops once only weights move.
Limitations: packs cut by weight bytes only; powers of two only.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

from ...core.errors import BudgetError
from ...graph.packs import PackError, even_packs
from ...graph.route import Phase, Route
from ..decisions.weights import moved_by_role, plan_weights, weights_floor
from ..plan import Plan
from ..pool import align_up, format_bytes
from ..workspace import workspace_choices


def _powers(limit: int) -> list[int]:
    out, k = [], 1
    while k < limit:
        out.append(k)
        k *= 2
    return out + [limit]


def step_floor(route: Route) -> int:
    """Bytes the busiest non-update step touches (smallest workspace): no plan fits below it. No placement."""
    sizes = {tid: align_up(t.nbytes) for tid, t in route.tensors.items()}
    best = 0
    for step in route.steps:
        if step.phase is Phase.UPDATE:
            continue
        touched = set(step.reads) | set(step.writes) | {a.into for a in step.accumulate}
        ws = min((o.workspace_bytes for o in step.workspace_options), default=0) if step.workspace else 0
        best = max(best, sum(sizes[t] for t in touched) + align_up(ws))
    return best


def plan_packs(route: Route, budget: int | None, device: str = "cpu", costs=None,
               micro_batches: int | None = None) -> Plan:
    """The `packs` plan; `micro_batches` None searches. A packing above its `weights_floor` is placed only when
    nothing fits, for the error's figure."""
    net = route.network
    batch = net.input_nodes[0].shape[0]
    if micro_batches is None and route.packing is not None:
        micro_batches = route.micro_batches
    most = route.options.max_micro_batches or batch
    ms = [micro_batches] if micro_batches else [m for m in _powers(batch) if batch % m == 0 and m <= most]
    failed: list[tuple[str, int | Callable[[], int]]] = []   # (where, the budget it needs, or how to find it out)
    best: tuple[int, int, Plan] | None = None    # (bytes moved, micro-batches, plan)
    for m in ms:
        try:
            floor_m = step_floor(route.with_micro_batches(m))
        except PackError:   # a layer (BN) cannot train on so small a micro-batch, nor on a smaller one
            if best is None and not failed:
                raise
            break
        if budget is not None and floor_m > budget:
            failed.append((f"{m} micro-batches (one step's own tensors)", floor_m))
            continue  # one micro-batch's step does not fit: no packing can help
        for n in _powers(len(net.layer_nodes)):
            r = route.with_micro_batches(m, even_packs(net, n))   # same menu and options (`--paged`)
            ws = workspace_choices(r, costs)
            where = f"{m} micro-batches in {n} packs"
            if budget is not None and weights_floor(r, ws) > budget:
                failed.append((where, partial(_needs, r, budget, device, ws)))   # cannot fit: not placed
                continue
            try:
                plan = plan_weights(r, budget, device, workspace=ws, policy="packs")
            except BudgetError as e:
                failed.append((where, e.min_budget_bytes))
                continue
            moved = moved_by_role(plan)
            if best is None or sum(moved.values()) < best[0]:
                best = (sum(moved.values()), m, plan)
            break  # the first packing that fits moves the fewest bytes for this M
        if best is not None and moved_by_role(best[2])["activations"] == 0:
            break  # only weights move: more micro-batches cannot move less
    if best is not None:
        return best[2]
    needs = [(need if isinstance(need, int) else need(), where) for where, need in failed]
    floor = min(needs, key=lambda e: e[0])    # the first of the smallest, in search order
    raise BudgetError(
        f"budget {format_bytes(budget)} ({budget:,} B) is too small for policy 'packs': no micro-batch count in "
        f"{ms} with any packing fits; the smallest budget found is {format_bytes(floor[0])} ({floor[0]:,} B), "
        f"with {floor[1]}", floor[0], floor[1])


def _needs(route: Route, budget: int, device: str, ws) -> int:
    """The smallest budget `plan_weights` names for a packing that does not fit `budget`."""
    try:
        plan_weights(route, budget, device, workspace=ws, policy="packs")
    except BudgetError as e:
        return e.min_budget_bytes
    raise AssertionError("a packing above its floor's budget was expected not to fit")   # pragma: no cover


def packs_policy(route: Route, budget: int | None, device: str, costs=None) -> Plan:

    return plan_packs(route, budget, device or "cpu", costs)
