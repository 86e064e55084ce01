"""Data sources for training: in-memory datasets, batching, and loaders for real on-disk formats.

Everything here produces a `Dataset`: float32 images in NCHW layout and int64 labels. One layout and one
dtype pair means the executor can plan the DATA and LABEL tensors once, from `image_shape` and the batch
size alone, whatever the source.

Sources:

* `synthetic` -- random images with learnable labels; no files, so tests and benchmarks run anywhere.
* `digits` -- the 8x8 handwritten digits (UCI optdigits, as scikit-learn bundles them), shipped with
  minidl; a small *real* problem with no download and no extra dependency.
* `load_cifar10` / `load_mnist` -- the canonical binary distributions, parsed strictly, so a truncated or
  mislabeled download fails loudly at load time instead of silently training on garbage.
* `npz:PATH`, `npy:X.npy,Y.npy`, `images:DIR` -- a user's own arrays or folder of images per class
  (`minidl.datafiles` reads and checks them; `from_files` scales and splits them here).
* `stdlib`, `text:PATH` -- byte-level text for language models (`minidl.data_text`: Python's own sources, or a
  user's file), cut into sequences with next-token or masked-token targets: a `SequenceDataset`, batched like
  the images.
* `load_data` -- parses the CLI's ``--data`` value into (train, held-out).

Augmentation (random crops, flips: `minidl.augment`) belongs to a training set (`Dataset.augment`), and
`BatchIterator` applies it to each batch it gathers.

Determinism: every random choice (synthetic images, splits, shuffling) comes from
``np.random.default_rng(seed)``, so a run is reproducible from its seed alone.
"""
from __future__ import annotations

import gzip
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .augment import Augment
from .core.errors import DataError
from .core.guards import check_finite_data, check_images, check_labels
from .data_text import NEXT_TOKEN, SequenceDataset, sequences, stdlib_corpus, text_file
from .datafiles import Arrays, read_image_folder, read_npy, read_npz
from .layers import args

__all__ = [
    "Dataset",
    "BatchIterator",
    "synthetic",
    "from_arrays",
    "digits",
    "load_cifar10",
    "load_mnist",
    "from_files",
    "load_data",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "MNIST_MEAN",
    "MNIST_STD",
]

# The standard per-channel statistics of the CIFAR-10 training set. Using the published constants (rather
# than recomputing them from whatever batch files happen to be present) keeps train and test normalized
# identically and makes results comparable with other code.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081

_CIFAR_RECORD_BYTES = 1 + 3 * 32 * 32
_CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
_CIFAR_TEST_FILE = "test_batch.bin"
_CIFAR_SUBDIR = "cifar-10-batches-bin"

_IDX_IMAGES_MAGIC = 0x00000803  # unsigned byte, 3 dimensions
_IDX_LABELS_MAGIC = 0x00000801  # unsigned byte, 1 dimension

_DIGITS_FILE = Path(__file__).with_name("datasets") / "digits.npz"  # package data, see _digits_arrays


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
    `split` leave it out, so a held-out part is never augmented (set it on the training part).
    """

    x: np.ndarray = field(repr=False)
    y: np.ndarray = field(repr=False)
    num_classes: int
    name: str = "dataset"
    augment: Augment | None = None

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
        """A new Dataset holding copies of the given samples (in the given order)."""
        idx = np.asarray(indices, dtype=np.int64)
        return Dataset(self.x[idx], self.y[idx], self.num_classes, name=name or self.name)

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


# ---------------------------------------------------------------------------------------------------------
# In-memory sources
# ---------------------------------------------------------------------------------------------------------


def _grid_features(x: np.ndarray, grid: int) -> np.ndarray:
    """Mean-pool each channel of NCHW images over a grid x grid layout of blocks -> (N, C*grid*grid).

    Each block mean is multiplied by sqrt(block size), so for standard-normal pixels every feature is
    standard normal again, whatever the image size.
    """
    n, c, h, w = x.shape
    feats = []
    for rows in np.array_split(np.arange(h), grid):
        for cols in np.array_split(np.arange(w), grid):
            block = x[:, :, rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
            feats.append(block.mean(axis=(2, 3), dtype=np.float64) * math.sqrt(len(rows) * len(cols)))
    return np.concatenate(feats, axis=1)


def synthetic(
    num_samples: int = 512,
    image_shape: tuple[int, int, int] = (3, 32, 32),
    num_classes: int = 10,
    seed: int = 0,
) -> Dataset:
    """Standard-normal images whose labels a small convnet can learn exactly.

    The label is ``argmax(features @ W + b)`` where the features are the image's channels mean-pooled
    over a g x g grid of blocks (g = 2 for 3 channels and 10 classes; grown up to 4 so there are at least
    two features per class when possible) and W, b are fixed by the seed. So the labels are a
    deterministic function of the pixels that a conv -> pool -> linear network can represent exactly:
    the loss can go to zero, which makes a training run a real check of the whole stack, not of noise.
    The bias `b` is tuned on the sample so classes come out balanced (a plain random projection leaves
    some classes almost empty); it is part of the fixed labeling function, not noise. Deterministic
    given the arguments.
    """
    n = args.integer("synthetic", None, "num_samples", num_samples, 1)
    shape = args.shape("synthetic", None, "image_shape", image_shape)
    if len(shape) != 3:
        raise DataError(f"synthetic: image_shape must be (C, H, W), got {image_shape}")
    k = args.integer("synthetic", None, "num_classes", num_classes, 1)
    c, h, w = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape), dtype=np.float32)
    grid = 1
    while c * grid * grid < 2 * k and grid < min(h, w, 4):
        grid += 1
    feats = _grid_features(x, grid)
    proj = rng.standard_normal((feats.shape[1], k))
    scores = feats @ proj
    scale = float(scores.std()) or 1.0
    bias = np.zeros(k)
    # Balance the classes: lower the bias of over-represented classes, with a decaying step so it
    # settles. A fixed schedule keeps this deterministic.
    for t in range(300):
        counts = np.bincount(np.argmax(scores + bias, axis=1), minlength=k)
        if counts.max() - counts.min() <= 1:
            break
        bias -= scale * (counts / n - 1.0 / k) * k / (1.0 + t / 10.0)
    y = np.argmax(scores + bias, axis=1).astype(np.int64)
    return Dataset(x, y, k, name="synthetic")


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


def digits(seed: int | None = None) -> Dataset:
    """The 8x8 handwritten digits (UCI optdigits' test set, as scikit-learn bundles it): 1797 images,
    (1, 8, 8), 10 classes; shipped with minidl (``minidl/datasets/digits.npz``), so no download and no
    scikit-learn.

    Pixels (0..16) are scaled to [0, 1], then standardized with the dataset's own mean and std (a single
    channel, so one mean and one std; per-pixel statistics would divide by zero on the always-blank
    border pixels). With a seed, the sample order is shuffled deterministically; without one, it is
    scikit-learn's order (the arrays equal ``sklearn.datasets.load_digits()``'s; a test checks it).
    """
    images, target = _digits_arrays()
    x = images.astype(np.float64) / 16.0
    x = (x - x.mean()) / x.std()
    x = x[:, None, :, :]
    y = target.astype(np.int64)
    if seed is not None:
        perm = np.random.default_rng(seed).permutation(len(y))
        x, y = x[perm], y[perm]
    return Dataset(x, y, 10, name="digits")


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The shipped digits as stored: images uint8 (1797, 8, 8) in 0..16, labels uint8 (1797,).

    Why a copy of our own: the README's first command trains on digits, and a plain ``pip install`` must
    be enough for it; scikit-learn (~40 MB with scipy) for a 45 KB table was the one thing it lacked.
    Provenance and licence: ``minidl/datasets/README.md``.
    """
    with np.load(_DIGITS_FILE) as f:
        return f["images"], f["target"]


# ---------------------------------------------------------------------------------------------------------
# CIFAR-10 (binary version)
# ---------------------------------------------------------------------------------------------------------


def _cifar_dir(directory: str | os.PathLike) -> Path:
    """The directory that holds the .bin files: `directory` itself or its cifar-10-batches-bin/."""
    root = Path(directory).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"CIFAR-10 directory {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"CIFAR-10 path {root} is not a directory")
    names = (*_CIFAR_TRAIN_FILES, _CIFAR_TEST_FILE)
    if any((root / f).is_file() for f in names):
        return root
    sub = root / _CIFAR_SUBDIR
    if sub.is_dir() and any((sub / f).is_file() for f in names):
        return sub
    raise FileNotFoundError(
        f"no CIFAR-10 binary files in {root} or {sub}; expected {', '.join(names)} "
        "(the 'CIFAR-10 binary version' from https://www.cs.toronto.edu/~kriz/cifar.html)"
    )


def _read_cifar_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse one CIFAR-10 batch file -> (uint8 pixels (n, 3, 32, 32), uint8 labels (n,))."""
    size = path.stat().st_size
    if size == 0 or size % _CIFAR_RECORD_BYTES:
        raise DataError(
            f"{path}: size {size} bytes is not a positive multiple of the {_CIFAR_RECORD_BYTES}-byte "
            "CIFAR-10 record (1 label byte + 3072 pixel bytes); the file is truncated or not CIFAR-10 binary"
        )
    raw = np.fromfile(path, dtype=np.uint8).reshape(-1, _CIFAR_RECORD_BYTES)
    labels = raw[:, 0]
    if labels.max() >= 10:
        bad = int(np.argmax(labels >= 10))
        raise DataError(f"{path}: record {bad} has label {int(labels[bad])}, CIFAR-10 labels are 0..9")
    # Each record's 3072 pixel bytes are the R plane, then G, then B, each 32x32 row-major: exactly CHW.
    pixels = raw[:, 1:].reshape(-1, 3, 32, 32)
    return pixels, labels


def load_cifar10(directory: str | os.PathLike, train: bool = True) -> Dataset:
    """Load CIFAR-10 from the official binary files (data_batch_1..5.bin, test_batch.bin).

    `directory` holds the files directly or inside cifar-10-batches-bin/ (the tarball's layout). For the
    training set every data_batch_*.bin that exists is loaded (so a subset of batches works for quick
    experiments); at least one is required. Pixels become float32 ``(x/255 - mean_c) / std_c`` with the
    standard CIFAR-10 channel statistics.
    """
    root = _cifar_dir(directory)
    if train:
        paths = [root / f for f in _CIFAR_TRAIN_FILES if (root / f).is_file()]
        if not paths:
            raise FileNotFoundError(
                f"no CIFAR-10 training batches in {root}; expected one or more of {', '.join(_CIFAR_TRAIN_FILES)}"
            )
    else:
        path = root / _CIFAR_TEST_FILE
        if not path.is_file():
            raise FileNotFoundError(f"CIFAR-10 test file {path} not found; expected {_CIFAR_TEST_FILE} in {root}")
        paths = [path]
    parts = [_read_cifar_file(p) for p in paths]
    pixels = np.concatenate([p for p, _ in parts]) if len(parts) > 1 else parts[0][0]
    labels = np.concatenate([lab for _, lab in parts]) if len(parts) > 1 else parts[0][1]
    mean = np.asarray(CIFAR10_MEAN, dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(CIFAR10_STD, dtype=np.float32).reshape(1, 3, 1, 1)
    x = pixels.astype(np.float32)
    x /= np.float32(255.0)  # in place: the training set is 600 MB as float32, avoid extra temporaries
    x -= mean
    x /= std
    return Dataset(x, labels.astype(np.int64), 10, name="cifar10/" + ("train" if train else "test"))


# ---------------------------------------------------------------------------------------------------------
# MNIST (idx format)
# ---------------------------------------------------------------------------------------------------------


def _find_mnist_file(roots: list[Path], stem: str) -> Path | None:
    """First existing file among stem, stem.gz (and the common 'images.idx3' dotted spelling)."""
    alt = stem.replace("-idx", ".idx")
    for root in roots:
        for name in (stem, stem + ".gz", alt, alt + ".gz"):
            p = root / name
            if p.is_file():
                return p
    return None


def _read_idx(path: Path, magic: int, ndim: int) -> np.ndarray:
    """Parse an idx file (optionally gzipped) -> uint8 array, validating magic, dims and length."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                data = f.read()
        else:
            data = path.read_bytes()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a cut-off stream is EOFError
        raise DataError(f"{path}: cannot decompress ({e}); the file is corrupt or not gzip") from e
    if len(data) < 4:
        raise DataError(f"{path}: {len(data)} bytes is too short for an idx header")
    got = int.from_bytes(data[:4], "big")
    if got != magic:
        kind = "images" if magic == _IDX_IMAGES_MAGIC else "labels"
        raise DataError(
            f"{path}: bad idx magic 0x{got:08x}, expected 0x{magic:08x} (unsigned bytes, {ndim}-D {kind}); "
            "is this the right file, and decompressed if it has no .gz suffix?"
        )
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path}: truncated idx header ({len(data)} bytes, need {header})")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = header + math.prod(dims)
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "has trailing bytes"
        raise DataError(
            f"{path}: file {what}: header declares dims {dims} -> {expected} bytes, file has {len(data)}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def load_mnist(directory: str | os.PathLike, train: bool = True) -> Dataset:
    """Load MNIST from the official idx files, plain or gzipped.

    Looks for ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` in `directory` (or in its
    MNIST/raw/, torchvision's layout). Headers are checked strictly (magic 0x803 / 0x801, dims, byte
    counts, image/label counts agree, labels 0..9). Pixels become float32 ``(x/255 - 0.1307) / 0.3081``,
    shape (N, 1, 28, 28).
    """
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"MNIST directory {root} does not exist or is not a directory")
    roots = [root, root / "MNIST" / "raw"]
    prefix = "train" if train else "t10k"
    img_stem, lbl_stem = f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"
    img_path, lbl_path = _find_mnist_file(roots, img_stem), _find_mnist_file(roots, lbl_stem)
    missing = [s for s, p in ((img_stem, img_path), (lbl_stem, lbl_path)) if p is None]
    if missing:
        raise FileNotFoundError(
            f"MNIST file(s) {', '.join(missing)} (optionally .gz) not found in {root}; "
            f"expected {img_stem}[.gz] and {lbl_stem}[.gz]"
        )
    assert img_path is not None and lbl_path is not None
    images = _read_idx(img_path, _IDX_IMAGES_MAGIC, 3)
    labels = _read_idx(lbl_path, _IDX_LABELS_MAGIC, 1)
    if images.shape[0] != labels.shape[0]:
        raise DataError(
            f"MNIST count mismatch: {img_path} has {images.shape[0]} images, {lbl_path} has {labels.shape[0]} labels"
        )
    if images.shape[0] == 0:
        raise DataError(f"{img_path}: idx file declares 0 images")
    if images.shape[1] == 0 or images.shape[2] == 0:
        raise DataError(f"{img_path}: idx file declares empty images of {images.shape[1]}x{images.shape[2]}")
    if labels.max() >= 10:
        bad = int(np.argmax(labels >= 10))
        raise DataError(f"{lbl_path}: label {int(labels[bad])} at index {bad}; MNIST labels are 0..9")
    x = images[:, None, :, :].astype(np.float32)
    x /= np.float32(255.0)
    x -= np.float32(MNIST_MEAN)
    x /= np.float32(MNIST_STD)
    return Dataset(x, labels.astype(np.int64), 10, name="mnist/" + ("train" if train else "test"))


def _mnist_test_present(directory: str | os.PathLike) -> bool:
    root = Path(directory).expanduser()
    roots = [root, root / "MNIST" / "raw"]
    return any(_find_mnist_file(roots, s) is not None for s in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"))


# ---------------------------------------------------------------------------------------------------------
# CLI entry point
# ---------------------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------------------
# A user's own files (read and checked by minidl.datafiles)
# ---------------------------------------------------------------------------------------------------------


def from_files(arrays: Arrays, seed: int = 0, heldout_fraction: float = 0.2) -> tuple[Dataset, Dataset]:
    """(train, heldout) Datasets from what `minidl.datafiles` read.

    Pixels stored as uint8 are scaled to [0, 1] and standardized per channel with the mean and std of the
    training part (held-out images with the same figures: the held-out set must not inform its own scaling);
    float images are taken as they are (the user normalized them). Without a held-out part in the files,
    `heldout_fraction` of the samples is held out, split by `seed` (as for ``digits``).
    """
    name = Path(arrays.name).name or arrays.name
    if arrays.x_heldout is None:   # split first: the statistics are the training part's alone
        train, held = Dataset(arrays.x, arrays.y, arrays.num_classes, name=name).split(heldout_fraction, seed)
    else:
        train = Dataset(arrays.x, arrays.y, arrays.num_classes, name=f"{name}/train")
        held = Dataset(arrays.x_heldout, arrays.y_heldout, arrays.num_classes, name=f"{name}/heldout")
    if arrays.x.dtype == np.uint8:   # the Datasets hold the bytes as float32 0..255, exactly
        scaled = train.x / np.float32(255.0)
        mean = scaled.mean(axis=(0, 2, 3), dtype=np.float64, keepdims=True)
        std = scaled.std(axis=(0, 2, 3), dtype=np.float64, keepdims=True)
        std[std == 0] = 1.0  # a constant channel (a blank plane) stays zero instead of dividing by zero
        for part in (train, held):
            part.x[...] = (part.x / np.float32(255.0) - mean) / std
    return train, held


def _read_files(kind: str, arg: str, spec: str) -> Arrays:
    if not arg.strip():
        want = {"npz": "npz:PATH.npz", "npy": "npy:IMAGES.npy,LABELS.npy", "images": "images:DIR"}[kind]
        raise DataError(f"--data {kind} needs a path: {want}, got {spec!r}")
    if kind == "npz":
        return read_npz(arg.strip())
    if kind == "npy":
        paths = [a.strip() for a in arg.split(",")]
        if len(paths) != 2 or not all(paths):
            raise DataError(f"--data npy takes two files, images and labels: npy:IMAGES.npy,LABELS.npy, got {spec!r}")
        return read_npy(*paths)
    return read_image_folder(arg.strip())


# ---------------------------------------------------------------------------------------------------------
# CLI entry point
# ---------------------------------------------------------------------------------------------------------

_SPEC_HELP = ("expected one of: synthetic, digits, cifar10:DIR, mnist:DIR, npz:PATH, npy:IMAGES,LABELS, images:DIR; "
              "for a sequence model: stdlib, text:PATH")


def load_data(
    spec: str,
    seed: int = 0,
    *,
    image_shape: tuple[int, int, int] = (3, 32, 32),
    num_classes: int = 10,
    num_samples: int = 512,
    heldout_fraction: float = 0.2,
    augment: Augment | None = None,
    seq: int = 128,
    objective: str = NEXT_TOKEN,
) -> tuple[Dataset | SequenceDataset, Dataset | SequenceDataset | None]:
    """Turn the CLI's ``--data`` value into (train, heldout-or-None).

    * ``synthetic`` -- `synthetic(num_samples, image_shape, num_classes, seed)`; no held-out set (the
      labels are a known function, so held-out accuracy would say nothing new).
    * ``digits`` -- the bundled digits, `heldout_fraction` (20%) held out, split by `seed`.
    * ``cifar10:DIR`` / ``mnist:DIR`` -- the training files for training, the test files as held-out set
      if they are present (None if absent).
    * ``npz:PATH`` / ``npy:IMAGES.npy,LABELS.npy`` / ``images:DIR`` -- a user's arrays or image folder
      (`minidl.datafiles` gives the layouts): their held-out part, or `heldout_fraction` split off by `seed`.

    * ``stdlib`` / ``text:PATH`` -- byte-level text (Python's standard library sources, or the file at PATH) in
      sequences of `seq` tokens with the targets of `objective` (next-token or masked), the last 10% held out
      (`minidl.data_text`).

    `augment` is set on the training set (never on the held-out one). The keyword arguments `image_shape`,
    `num_classes` and `num_samples` only affect ``synthetic``; `heldout_fraction` the sources without a
    held-out part of their own. Real datasets keep their own shapes and class counts.
    """
    if isinstance(spec, str) and spec.strip().partition(":")[0].strip().lower() in ("stdlib", "text"):
        if augment is not None:
            raise DataError(f"--data {spec}: text is not augmented (crops and flips are for images)")
        return _load_text(spec.strip(), seq, objective)
    train, heldout = _load(spec, seed, image_shape, num_classes, num_samples, heldout_fraction)
    train.augment = augment
    return train, heldout


def _load_text(spec: str, seq: int, objective: str) -> tuple[SequenceDataset, SequenceDataset]:
    kind, sep, arg = spec.partition(":")
    if kind.strip().lower() == "stdlib":
        if sep:
            raise DataError(f"--data stdlib takes no ':' argument, got {spec!r}")
        tokens, name = stdlib_corpus()
        return sequences(tokens, seq, name=name, objective=objective)
    if not arg.strip():
        raise DataError(f"--data text needs a file: text:PATH, got {spec!r}")
    return sequences(text_file(arg.strip()), seq, name=Path(arg.strip()).name, objective=objective)


def _load(spec, seed, image_shape, num_classes, num_samples, heldout_fraction) -> tuple[Dataset, Dataset | None]:
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"empty --data value; {_SPEC_HELP}")
    kind, sep, arg = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind == "synthetic":
        if sep:
            raise DataError(f"--data synthetic takes no ':' argument, got {spec!r}")
        return synthetic(num_samples, image_shape, num_classes, seed), None
    if kind == "digits":
        if sep:
            raise DataError(f"--data digits takes no ':' argument, got {spec!r}")
        return digits().split(heldout_fraction, seed)
    if kind in ("npz", "npy", "images"):
        return from_files(_read_files(kind, arg, spec), seed, heldout_fraction)
    if kind in ("cifar10", "mnist"):
        if not arg.strip():
            raise DataError(f"--data {kind} needs a directory: {kind}:DIR, got {spec!r}")
        directory = Path(arg.strip()).expanduser()
        if kind == "cifar10":
            train = load_cifar10(directory, train=True)
            test_present = (_cifar_dir(directory) / _CIFAR_TEST_FILE).is_file()
            return train, (load_cifar10(directory, train=False) if test_present else None)
        train = load_mnist(directory, train=True)
        # Only one of the two t10k files present is a broken download: load_mnist reports which is missing.
        return train, (load_mnist(directory, train=False) if _mnist_test_present(directory) else None)
    raise DataError(f"unknown --data value {spec!r}; {_SPEC_HELP}")
