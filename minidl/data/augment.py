"""CIFAR-style augmentation of training batches: zero-padded random crops and horizontal flips.

A batch's crops and flips are drawn from its place in the data order (seed, epoch, offset), not from a stateful
generator: a resumed run and every data-parallel rank augment exactly alike. Held-out data is never augmented.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.errors import OptionError
from ..layers import args

__all__ = ["Augment", "parse_augment"]

DEFAULT_CROP_PADDING = 4  # pixels a side, the CIFAR recipe (He et al. 2016, section 4.2)

_SPEC_HELP = "a comma-separated list of crop (pad 4, crop back), crop:N (pad N) and flip, or none"


@dataclass(frozen=True, slots=True)
class Augment:
    """Pad `crop_padding` zeros a side (the mean colour of standardized images) and crop back at a random offset;
    `flip` mirrors each image with probability 1/2."""

    crop_padding: int = 0
    flip: bool = False

    def __post_init__(self) -> None:
        args.integer("Augment", None, "crop_padding", self.crop_padding, 0)
        args.flag("Augment", None, "flip", self.flip)

    def __bool__(self) -> bool:
        return bool(self.crop_padding or self.flip)

    def describe(self) -> str:
        """The augmentation as `--augment` spells it."""
        parts = []
        if self.crop_padding:
            parts.append("crop" if self.crop_padding == DEFAULT_CROP_PADDING else f"crop:{self.crop_padding}")
        if self.flip:
            parts.append("flip")
        return ",".join(parts) or "none"

    def apply(self, x: np.ndarray, key: tuple[int, ...]) -> None:
        """Augment `x` (N, C, H, W) in place, drawn from `key` alone."""
        if not self or len(x) == 0:
            return
        rng = np.random.default_rng(key)
        n, _, h, w = x.shape
        p = self.crop_padding
        if p:
            offsets = rng.integers(0, 2 * p + 1, size=(n, 2))
            padded = np.zeros((*x.shape[:2], h + 2 * p, w + 2 * p), dtype=x.dtype)
            padded[:, :, p:p + h, p:p + w] = x
            for i, (dy, dx) in enumerate(offsets):
                x[i] = padded[i, :, dy:dy + h, dx:dx + w]
        if self.flip:
            flips = np.flatnonzero(rng.random(n) < 0.5)
            x[flips] = x[flips, :, :, ::-1]


def parse_augment(spec: str | None) -> Augment | None:
    """`--augment`'s value (``crop``, ``crop:N``, ``flip``, comma-separated) -> an `Augment`, None for none."""
    if spec is None or spec.strip().lower() in ("", "none"):
        return None
    crop, flip = 0, False
    for part in spec.split(","):
        name, sep, value = part.strip().lower().partition(":")
        if name == "flip" and not sep:
            flip = True
        elif name == "crop" and not sep:
            crop = DEFAULT_CROP_PADDING
        elif name == "crop" and value.isdigit() and int(value) > 0:
            crop = int(value)
        else:
            raise OptionError(f"--augment {spec!r}: {part.strip()!r} is not an augmentation; {_SPEC_HELP}")
    return Augment(crop, flip)
