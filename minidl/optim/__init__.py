"""Optimizers with PyTorch's semantics. Their state is a set of named per-parameter tensors (slots), which the
route plans like any other tensor (role `optimizer`), so a memory report counts Adam's two moments exactly.
Learning-rate schedules (`StepLR`, `Cosine`, `LinearLR`, `WarmUp`) live in `minidl.optim.schedules` and are
re-exported here."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .schedules import Constant, Cosine, LinearLR, LRSchedule, StepLR, WarmUp

__all__ = ["Optimizer", "SGD", "Adam", "make_optimizer", "LRSchedule", "Constant", "StepLR", "Cosine", "LinearLR",
           "WarmUp"]


class Optimizer:
    slots: tuple[str, ...] = ()

    def update(self, be, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int) -> None:
        """Update `param` in place. `step` counts from 0 (the first update of the run)."""
        raise NotImplementedError

    def config(self) -> dict:
        return {}


@dataclass
class SGD(Optimizer):
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        if self.lr < 0 or self.momentum < 0 or self.weight_decay < 0:
            raise ValueError(f"SGD: lr, momentum and weight_decay must be >= 0, got {self}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("SGD: nesterov momentum requires momentum > 0 and dampening = 0")
        self.slots = ("momentum",) if self.momentum else ()

    def update(self, be, param, grad, state, step):
        be.sgd_update(param, grad, state.get("momentum"), self.lr, self.momentum, self.dampening,
                      self.weight_decay, self.nesterov, first_step=(step == 0))

    def config(self):
        return {"type": "sgd", "lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov}


@dataclass
class Adam(Optimizer):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        if not (0 <= self.betas[0] < 1 and 0 <= self.betas[1] < 1):
            raise ValueError(f"Adam: betas must be in [0, 1), got {self.betas}")
        self.slots = ("exp_avg", "exp_avg_sq")

    def update(self, be, param, grad, state, step):
        be.adam_update(param, grad, state["exp_avg"], state["exp_avg_sq"], self.lr, self.betas[0], self.betas[1],
                       self.eps, self.weight_decay, step + 1)

    def config(self):
        return {"type": "adam", "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay}


def make_optimizer(name: str, lr: float, momentum: float = 0.9, weight_decay: float = 0.0) -> Optimizer:
    if name == "sgd":
        return SGD(lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return Adam(lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}: expected 'sgd' or 'adam'")
