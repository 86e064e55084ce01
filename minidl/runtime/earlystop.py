"""Early stopping on the held-out loss (not accuracy, which moves by whole samples and stalls on a small set).

Evaluations fall on `Session.iteration` multiples, so a resumed run keeps the rhythm; the count without improvement
restarts with each `fit` (a checkpoint does not carry it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..layers import args

__all__ = ["EarlyStop", "EarlyStopWatch"]


@dataclass(frozen=True, slots=True)
class EarlyStop:
    """Stop after `patience` evaluations in a row not better than the best by `min_delta`; evaluate every `every`
    steps (None: each epoch); write a checkpoint to `best_path` at each improvement."""

    patience: int
    every: int | None = None
    min_delta: float = 0.0
    best_path: str | Path | None = None

    def __post_init__(self) -> None:
        args.integer("EarlyStop", None, "patience", self.patience, 1)
        if self.every is not None:
            args.integer("EarlyStop", None, "every", self.every, 1)
        args.real("EarlyStop", None, "min_delta", self.min_delta, 0.0)


@dataclass(slots=True)
class EarlyStopWatch:
    """One `fit`'s evaluations, best and verdict under an `EarlyStop`."""

    rule: EarlyStop
    every: int                                       # the rule's `every`, or the epoch's batches
    evaluations: list[tuple[int, float]] = field(default_factory=list)   # (iteration, held-out loss)
    best_iteration: int | None = None
    best_loss: float = math.inf
    since_best: int = 0                              # evaluations in a row without improvement

    def due(self, iteration: int) -> bool:
        """Whether to evaluate after the step that reached `iteration`."""
        return iteration % self.every == 0

    def observe(self, iteration: int, loss: float) -> bool:
        """Record an evaluation; True for a new best (never NaN)."""
        self.evaluations.append((iteration, loss))
        if loss < self.best_loss - self.rule.min_delta:   # the first finite loss improves on infinity
            self.best_iteration, self.best_loss, self.since_best = iteration, loss, 0
            return True
        self.since_best += 1
        return False

    @property
    def stop(self) -> bool:
        return self.since_best >= self.rule.patience

    def to_json(self) -> dict:
        return {"patience": self.rule.patience, "every": self.every, "min_delta": self.rule.min_delta,
                "best_iteration": self.best_iteration,
                "best_heldout_loss": None if self.best_iteration is None else self.best_loss,
                "evaluations": [list(e) for e in self.evaluations]}
