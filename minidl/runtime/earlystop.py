"""Early stopping on the held-out loss: when to evaluate, what counts as better, when to give up.

`Session.fit(..., heldout=H, early_stop=EarlyStop(patience=P))` evaluates the mean held-out loss every `every`
steps and stops once P evaluations in a row have not improved on the best one by more than `min_delta`: the steps
after that point would be spent fitting the training set at the held-out set's expense. The best state can be
kept as a checkpoint (`best_path`), written each time the held-out loss improves, so the model to use is on disk
whatever the last step did.

Why the held-out loss and not its accuracy: the loss moves with every step while accuracy moves by whole samples,
so on a small held-out set accuracy stalls for many evaluations while the model is still improving. Why
evaluations are counted by `Session.iteration` (as `save_every` is): a resumed run keeps the same rhythm. The count
of evaluations without improvement starts again with each `fit` (a checkpoint does not carry it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..layers import args

__all__ = ["EarlyStop", "EarlyStopWatch"]


@dataclass(frozen=True, slots=True)
class EarlyStop:
    """Stop when `patience` evaluations of the held-out loss in a row have not improved on the best by more than
    `min_delta`; evaluate every `every` steps (None: once per epoch of the training data). `best_path`: write
    the session's checkpoint there each time the held-out loss improves (None: no checkpoint)."""

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
    """The state of one `fit` under an `EarlyStop`: the evaluations so far, the best, and the verdict."""

    rule: EarlyStop
    every: int                                       # the rule's `every`, or the epoch's batches
    evaluations: list[tuple[int, float]] = field(default_factory=list)   # (iteration, held-out loss)
    best_iteration: int | None = None
    best_loss: float = math.inf
    since_best: int = 0                              # evaluations in a row without improvement

    def due(self, iteration: int) -> bool:
        """Whether the held-out loss is evaluated after the step that brought the session to `iteration`."""
        return iteration % self.every == 0

    def observe(self, iteration: int, loss: float) -> bool:
        """Record an evaluation; True when it is the new best (a NaN loss never is)."""
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
