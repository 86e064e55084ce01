"""The tests' one way to plan a network: `plan(net, optimizer, policy, budget, device, **options)`."""
from __future__ import annotations

from minidl.memory.cudnn_model import planning_backend
from minidl.memory.policies import plan_network


def plan(net, optimizer, policy="liveness", budget=None, device="cpu", **options):
    """`net` planned under `policy` and `budget` for the profile `device` (its menu: the CPU's, or the cuDNN
    model's for a GPU profile)."""
    return plan_network(net, optimizer, policy, budget, device=device, backend=planning_backend(device), **options)
