"""Learning-rate schedules with PyTorch's semantics (each tested against `torch.optim.lr_scheduler`'s class of
the same name on the same steps).

A schedule is a pure function of (base learning rate, step): `lr(base_lr, step)` is the learning rate the
optimizer uses for the update of step `step` (counting from 0, the first update of the run). PyTorch holds the
same numbers in a stateful object stepped after each update; a pure function instead lets a resumed session
continue exactly where it stopped (the step is the executor's iteration, which a checkpoint stores) and lets a
test compare whole sequences at once.

    sched = WarmUp(Cosine(total_steps=900), steps=100)   # torch: SequentialLR([LinearLR, CosineAnnealingLR])
    sess = Session(net, SGD(lr=0.1), lr_schedule=sched)
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
    """Half a cosine from the base rate down to `eta_min` over `total_steps` steps
    (torch.optim.lr_scheduler.CosineAnnealingLR with T_max = total_steps; like it, the cosine continues past
    T_max, so set total_steps to the run's length)."""

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
    """Scale the base rate linearly from `start_factor` to `end_factor` over `total_steps` steps, then hold
    (torch.optim.lr_scheduler.LinearLR): with the defaults, a linear warm-up."""

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
    """A linear warm-up over `steps` steps from `start_factor` x the base rate, then `after` with its step
    counted from the end of the warm-up (torch: SequentialLR([LinearLR(start_factor, total_iters=steps),
    after], milestones=[steps]))."""

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
"""The names `--lr-schedule` takes (a warm-up is `--warmup-steps`, in front of any of them)."""


def make_schedule(name: str, total_steps: int, warmup_steps: int = 0, step_size: int | None = None,
                  gamma: float = 0.1, eta_min: float = 0.0) -> LRSchedule:
    """The schedule the command line describes: `name` over a run of `total_steps`, after `warmup_steps` of
    linear warm-up (cosine then decays over the steps left; `step` decays every `step_size`, default a third
    of them)."""
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
