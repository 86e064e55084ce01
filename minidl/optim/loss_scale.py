"""Dynamic loss scaling for fp16 (`--math fp16`): PyTorch's `torch.amp.GradScaler`, step for step.

Rules:
* The loss's gradient starts at `scale` instead of 1, so small gradients survive fp16's range (its smallest
  normal is 6.1e-5); the float32 gradients are multiplied by `inv_scale` (float32, from the reciprocal in float64,
  as PyTorch computes it) before the update.
* A step whose gradients hold an inf or a NaN is skipped (no update, optimizer state untouched) and the scale is
  multiplied by `backoff_factor`; after `growth_interval` steps in a row without one it is multiplied by
  `growth_factor` (a product that overflows float32 leaves it unchanged). The scale is a float32, as PyTorch's.
* `diverging`: `max_skips` skips in a row: the scale has fallen by backoff^max_skips, so even unscaled gradients
  overflow: the divergence guard's cue, where one skipped step is the scaler doing its work.
* `state_dict` holds everything a resume needs to continue the same sequence of scales.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..core.errors import OptionError

MAX_SKIPS = 20  # skips in a row that mean divergence: 2^16 backs off to 2^-4, below the unscaled gradients


@dataclass
class LossScaler:
    """The dynamic loss scale and its counters (PyTorch's defaults)."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    max_skips: int = MAX_SKIPS
    growth_tracker: int = 0      # steps in a row without an inf/NaN gradient since the last change of scale
    skipped_in_a_row: int = 0

    def __post_init__(self):
        if not (self.scale > 0 and np.isfinite(self.scale)):
            raise OptionError(f"loss scale: the initial scale must be a finite number > 0, got {self.scale!r}")
        if not self.growth_factor > 1:
            raise OptionError(f"loss scale: growth_factor must be > 1, got {self.growth_factor!r}")
        if not 0 < self.backoff_factor < 1:
            raise OptionError(f"loss scale: backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise OptionError(f"loss scale: growth_interval must be an integer >= 1, got {self.growth_interval!r}")
        self.scale = float(np.float32(self.scale))

    @property
    def inv_scale(self) -> np.float32:
        """What the gradients are multiplied by before the update."""
        return np.float32(1.0 / np.float64(self.scale))

    @property
    def diverging(self) -> bool:
        return self.skipped_in_a_row >= self.max_skips

    def unscale(self, grads) -> bool:
        """Multiply each float32 gradient by `inv_scale` in place; whether any held an inf or a NaN (then the step
        is to be skipped: `update(True)`)."""
        inv = self.inv_scale
        found = False
        for g in grads:
            found = found or not bool(np.isfinite(g).all())
            np.multiply(g, inv, out=g)
        return found

    def update(self, found_inf: bool) -> bool:
        """Advance the scale after a step whose gradients held an inf/NaN (`found_inf`) or not; whether that
        step's update is to be applied."""
        if found_inf:
            self.scale = float(np.float32(self.scale * self.backoff_factor))
            self.growth_tracker = 0
            self.skipped_in_a_row += 1
            return False
        self.skipped_in_a_row = 0
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            with np.errstate(over="ignore"):
                grown = np.float32(self.scale * self.growth_factor)
            if np.isfinite(grown):
                self.scale = float(grown)
            self.growth_tracker = 0
        return True

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> "LossScaler":
        """The scaler `state_dict` described, counters included (a resumed run continues the same scales)."""
        unknown = set(state) - set(cls.__dataclass_fields__)
        if unknown:
            raise OptionError(f"loss scale state: unknown field(s) {sorted(unknown)}")
        return cls(**state)
