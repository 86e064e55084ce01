"""The one form every image source produces: a `Dataset` (float32 NCHW images, int64 labels, the augmentation of
its batches) and the `BatchIterator` that gathers its batches in an order fixed by the seed.

One layout and one dtype pair means the executor plans the data and label tensors once, from the sample shape and
the batch size alone, whatever the source. Every random choice comes from ``np.random.default_rng(seed)``, so a
run is reproducible from its seed alone.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import DataError
from ..core.guards import check_finite_data, check_images, check_labels
from ..layers import args
from .augment import Augment
from .text import SequenceDataset
from .transform import InputTransform

__all__ = ["Dataset", "BatchIterator", "from_arrays"]

# ---------------------------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class Dataset:
    """Images (float32, NCHW) and their labels (int64, shape (N,)), and the augmentation of its batches.

    The constructor normalizes dtypes and memory layout (C-contiguous float32 / int64) once, so batching
    is a plain gather with no per-step conversion, and validates that the labels fit `num_classes`, so a
    bad label shows up here and not as an out-of-range index deep inside a loss kernel. Equality is
    identity: comparing image arrays element-wise is not what `==` on a dataset should do.

    `augment` (an `Augment`, or None) is applied by `BatchIterator` to each training batch; `subset` and
    `split` leave it out, so a held-out part is never augmented (set it on the training part). `transform` (an
    `InputTransform`; None: the images were given as the network reads them) says how stored pixels became `x`;
    `subset` and `split` keep it, and a checkpoint records it, so `predict` treats new images the same way.
    `source`: the ``--data`` value it was loaded from (`load_data` sets it; None for arrays given in Python).
    """

    x: np.ndarray = field(repr=False)
    y: np.ndarray = field(repr=False)
    num_classes: int
    name: str = "dataset"
    augment: Augment | None = None
    transform: InputTransform | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        x = check_images(self.x, self.name)
        y = check_labels(self.y, None, self.name)
        if x.ndim != 4:
            raise DataError(
                f"{self.name}: images must be a 4-D array (N, C, H, W), got shape {x.shape}; "
                "use from_arrays() to add a channel axis to (N, H, W) images"
            )
        if y.ndim != 1:
            raise DataError(f"{self.name}: labels must be a 1-D array (N,), got shape {y.shape}")
        if self.augment is not None and not isinstance(self.augment, Augment):
            raise DataError(f"{self.name}: augment must be an Augment or None, got {type(self.augment).__name__}")
        if self.transform is not None and not isinstance(self.transform, InputTransform):
            raise DataError(f"{self.name}: transform must be an InputTransform or None, got "
                            f"{type(self.transform).__name__}")
        if x.shape[0] != y.shape[0]:
            raise DataError(
                f"{self.name}: {x.shape[0]} images but {y.shape[0]} labels; they must match one to one"
            )
        if x.shape[0] == 0:
            raise DataError(f"{self.name}: dataset is empty (0 samples)")
        if any(d <= 0 for d in x.shape[1:]):
            raise DataError(f"{self.name}: image shape {x.shape[1:]} has an empty dimension")
        num_classes = args.integer("Dataset", self.name, "num_classes", self.num_classes, 1)
        check_labels(y, num_classes, self.name)
        with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf: refused just below
            self.x = np.ascontiguousarray(x, dtype=np.float32)
        self.y = np.ascontiguousarray(y, dtype=np.int64)
        self.num_classes = num_classes
        check_finite_data(self.x, self.name)  # after the cast: a float64 beyond 3.4e38 becomes inf here

    def __repr__(self) -> str:  # the arrays themselves would flood a log
        aug = f", augment={self.augment.describe()!r}" if self.augment else ""
        return (
            f"Dataset(name={self.name!r}, n={len(self)}, image_shape={self.image_shape}, "
            f"num_classes={self.num_classes}{aug})"
        )

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one sample: what the network's input layer is declared with."""
        c, h, w = self.x.shape[1:]
        return (int(c), int(h), int(w))

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One sample's shape, the network's input without its batch axis (a `SequenceDataset`'s is (T,))."""
        return self.image_shape

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def subset(self, indices: np.ndarray, name: str | None = None) -> Dataset:
        """A new Dataset holding copies of the given samples (in the given order), with the same transform."""
        idx = np.asarray(indices, dtype=np.int64)
        return Dataset(self.x[idx], self.y[idx], self.num_classes, name=name or self.name, transform=self.transform)

    def split(self, fraction_or_count: float | int, seed: int = 0) -> tuple[Dataset, Dataset]:
        """Split into (train, heldout) with a random, seed-determined partition.

        `fraction_or_count` is the size of the *held-out* part: a float in (0, 1) is a fraction of the
        samples (rounded, at least one), an int is a sample count. Both parts must be non-empty, since an
        empty validation set would make every reported metric meaningless. Samples keep their original
        relative order inside each part, so the split is a pure function of (data, size, seed).
        """
        n = len(self)
        if isinstance(fraction_or_count, (bool, np.bool_)):
            raise DataError("split() takes a held-out fraction (float) or count (int), not a bool")
        if isinstance(fraction_or_count, (int, np.integer)):
            count = int(fraction_or_count)
        elif isinstance(fraction_or_count, (float, np.floating)):
            frac = float(fraction_or_count)
            if not 0.0 < frac < 1.0:
                raise DataError(f"split fraction must be in (0, 1), got {frac}")
            count = max(1, int(round(frac * n)))
        else:
            raise DataError(f"split() takes a float fraction or an int count, got {type(fraction_or_count)}")
        if not 0 < count < n:
            raise DataError(
                f"{self.name}: cannot hold out {count} of {n} samples; both parts must be non-empty"
            )
        perm = np.random.default_rng(seed).permutation(n)
        held = np.sort(perm[:count])
        train = np.sort(perm[count:])
        return self.subset(train, name=f"{self.name}/train"), self.subset(held, name=f"{self.name}/heldout")


# ---------------------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------------------


class BatchIterator:
    """Endless, seed-deterministic mini-batches over a Dataset, reshuffled every epoch, augmented when the
    data set says so (`Dataset.augment`: the crops and flips of a batch drawn from its seed, epoch and offset),
    masked likewise when a `SequenceDataset` has a `masking` (BERT's masked tokens and their targets).

    * ``next(it)`` / ``it.next_batch()`` return fresh contiguous ``(x, y)`` arrays (float32, int64).
    * ``it.next_into(x_out, y_out)`` gathers the same batch straight into caller-owned arrays. The
      executor owns the memory of the DATA/LABEL tensors (they live in its arena), so it hands us views
      and we write into them without allocating per step.
    * ``for x, y in it.epoch():`` runs the rest of the current epoch (a whole one at an epoch boundary).

    With ``drop_last=True`` (the default) every batch has exactly ``batch_size`` samples, so shapes never
    change between steps and the memory plan holds for every step; the samples left over in an epoch are
    dropped, but since each epoch is a new permutation, every sample is still seen over time.
    The sequence of batches depends only on (dataset, batch_size, seed, shuffle, drop_last).
    """

    def __init__(
        self,
        dataset: Dataset | SequenceDataset,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if not isinstance(dataset, (Dataset, SequenceDataset)):
            raise DataError(f"BatchIterator needs a Dataset or a SequenceDataset, got {type(dataset).__name__}")
        batch_size = args.integer("BatchIterator", dataset.name, "batch_size", batch_size, 1)
        if drop_last and batch_size > len(dataset):
            raise DataError(
                f"batch_size {batch_size} exceeds the {len(dataset)} samples of {dataset.name!r}; with "
                "drop_last=True no batch could ever be formed (lower the batch size or use drop_last=False)"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.reset()

    def reset(self) -> None:
        """Rewind to the state right after construction (same seed -> same batches again)."""
        self._rng = np.random.default_rng(self.seed)
        self._order: np.ndarray | None = None
        self._pos = 0
        self.epoch_index = -1  # index of the epoch the last batch came from; -1 before the first batch
        self._epoch_rng: dict | None = None  # the generator's state just before it drew this epoch's order

    @property
    def batches_per_epoch(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def _has_batch(self) -> bool:
        if self._order is None:
            return False
        n = len(self._order)
        return self._pos + self.batch_size <= n if self.drop_last else self._pos < n

    def _start_epoch(self) -> None:
        n = len(self.dataset)
        if self.shuffle:
            self._epoch_rng = self._rng.bit_generator.state
        self._order = self._rng.permutation(n) if self.shuffle else np.arange(n)
        self._pos = 0
        self.epoch_index += 1

    def _take_indices(self) -> np.ndarray:
        if not self._has_batch():
            self._start_epoch()
        assert self._order is not None
        idx = self._order[self._pos : self._pos + self.batch_size]
        self._batch_key = (self.seed, self.epoch_index, self._pos)  # where this batch stands: its crops, its masks
        self._pos += len(idx)
        return idx

    def _transform(self, x: np.ndarray, y: np.ndarray) -> None:
        """Augment (images) or mask (text) the batch in place, by where it stands in the data order."""
        if self.dataset.augment:
            self.dataset.augment.apply(x, self._batch_key)
        masking = getattr(self.dataset, "masking", None)
        if masking is not None:
            masking.apply(x, y, self._batch_key)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The next batch as new contiguous arrays (x float32 NCHW, y int64)."""
        idx = self._take_indices()
        # Fancy indexing gathers into a fresh C-contiguous array of the source dtype.
        x, y = self.dataset.x[idx], self.dataset.y[idx]
        self._transform(x, y)
        return x, y

    # -- the position in the sequence of batches, as checkpoints keep it -------------------------------------
    def position(self) -> dict:
        """Where the iterator stands, as plain values: the epoch, the samples of it already taken, and the
        generator's state just before it drew that epoch's order (None without shuffling, or before the first
        batch). `seek` goes back to it in one permutation, whatever the number of batches before it."""
        return {"epoch": self.epoch_index, "offset": self._pos, "rng": self._epoch_rng}

    def seek(self, position: dict) -> None:
        """Stand where `position()` said: the same batches follow, bit for bit. Raises ValueError, TypeError or
        KeyError for a position this iterator could not have had (the caller names where it came from)."""
        epoch, offset, rng = position["epoch"], position["offset"], position.get("rng")
        for what, v in (("epoch", epoch), ("offset", offset)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"data position: {what} is {v!r}, not an integer")
        self.reset()
        if epoch < 0:
            if epoch != -1 or offset != 0:
                raise ValueError(f"data position: epoch {epoch}, offset {offset} before the first batch")
            return
        if not 0 <= offset <= len(self.dataset):
            raise ValueError(f"data position: offset {offset} outside the {len(self.dataset)} samples of an epoch")
        if self.shuffle:
            if not isinstance(rng, dict):
                raise TypeError(f"data position: the generator state is {rng!r}, not a state")
            self._rng.bit_generator.state = rng
        self.epoch_index = epoch - 1
        self._start_epoch()
        self._pos = offset

    def skip(self, batches: int) -> None:
        """From the start, stand after `batches` batches, epoch by epoch: one permutation per epoch passed
        (batches // batches_per_epoch of them) instead of taking every batch. For positions kept as a count."""
        self.reset()
        epochs, rest = divmod(int(batches), self.batches_per_epoch)
        for _ in range(epochs):
            self._start_epoch()
            self._pos = len(self._order)  # the epoch is used up; the next batch starts the next one
        if rest:
            self._start_epoch()
            self._pos = rest * self.batch_size

    def next_into(self, x_out: np.ndarray, y_out: np.ndarray) -> None:
        """Write the next batch into caller-provided arrays (e.g. views into an executor's arena).

        The outputs must be exactly (batch_size, C, H, W) float32 and (batch_size,) int64 (a `SequenceDataset`'s:
        (batch_size, T) int64 both): a size or dtype mismatch means the memory plan and the data disagree, and
        converting silently would hide that.
        """
        bs = self.batch_size
        for what, src, out in (("x_out", self.dataset.x, x_out), ("y_out", self.dataset.y, y_out)):
            want = (bs, *src.shape[1:])
            if out.shape != want or out.dtype != src.dtype:
                raise DataError(f"next_into: {what} must be {src.dtype} {want}, got {out.dtype} {tuple(out.shape)}")
        if not self.drop_last and len(self.dataset) % bs:
            raise DataError(
                f"next_into needs full batches, but {len(self.dataset)} samples with batch_size {bs} and "
                "drop_last=False leave a partial last batch; use drop_last=True"
            )
        if not (x_out.flags.writeable and y_out.flags.writeable):
            raise DataError("next_into: output arrays must be writeable")
        idx = self._take_indices()
        for src, out in ((self.dataset.x, x_out), (self.dataset.y, y_out)):
            if out.flags.c_contiguous:
                # mode="clip" lets np.take write straight into `out` (mode="raise" buffers a copy);
                # the indices come from a permutation, so they are always in range.
                np.take(src, idx, axis=0, out=out, mode="clip")
            else:
                out[...] = src[idx]
        self._transform(x_out, y_out)

    def epoch(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield the batches left in the current epoch (a full epoch when at an epoch boundary)."""
        if not self._has_batch():
            self._start_epoch()
        while self._has_batch():
            yield self.next_batch()

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        return self.next_batch()


def from_arrays(x, y, num_classes: int | None = None, name: str = "arrays") -> Dataset:
    """Build a Dataset from user arrays, checking what a loader would otherwise get wrong silently.

    `x` is (N, C, H, W) or (N, H, W) (a channel axis is added), numeric and finite; `y` is (N,) integers
    in [0, num_classes). `num_classes` defaults to max(y) + 1.
    """
    x = check_images(x, f"{name}: x")
    y = check_labels(y, None, f"{name}: y")
    if x.ndim == 3:
        x = x[:, None, :, :]
    elif x.ndim != 4:
        raise DataError(f"{name}: x must be 4-D (N, C, H, W) or 3-D (N, H, W), got shape {x.shape}")
    if y.ndim != 1:
        raise DataError(f"{name}: y must be 1-D (N,), got shape {y.shape}")
    if x.shape[0] != y.shape[0]:
        raise DataError(f"{name}: x has {x.shape[0]} samples but y has {y.shape[0]}")
    if x.shape[0] == 0:
        raise DataError(f"{name}: no samples (N = 0)")
    if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
        raise DataError(f"{name}: x contains NaN or infinite values")
    if y.min() < 0:
        raise DataError(f"{name}: y contains negative label {int(y.min())}")
    if num_classes is None:
        num_classes = int(y.max()) + 1
    return Dataset(x, y, num_classes, name=name)


