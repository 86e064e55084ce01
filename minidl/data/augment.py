"""Training-time augmentation of image batches: random crops with zero padding and horizontal flips.

These are the two transforms of CIFAR-style training (pad 4 pixels, crop back to the original size at a random
offset, flip half the images left to right): they make the network see a slightly different image every epoch,
which is most of what keeps a ResNet on 50,000 small images from memorising them.

Why a batch transform drawn from a position, not a stateful generator: a `BatchIterator` applies it to each batch
it gathers, with a generator seeded by (data seed, epoch, offset of the batch in the epoch). The crops and flips
of a batch are therefore a pure function of where the batch stands in the data order, so a run resumed from a
checkpoint (which restores that position) augments the following batches exactly as the run never stopped would,
and data-parallel ranks, which each gather the same global batch, agree on every sample.

Held-out data is never augmented: `Dataset.augment` is set on the training set only (`load_data` does so), and
`Session.evaluate` reads the arrays directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.errors import OptionError
from ..layers import args

__all__ = ["Augment", "parse_augment"]

# The padding of the standard CIFAR recipe (He et al. 2016, section 4.2): 4 pixels on each side of 32x32 images.
DEFAULT_CROP_PADDING = 4

_SPEC_HELP = "a comma-separated list of crop (pad 4, crop back), crop:N (pad N) and flip, or none"


@dataclass(frozen=True, slots=True)
class Augment:
    """The augmentation of training batches: `crop_padding` pixels of zeros on each side, then a crop back to the
    original size at a uniformly random offset (0: no crop); `flip`: each image mirrored left to right with
    probability 1/2. The padding is zero in the data set's values, so on standardized images (every loader here
    standardizes) it is the mean colour."""

    crop_padding: int = 0
    flip: bool = False

    def __post_init__(self) -> None:
        args.integer("Augment", None, "crop_padding", self.crop_padding, 0)
        args.flag("Augment", None, "flip", self.flip)

    def __bool__(self) -> bool:
        return bool(self.crop_padding or self.flip)

    def describe(self) -> str:
        """The augmentation as `--augment` spells it (`none` when it does nothing)."""
        parts = []
        if self.crop_padding:
            parts.append("crop" if self.crop_padding == DEFAULT_CROP_PADDING else f"crop:{self.crop_padding}")
        if self.flip:
            parts.append("flip")
        return ",".join(parts) or "none"

    def apply(self, x: np.ndarray, key: tuple[int, ...]) -> None:
        """Augment the batch `x` (N, C, H, W) in place, with the crops and flips drawn from `key` (the iterator's
        seed, epoch and offset): the same key gives the same batch, whatever happened before."""
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
    """`--augment`'s value -> an `Augment` (None for none): ``crop`` pads 4 pixels (the CIFAR recipe), ``crop:N``
    pads N, ``flip`` mirrors half the images; combined with commas (``crop,flip``)."""
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
