"""Optimizers with PyTorch's semantics; their state is named per-parameter tensors (slots) the route plans like any
other (role `optimizer`). Schedules are `minidl.optim.schedules`'."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .schedules import Constant, Cosine, LinearLR, LRSchedule, StepLR, WarmUp

__all__ = ["Optimizer", "SGD", "Adam", "make_optimizer", "LRSchedule", "Constant", "StepLR", "Cosine", "LinearLR",
           "WarmUp"]

from ..core.errors import OptionError


def _check_real(opt: str, what: str, v, lo_open: bool = False) -> None:
    """A finite number >= 0 (> 0 if lo_open); NaN fails too."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or not math.isfinite(v) \
            or (v <= 0 if lo_open else v < 0):
        raise OptionError(f"{opt}: {what} must be a finite number {'>' if lo_open else '>='} 0, got {v!r}")


class Optimizer:
    """Base of the optimizers: `update` one parameter in place from its gradient and its `slots` by name."""

    slots: tuple[str, ...] = ()

    def update(self, be, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int) -> None:
        """Update `param` in place. `step` counts from 0 (the first update of the run)."""
        raise NotImplementedError

    def config(self) -> dict:
        """The hyper-parameters as plain types (stored in checkpoints' metadata)."""
        return {}

    def update_fused(self, be, group, step: int) -> None:
        """`update` on every parameter of a backend's fused group (`be.fuse_update`), in one call."""
        raise NotImplementedError

    def prepare(self, be, items: list) -> Callable[[int], None]:
        """Every (param, grad, state) item's update as one callable `run(step)`: fused groups where the backend
        fuses (same arithmetic per element: bit-identical to `update`), the rest one by one. Hyper-parameters
        are read at each call, so a schedule applies."""
        fusable = be.capabilities.fused_update and type(self).update_fused is not Optimizer.update_fused
        groups, rest = be.fuse_update(items, self.slots) if fusable and items else ([], list(items))
        update, update_fused = self.update, self.update_fused

        def run(step: int) -> None:
            for group in groups:
                update_fused(be, group, step)
            for p, g, state in rest:
                update(be, p, g, state, step)
        return run


@dataclass
class SGD(Optimizer):
    """torch.optim.SGD's rule (the first step's momentum buffer is the gradient itself)."""

    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        for what in ("lr", "momentum", "dampening", "weight_decay"):
            _check_real("SGD", what, getattr(self, what))
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise OptionError("SGD: nesterov momentum requires momentum > 0 and dampening = 0")
        self.slots = ("momentum",) if self.momentum else ()

    def update(self, be, param, grad, state, step):
        be.sgd_update(param, grad, state.get("momentum"), self.lr, self.momentum, self.dampening,
                      self.weight_decay, self.nesterov, first_step=(step == 0))

    def update_fused(self, be, group, step):
        be.sgd_update_fused(group, self.lr, self.momentum, self.dampening, self.weight_decay, self.nesterov,
                            first_step=(step == 0))

    def config(self):
        return {"type": "sgd", "lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov}


@dataclass
class Adam(Optimizer):
    """torch.optim.Adam's rule (`weight_decay` adds L2 to the gradient, not AdamW's decoupled decay)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        for what in ("lr", "weight_decay"):
            _check_real("Adam", what, getattr(self, what))
        _check_real("Adam", "eps", self.eps, lo_open=True)
        if not (len(self.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas)):
            raise OptionError(f"Adam: betas must be two numbers in [0, 1), got {self.betas!r}")
        self.slots = ("exp_avg", "exp_avg_sq")

    def update(self, be, param, grad, state, step):
        be.adam_update(param, grad, state["exp_avg"], state["exp_avg_sq"], self.lr, self.betas[0], self.betas[1],
                       self.eps, self.weight_decay, step + 1)

    def update_fused(self, be, group, step):
        be.adam_update_fused(group, self.lr, self.betas[0], self.betas[1], self.eps, self.weight_decay, step + 1)

    def config(self):
        return {"type": "adam", "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay}


def make_optimizer(name: str, lr: float, momentum: float = 0.9, weight_decay: float = 0.0) -> Optimizer:
    """The optimizer the command line names."""
    if name == "sgd":
        return SGD(lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return Adam(lr=lr, weight_decay=weight_decay)
    raise OptionError(f"unknown optimizer {name!r}: expected 'sgd' or 'adam'")
