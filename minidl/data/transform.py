"""How stored pixels become the floats a network reads: `(x / depth max - mean[c]) / std[c]` in float32, in place.

One `InputTransform`, kept in the checkpoint, serves training, held-out and `predict` images bit for bit. Pixels of
another kind are refused: scaled by the wrong depth they would give wrong classes silently.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.errors import DataError
from ..core.guards import check_finite_data, check_images

__all__ = ["InputTransform", "DEPTHS", "as_network_input"]

# stored pixel dtype -> its largest value
DEPTHS = {"uint8": 255, "uint16": 65535}


@dataclass(frozen=True, slots=True)
class InputTransform:
    """The transform of pixels stored as `dtype`; `mean`, `std`: float32 values per channel (JSON-exact floats)."""

    dtype: str
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DEPTHS:
            raise DataError(f"an input transform scales pixels stored as {', '.join(DEPTHS)}, not {self.dtype}")
        mean = tuple(float(np.float32(v)) for v in self.mean)
        std = tuple(float(np.float32(v)) for v in self.std)
        if not mean or len(mean) != len(std) or not all(np.isfinite(mean + std)) or min(std) <= 0:
            raise DataError(f"an input transform needs one finite mean and one positive std per channel, got mean "
                            f"{self.mean} and std {self.std}")
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)

    @classmethod
    def fit(cls, x: np.ndarray, dtype: str) -> InputTransform:
        """Per-channel statistics of `x` (N, C, H, W) in float64; a constant channel keeps std 1 (no division by
        zero, or by a zero's rounding error)."""
        scaled = x.astype(np.float32) / np.float32(DEPTHS[dtype])
        mean = scaled.mean(axis=(0, 2, 3), dtype=np.float64)
        std = scaled.std(axis=(0, 2, 3), dtype=np.float64)
        constant = scaled.max(axis=(0, 2, 3)) == scaled.min(axis=(0, 2, 3))
        return cls(dtype, tuple(mean), tuple(np.where(constant | (std == 0), 1.0, std)))

    @property
    def channels(self) -> int:
        return len(self.mean)

    def describe(self) -> str:
        return (f"{self.dtype} pixels divided by {DEPTHS[self.dtype]}, then standardized per channel (mean "
                f"{', '.join(f'{v:.4g}' for v in self.mean)}; std {', '.join(f'{v:.4g}' for v in self.std)})")

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """Transform float32 `x` holding the stored values in place; return it."""
        c = (1, self.channels, 1, 1)
        x /= np.float32(DEPTHS[self.dtype])
        x -= np.asarray(self.mean, np.float32).reshape(c)
        x /= np.asarray(self.std, np.float32).reshape(c)
        return x

    def check(self, x: np.ndarray, where: str) -> None:
        """Refuse pixels this transform was not made for: another dtype, or another channel count."""
        if x.dtype.name != self.dtype:
            raise DataError(f"{where}: the pixels are {x.dtype}, but the network was trained on {self.describe()}; "
                            f"give the images as {self.dtype}, stored as the training data was")
        if x.ndim != 4 or x.shape[1] != self.channels:
            raise DataError(f"{where}: images of shape {x.shape}, but the network was trained on images (N, "
                            f"{self.channels}, H, W)")

    def apply(self, x: np.ndarray, where: str) -> np.ndarray:
        """Stored pixels `x` as the network reads them: a new float32 array."""
        self.check(x, where)
        return self.normalize(x.astype(np.float32))

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_json(cls, d, where: str) -> InputTransform | None:
        """The transform a checkpoint recorded (None: its network reads floats as they are)."""
        if d is None:
            return None
        try:
            return cls(str(d["dtype"]), tuple(d["mean"]), tuple(d["std"]))
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{where}: its input transform {d!r} is unreadable ({e})") from None


def as_network_input(x, transform: InputTransform | None, where: str) -> np.ndarray:
    """Inference images as the network reads them (through `transform` if any), numeric and finite."""
    x = check_images(x, where)
    if transform is not None:
        out = transform.apply(x, where)
    else:
        with np.errstate(over="ignore"):   # beyond float32's range becomes inf: refused below
            out = x.astype(np.float32)
    check_finite_data(out, where)
    return out
