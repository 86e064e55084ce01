"""One entry point from (network, optimizer, policy, budget) to a plan, and the registry of policies.

Every command and the trainer go through `plan_network`, so a policy registered here is available everywhere
at once (CLI choices included). A policy is a function `(route, budget, device, costs) -> Plan` (`costs`: the
`workspace.CostTable` that ranks convolution algorithms, None for the menu's own estimates); mechanisms that
change where tensors live between uses (offload, recomputation) express their decisions as a `Schedule`
handed to the planner's single placement pass, never as special cases in the executor.
"""
from __future__ import annotations

from typing import Callable

from ..graph import Network
from ..optim import Optimizer
from ..route import Route
from .plan import Plan
from .planner import default_workspace, make_plan
from .workspace import CostTable

PolicyFn = Callable[[Route, "int | None", str, "CostTable | None"], Plan]

POLICY_REGISTRY: dict[str, PolicyFn] = {}
POLICY_HELP: dict[str, str] = {}


def register_policy(name: str, help: str):
    def deco(fn: PolicyFn) -> PolicyFn:
        POLICY_REGISTRY[name] = fn
        POLICY_HELP[name] = help
        return fn
    return deco


@register_policy("none", "every tensor allocated up front, never freed: the baseline")
def _none(route: Route, budget: int | None, device: str, costs: CostTable | None = None) -> Plan:
    return make_plan(route, "none", budget, workspace=default_workspace(route, costs))


@register_policy("liveness", "allocate each tensor just before its first use, free it right after its last")
def _liveness(route: Route, budget: int | None, device: str, costs: CostTable | None = None) -> Plan:
    return make_plan(route, "liveness", budget, workspace=default_workspace(route, costs))


def _load_mechanisms() -> None:
    """Import the modules that register more policies (each registers itself on import; imported here, lazily,
    because they import this registry)."""
    from . import auto, offload, recompute  # noqa: F401


def available_policies() -> tuple[str, ...]:
    _load_mechanisms()
    return tuple(POLICY_REGISTRY)


def plan_network(net: Network, optimizer: Optimizer | None = None, policy: str = "liveness",
                 budget: int | None = None, device: str = "cpu", training: bool = True, backend=None,
                 costs: CostTable | None = None) -> Plan:
    """Plan `net` (with `optimizer`'s state) under `policy` and `budget`.

    `device` names the simulator profile whose speeds (compute, link) the policy's timing decisions use;
    `backend` (None: the CPU reference) is the backend the plan will run on, whose convolution algorithms
    and workspace sizes the plan chooses among. A plan runs only on a backend of the kind it was made for.
    `costs` ranks those algorithms (default: the menu's estimates; `CostTable(autotune=True, backend=...)`
    measures them once per shape).
    """
    _load_mechanisms()
    if policy not in POLICY_REGISTRY:
        raise ValueError(f"unknown policy {policy!r}: expected one of {', '.join(POLICY_REGISTRY)}")
    slots = tuple(optimizer.slots) if optimizer is not None else ()
    route = net.route(training=training, optimizer_slots=slots, backend=backend)
    return POLICY_REGISTRY[policy](route, budget, device, costs)
