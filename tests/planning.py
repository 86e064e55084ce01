"""The tests' one way to plan a network: `planned(net, optimizer, policy, budget, device, **options)`, the request
(`PlanRequest.from_options`: `options` are its keywords) and target (`device`'s profile, `menu`'s algorithms: the
CPU's by default, a backend's or the cuDNN model's when given) that `policies.plan_network` takes."""
from __future__ import annotations

from minidl.backend import menu_of
from minidl.backend.cpu.menu import CPU_MENU
from minidl.memory.policies import plan_network
from minidl.memory.request import PlanRequest, Target
from minidl.memory.simulate import get_profile


def planned(net, optimizer, policy="liveness", budget=None, device="cpu", *, menu=CPU_MENU, costs=None, **options):
    """`net` planned with `optimizer`'s state under `policy` and `budget`, for the profile `device` on `menu` (a
    menu, or a backend: its menu)."""
    profile = get_profile(device) if isinstance(device, str) else device
    return plan_network(net, optimizer.slots, PlanRequest.from_options(policy, budget, **options),
                        Target(profile, menu_of(menu), costs))
