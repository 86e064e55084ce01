"""The table of policies, and the one entry point from (network, optimizer slots, request, target) to a plan.

Every command and the trainer go through `plan_network`, so a policy listed in `POLICIES` is available everywhere
at once (CLI choices included). A policy is a function `(route, budget, device, costs) -> Plan` (`device`: the
target's `DeviceProfile`; `costs`: the `workspace.CostTable` that ranks convolution algorithms, None for the menu's
own estimates).

Why a table and not self-registration: the modules that implement the mechanisms (`decisions/`, `schedulers/`)
sit below this one and never import it, so the import graph has no circle and a reader sees every policy in one
place. The policies' words (name, help, when, paper) are `policy_table.py`'s, which the command line reads without
importing this module. Adding a policy is one row there and one planning function here (see
docs/architecture.md).
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Callable, Sequence

from ..core.errors import BudgetError, OptionError
from ..core.units import size_option
from ..graph.network import Network
from ..graph.route import Route
from .decisions.allreduce import add_allreduce_events, with_buckets
from .decisions.compress import compress_policy
from .decisions.offload_fit import offload_policy
from .decisions.recompute import recompute_policy
from .decisions.weights import weights_policy
from .paged import LEAST_CHUNK
from .plan import Plan
from .planner import default_workspace, make_plan, none_schedule
from .policy_table import POLICY_TABLE, PolicyInfo, available_policies, exact_policies, policies_help
from .pool import ALIGNMENT, format_bytes
from .request import PlanRequest, Target
from .schedulers.auto import Rival, auto_policy
from .schedulers.lossy import auto_lossy_policy
from .schedulers.minimum import verified_minimum
from .schedulers.packs import packs_policy
from .schedulers.window import window_policy
from .simulate import DeviceProfile
from .workspace import CostTable

PolicyFn = Callable[[Route, "int | None", DeviceProfile, "CostTable | None"], Plan]

__all__ = ["PLANNERS", "POLICIES", "Policy", "PlanRequest", "Target", "available_policies", "exact_policies",
           "plan_network", "policies_help"]


@dataclass(frozen=True, slots=True)
class Policy(PolicyInfo):
    """A row of `policy_table.POLICY_TABLE` with the function that plans it."""

    plan: PolicyFn | None = None


def _none(route: Route, budget: int | None, device, costs: CostTable | None = None) -> Plan:
    ws = default_workspace(route, costs)
    return make_plan(route, "none", budget, workspace=ws, schedule=none_schedule(route, ws))


def _liveness(route: Route, budget: int | None, device, costs: CostTable | None = None) -> Plan:
    return make_plan(route, "liveness", budget, workspace=default_workspace(route, costs))


PLANNERS: dict[str, PolicyFn] = {
    "none": _none, "liveness": _liveness, "offload": offload_policy, "recompute": recompute_policy,
    "weights": weights_policy, "compress": compress_policy, "packs": packs_policy, "auto": auto_policy,
    "auto-lossy": auto_lossy_policy, "window": window_policy,
}

POLICIES: dict[str, Policy] = {name: Policy(**{f.name: getattr(info, f.name) for f in fields(info)},
                                            plan=PLANNERS[name]) for name, info in POLICY_TABLE.items()}


def plan_network(net: Network, slots: Sequence[str], request: PlanRequest, target: Target) -> Plan:
    """Plan the training of `net`, with the optimizer state `slots` (`Optimizer.slots`: one tensor per parameter
    each), as `request` asks (`memory/request.py`: policy, budget, options) for `target` (device profile,
    algorithm menu, cost table). A plan runs only on a backend of its menu's kind.

    The options: `fused_update` (`PlanRequest.fused_update`); `paged_chunk` places tensors by chunks on a paged
    arena (`memory/paged.py`), under any policy; `data_parallel` (one rank of several): gradient buckets are added
    to the route and planned like any tensor, and their all-reduce events to the plan (`decisions/allreduce.py`),
    on the textbook route (the update waits for the reduced gradients); `micro_batches`: policy `packs` plans
    Harmony's route of layer packs (`packs.py`; it chooses the count when None), every other policy gradient
    accumulation (`route.py`: each micro-batch's forward, then its backward); `max_micro_batches`: the most
    micro-batches a policy may cut the batch into by itself (`auto` where that is faster or the only fit, `packs` by
    the bytes it moves); `host_weights=False`: weights and optimizer state stay on the device whatever the budget
    (`auto` neither homes them on the host nor weighs `weights` and `packs` plans), as SuperNeurons and nnabla's
    out-of-core training keep them. A `portfolio` policy (`auto`) also plans every other exact policy, each on the
    route this function would give it (`_rivals`).
    """
    opts = request.options
    packed = opts.micro_batches is not None   # micro-batched: layer packs (cut by policy packs) or accumulate

    def route_of(policy: str) -> Route:
        """The route `policy` is planned on when asked for with `request`'s budget and options: its update fused
        or not (`PlanRequest.fused_update`), one pack per layer for `packs` under micro-batches."""
        return net.route(training=True, optimizer_slots=tuple(slots), menu=target.menu,
                         fused_update=replace(request, policy=policy).fused_update,
                         micro_batches=opts.micro_batches or 1,
                         packs=[[n.name] for n in net.layer_nodes] if packed and policy == "packs" else None,
                         math=opts.math).with_options(opts)

    with _without_cycle_collection():
        route = route_of(request.policy)
        if opts.data_parallel is None:
            return _plan_verified(route, request, target, _rivals(request, route_of, None))
        route, buckets = with_buckets(route, opts.data_parallel)
        return add_allreduce_events(_plan_verified(route, request, target, _rivals(request, route_of, route)),
                                    buckets, opts.data_parallel)


def _rivals(request: PlanRequest, route_of: Callable[[str], Route], ranks_route: Route | None) -> tuple[Rival, ...]:
    """What a `portfolio` policy plans besides its own search: every exact policy without the flag, on the route
    `plan_network` gives that policy (`route_of`), so that it fits wherever one of them does, and is as fast. With
    several ranks, on the one route with the gradient buckets (every exact policy's route is then the same, and
    `packs`, which cuts the batch into micro-batches, is left out: data parallel does not support them). A policy
    the request's options refuse (`PlanRequest`: fp16 and `packs`) is no rival."""
    if not POLICIES[request.policy].portfolio or request.budget is None:
        return ()
    rows = [POLICIES[p] for p in exact_policies() if not POLICIES[p].portfolio and _accepted(request, p)]
    if ranks_route is not None:
        return tuple(Rival(p.name, p.plan, lambda: ranks_route, p.homes_weights, p.packs_batch)
                     for p in rows if not p.packs_batch)
    return tuple(Rival(p.name, p.plan, partial(route_of, p.name), p.homes_weights, p.packs_batch) for p in rows)


def _accepted(request: PlanRequest, policy: str) -> bool:
    """Whether `request`'s options accept `policy` (`PlanRequest`'s own checks)."""
    try:
        replace(request, policy=policy)
    except OptionError:
        return False
    return True


def _whole_batch(route_of: Callable[[], Route]) -> Route:
    """The route `route_of` builds, with no micro-batches chosen by the policy itself."""
    route = route_of()
    return route.with_options(replace(route.options, max_micro_batches=1))


@contextmanager
def _without_cycle_collection():
    """Python's cycle collector off while a plan is made: planning allocates millions of small records that
    reference counting frees (steps, events, residencies; no cycles among them), and each of the collector's
    full passes walks all of them (ResNet-2500 b16 on the k40c, `minidl plan ... --budget 12GB`: 13 full passes,
    1.7 of 7.4 s of CPU). On again afterwards, as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan_verified(route: Route, request: PlanRequest, target: Target, rivals: tuple[Rival, ...] = ()) -> Plan:
    """Plan with the table's function; a BudgetError leaves with a minimum verified by planning at it
    (`schedulers/minimum.py` says what "minimum" means per policy).

    A budget is planned as the whole pool blocks it holds (`ALIGNMENT`: every block starts and ends on one, so the
    bytes past the last boundary can never be used). Handing the policies the raw number let its last few bytes
    steer their choices (`offload` scales its room by the excess of a first placement): 36,045 B planned where
    36,044 B did not and 35,533 B did again, so no stated minimum could be the edge. The plan's arena is still the
    budget given. `rivals`: the other policies a `portfolio` policy plans as its candidates (`_rivals`)."""
    policy, budget = request.policy, request.budget

    def fn(r: Route, b: int | None) -> Plan:
        return POLICIES[policy].plan(r, b, target.profile, target.costs, **({"rivals": rivals} if rivals else {}))

    def plan_at(b: int | None) -> Plan:
        if b is None:
            return fn(route, None)
        usable = b - b % ALIGNMENT
        try:
            plan = fn(route, usable)
        except BudgetError as e:
            if usable == b:
                raise
            raise BudgetError(str(e).replace(f"{format_bytes(usable)} ({usable:,} B)", f"{format_bytes(b)} ({b:,} B)",
                                             1), e.min_budget_bytes, e.binding) from None
        if plan.arena_bytes == usable:
            plan.arena_bytes = b
        return plan

    try:
        plan = plan_at(budget)
    except BudgetError as e:
        if budget is None or not request.verify_minimum:
            raise
        # verified with the batch whole: `auto` searching every micro-batch count at each of the dozen budgets the
        # verification plans cost minutes (ResNet-20 at batch 8: 1 s -> 3 min); the budget it states plans either way
        route = route.with_options(replace(route.options, max_micro_batches=1))   # (plan_at reads this route)
        rivals = tuple(replace(r, route_of=partial(_whole_batch, r.route_of)) for r in rivals)   # (and these)
        e = verified_minimum(plan_at, policy, budget, e)
        if route.options.paged_chunk:   # the chunk is as much a cause as the budget: say so, and that it can be smaller
            chunk = route.options.paged_chunk
            smaller = max(LEAST_CHUNK["cpu"], chunk // 8)
            hint = (f"each large tensor takes whole chunks, so a smaller chunk (e.g. --paged {size_option(smaller)}) "
                    f"may plan in less" if smaller < chunk else "the smallest chunk --paged picks by itself")
            e = BudgetError(f"{e} Tensors are placed by {format_bytes(chunk)} chunks (--paged {size_option(chunk)}): "
                            f"{hint}.", e.min_budget_bytes, e.binding)
        raise e from None
    if route.options.paged_chunk and plan.paged is None:   # a policy that plans a route of its own must pass --paged on
        raise OptionError(f"policy '{policy}' did not place its plan by chunks: --paged is not supported with it")
    return plan
