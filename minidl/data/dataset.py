"""`Dataset` (float32 NCHW images, int64 labels), the one form every image source produces, and `BatchIterator`.

One layout and dtype pair: the executor plans the data and label tensors from sample shape and batch size alone.
Every random choice comes from ``np.random.default_rng(seed)``: a run is reproducible from its seed.
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

@dataclass(slots=True, eq=False)
class Dataset:
    """Images and labels, made C-contiguous float32/int64 once (batching is a plain gather) and checked here.

    `subset`/`split` drop `augment` (a held-out part is never augmented) and keep `transform` (how stored pixels
    became `x`; a checkpoint records it for `predict`). `source`: the ``--data`` value. Equality is identity.
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

    def __repr__(self) -> str:
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
        """(train, heldout) by a seeded permutation; `fraction_or_count` sizes the held-out part (a float in (0, 1)
        or an int). Both parts non-empty; samples keep their relative order."""
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


class BatchIterator:
    """Endless mini-batches, reshuffled each epoch; a batch's augmentation or masking is drawn from (seed, epoch,
    offset). The sequence depends only on (dataset, batch_size, seed, shuffle, drop_last); ``drop_last`` keeps every
    batch full, so the memory plan holds for every step. `next_into` gathers into the executor's arena views."""

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
        self.epoch_index = -1  # the last batch's epoch; -1 before the first
        self._epoch_rng: dict | None = None  # generator state before this epoch's permutation

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
        self._batch_key = (self.seed, self.epoch_index, self._pos)  # seeds its crops and masks
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
        """The next batch as new contiguous arrays."""
        idx = self._take_indices()
        x, y = self.dataset.x[idx], self.dataset.y[idx]
        self._transform(x, y)
        return x, y

    def position(self) -> dict:
        """Epoch, samples taken of it, generator state before its permutation: `seek` returns in one permutation."""
        return {"epoch": self.epoch_index, "offset": self._pos, "rng": self._epoch_rng}

    def seek(self, position: dict) -> None:
        """Stand where `position()` said (the same batches follow); ValueError/TypeError/KeyError on a bad one."""
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
        """Stand after `batches` batches from the start, drawing one permutation per epoch passed."""
        self.reset()
        epochs, rest = divmod(int(batches), self.batches_per_epoch)
        for _ in range(epochs):
            self._start_epoch()
            self._pos = len(self._order)  # used up: the next batch starts the next epoch
        if rest:
            self._start_epoch()
            self._pos = rest * self.batch_size

    def next_into(self, x_out: np.ndarray, y_out: np.ndarray) -> None:
        """Write the next batch into caller arrays of exactly the batch's shape and dtype: a mismatch means the
        memory plan and the data disagree, and a silent conversion would hide it."""
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
                # mode="clip" writes straight into `out` (mode="raise" buffers a copy); indices are in range
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
    """A Dataset from (N, C, H, W) or (N, H, W) images and (N,) labels; `num_classes` defaults to max(y) + 1."""
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


