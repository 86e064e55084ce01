"""The one answer to "does it fit on this device", and the search for the largest size that does.

Rule: `plan_on_device` is `minidl plan MODEL --policy P --budget M --device D` (M: `DeviceProfile.usable_bytes`),
through the same `plan_network`, request and target; a reproduction asks nothing else, so its tables and the command
line cannot disagree about a fit.
"""
from __future__ import annotations

from typing import Callable

from ..core.errors import BudgetError
from ..graph.network import Network
from ..memory.plan import Plan
from ..memory.policies import plan_network
from ..memory.request import PlanRequest, Target
from ..memory.simulate import get_profile
from ..optim import SGD


def momentum_sgd() -> SGD:
    """SGD with momentum, as the papers' ImageNet runs use."""
    return SGD(lr=0.01, momentum=0.9)


def plan_on(net: Network, policy: str, device: str, budget: int | None = None, **options) -> Plan:
    """`net` with `momentum_sgd`'s state planned as `minidl plan` would (`options`: `PlanRequest.from_options`)."""
    return plan_network(net, momentum_sgd().slots, PlanRequest.from_options(policy, budget, **options),
                        Target.for_run(device))


def plan_on_device(net: Network, policy: str, device: str, budget: int | None = None, **options) -> Plan | None:
    """The plan within `budget` (default: the device's usable memory), or None where it does not fit."""
    budget = get_profile(device).usable_bytes if budget is None else budget
    if not options.get("host_weights", True):
        # Parameters and optimizer state that stay on the device and alone exceed it: no plan can fit. Said here
        # at once, where `auto` would first try every placement it knows (minutes for a ResNet of 6000 layers).
        route = net.route(optimizer_slots=tuple(momentum_sgd().slots), menu=Target.for_run(device).menu,
                          math=options.get("math") or "fp32")
        if route.persistent_bytes() > budget:
            return None
    try:
        plan = plan_on(net, policy, device, budget, verify_minimum=False, **options)
    except BudgetError:
        return None
    return plan if plan.min_budget_bytes <= budget else None


def largest(ok: Callable[[int], bool], start: int, lo: int = 1, within: float = 0.0) -> int:
    """The largest n >= lo with ok(n) for a monotone `ok` (0 if not ok(lo)): doubling from `start`, then bisection,
    exact or to a relative `within`."""
    if not ok(lo):
        return 0
    hi = max(start, lo + 1)
    while ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, int(lo * within)):
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
