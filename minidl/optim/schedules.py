"""Learning-rate schedules with PyTorch's semantics (tested against `torch.optim.lr_scheduler`'s namesakes).

A schedule is a pure function `lr(base_lr, step)`, not PyTorch's stateful object: a resumed session continues
exactly from the iteration its checkpoint stores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.errors import OptionError

__all__ = ["LRSchedule", "Constant", "StepLR", "Cosine", "LinearLR", "WarmUp", "make_schedule", "SCHEDULES"]


class LRSchedule:
    """A learning rate per step: `lr(base_lr, step)`."""

    def lr(self, base_lr: float, step: int) -> float:
        """The learning rate of update `step` (0-based) when the optimizer was built with `base_lr`."""
        raise NotImplementedError


def _check_steps(name: str, what: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise OptionError(f"{name}: {what} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Constant(LRSchedule):
    """The optimizer's own learning rate at every step (the default)."""

    def lr(self, base_lr: float, step: int) -> float:
        return base_lr


@dataclass(frozen=True, slots=True)
class StepLR(LRSchedule):
    """Multiply by `gamma` every `step_size` steps (torch.optim.lr_scheduler.StepLR)."""

    step_size: int
    gamma: float = 0.1

    def __post_init__(self):
        _check_steps("StepLR", "step_size", self.step_size)
        if not self.gamma > 0:
            raise OptionError(f"StepLR: gamma must be > 0, got {self.gamma}")

    def lr(self, base_lr: float, step: int) -> float:
        return base_lr * self.gamma ** (step // self.step_size)


@dataclass(frozen=True, slots=True)
class Cosine(LRSchedule):
    """CosineAnnealingLR with T_max = total_steps (like it, the cosine continues past T_max)."""

    total_steps: int
    eta_min: float = 0.0

    def __post_init__(self):
        _check_steps("Cosine", "total_steps", self.total_steps)
        if self.eta_min < 0:
            raise OptionError(f"Cosine: eta_min must be >= 0, got {self.eta_min}")

    def lr(self, base_lr: float, step: int) -> float:
        return self.eta_min + (base_lr - self.eta_min) * (1 + math.cos(math.pi * step / self.total_steps)) / 2


@dataclass(frozen=True, slots=True)
class LinearLR(LRSchedule):
    """Linear from `start_factor` to `end_factor` over `total_steps`, then held (torch's LinearLR)."""

    total_steps: int
    start_factor: float = 1.0 / 3
    end_factor: float = 1.0

    def __post_init__(self):
        _check_steps("LinearLR", "total_steps", self.total_steps)
        if not (0 < self.start_factor <= 1 and 0 <= self.end_factor <= 1):
            raise OptionError(f"LinearLR: start_factor must be in (0, 1] and end_factor in [0, 1], got "
                              f"{self.start_factor}, {self.end_factor}")

    def lr(self, base_lr: float, step: int) -> float:
        t = min(step, self.total_steps)
        return base_lr * (self.start_factor + (self.end_factor - self.start_factor) * t / self.total_steps)


@dataclass(frozen=True, slots=True)
class WarmUp(LRSchedule):
    """Linear warm-up over `steps`, then `after` counted from its end (torch's SequentialLR of LinearLR, after)."""

    after: LRSchedule
    steps: int
    start_factor: float = 1.0 / 3

    def __post_init__(self):
        _check_steps("WarmUp", "steps", self.steps)
        if not 0 < self.start_factor <= 1:
            raise OptionError(f"WarmUp: start_factor must be in (0, 1], got {self.start_factor}")

    def lr(self, base_lr: float, step: int) -> float:
        if step < self.steps:
            return LinearLR(self.steps, self.start_factor).lr(base_lr, step)
        return self.after.lr(base_lr, step - self.steps)


SCHEDULES = ("constant", "step", "cosine")
"""The names `--lr-schedule` takes (`--warmup-steps` goes in front of any)."""


def make_schedule(name: str, total_steps: int, warmup_steps: int = 0, step_size: int | None = None,
                  gamma: float = 0.1, eta_min: float = 0.0) -> LRSchedule:
    """The command line's schedule over `total_steps`, after `warmup_steps` (`step`'s `step_size` defaults to a
    third of the steps)."""
    if name not in SCHEDULES:
        raise OptionError(f"--lr-schedule: unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    _check_steps("--warmup-steps", "the warm-up", warmup_steps, minimum=0)
    rest = total_steps - warmup_steps
    if name == "constant":
        after: LRSchedule = Constant()
    elif rest < 1:
        raise OptionError(f"--lr-schedule {name}: --warmup-steps {warmup_steps} leaves no step of the "
                          f"{total_steps} to decay over")
    elif name == "cosine":
        after = Cosine(rest, eta_min)
    else:
        after = StepLR(step_size or max(1, rest // 3), gamma)
    return WarmUp(after, warmup_steps) if warmup_steps else after
