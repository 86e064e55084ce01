"""Policy `packs` (Harmony): choose the micro-batch count and the layer packs, then home the weights per pack.

The route of packs and micro-batches is `minidl/graph/packs.py`; the weights decision (`decisions/weights.py`) brings
a pack's weights in once per block, updates on the host, and the activation cache offloads the stashes. This
module searches the two numbers that route leaves open:

- **Pack boundaries.** On that route the weights move the same bytes whatever the packing (each pack's weights
  come in once for forward and once for backward), so what the packing changes is the *stash*: every pack
  input is kept (or offloaded) from its pack's forward to its re-forward, for every micro-batch. Fewer, larger
  packs mean fewer stashed tensors, but a larger working set per pack (its weights, one micro-batch's
  activations inside it). So: the fewest packs that fit, with packs cut to hold about equal weight bytes
  (`packs.even_packs`), tried at 1, 2, 4, ... packs up to one per layer; the first that fits is kept.
- **Micro-batches** (when not given): 1, 2, 4, ... dividing the batch, up to `PlanOptions.max_micro_batches`;
  the count whose first fitting packing moves the fewest bytes per step (ties: the fewest micro-batches, whose
  kernels run on larger batches). The search stops once only weights move: more micro-batches cannot move less.

Limitations: packs are cut by weight bytes only, not by activation sizes; the search tries powers of two.
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
    """The bytes the busiest single step touches (its tensors, weights included, and its smallest workspace): no
    plan of this route fits below it, whatever is homed, offloaded or recomputed. Update steps are left out (a
    host update touches nothing on the device). Cheap: no placement."""
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
    """The `packs` plan of `route.network` under `budget` (see the module doc). `micro_batches`: None searches
    (unless `route` is already a packed route, whose M is kept).

    A packing whose `weights_floor` (no placement) exceeds the budget is not placed: it cannot fit, so the first
    packing that fits, and the plan, are those of a search that places every packing. Only when nothing fits are
    the skipped packings placed, for the smallest budget the error names."""
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
        except PackError:   # a layer cannot train on so small a micro-batch (BN), nor on any smaller one
            if best is None and not failed:
                raise
            break
        if budget is not None and floor_m > budget:
            failed.append((f"{m} micro-batches (one step's own tensors)", floor_m))
            continue  # one micro-batch's single step does not fit: no packing can help
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
            break  # fewer packs, fewer stashes: the first packing that fits moves the fewest bytes for this M
        if best is not None and moved_by_role(best[2])["activations"] == 0:
            break  # nothing but the weights moves: more micro-batches cannot move less
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
    """The `packs` policy (see the table in `memory/policies.py`)."""
    return plan_packs(route, budget, device or "cpu", costs)
