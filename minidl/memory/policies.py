"""The table of policies, and the one entry point from (network, optimizer slots, request, target) to a plan.

Every command and the trainer go through `plan_network`, so a policy in `POLICIES` is available everywhere at once.
A policy is `(route, budget, device profile, cost table or None) -> Plan`. A table, not self-registration:
`decisions/` and `schedulers/` sit below this module and never import it, and every policy is seen in one place.
The policies' words are `policy_table.py`'s (the command line reads them without importing this). Adding a policy:
one row there, one planner here (docs/architecture.md).
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Callable, Sequence

from ..core.errors import BudgetError, DistError, OptionError
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
    """Plan training `net` with optimizer `slots` as `request` asks for `target`. Under `micro_batches`, `packs`
    plans layer packs, the others gradient accumulation; data parallel adds buckets and all-reduce events."""
    opts = request.options
    packed = opts.micro_batches is not None

    def route_of(policy: str) -> Route:
        """`policy`'s route: its update fused or not, one pack per layer for `packs` under micro-batches."""
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
    several ranks, on the one route with the gradient buckets (every exact policy's route is then the same). A policy
    the request's options refuse (`PlanRequest`: `packs` under fp16 or data parallel) is no rival."""
    if not POLICIES[request.policy].portfolio or request.budget is None:
        return ()
    rows = [POLICIES[p] for p in exact_policies() if not POLICIES[p].portfolio and _accepted(request, p)]
    if ranks_route is not None:
        return tuple(Rival(p.name, p.plan, lambda: ranks_route, p.homes_weights, p.packs_batch) for p in rows)
    return tuple(Rival(p.name, p.plan, partial(route_of, p.name), p.homes_weights, p.packs_batch) for p in rows)


def _accepted(request: PlanRequest, policy: str) -> bool:
    """Whether `request`'s options accept `policy` (`PlanRequest`'s own checks)."""
    try:
        replace(request, policy=policy)
    except (OptionError, DistError):
        return False
    return True


def _whole_batch(route_of: Callable[[], Route]) -> Route:
    route = route_of()
    return route.with_options(replace(route.options, max_micro_batches=1))


@contextmanager
def _without_cycle_collection():
    """The cycle collector off while planning: its passes walk millions of acyclic records (1.7 of 7.4 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan_verified(route: Route, request: PlanRequest, target: Target, rivals: tuple[Rival, ...] = ()) -> Plan:
    """Plan with the table's function; a BudgetError states a verified minimum. Policies see the budget in whole
    `ALIGNMENT` blocks (unusable tail bytes would steer their choices); the arena stays the budget given."""
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
        # verified with the batch whole (every micro-batch count at a dozen budgets: ResNet-20 b8 1 s -> 3 min)
        route = route.with_options(replace(route.options, max_micro_batches=1))   # plan_at reads this route
        rivals = tuple(replace(r, route_of=partial(_whole_batch, r.route_of)) for r in rivals)   # and these
        e = verified_minimum(plan_at, policy, budget, e)
        if route.options.paged_chunk:   # the chunk is as much a cause as the budget
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
