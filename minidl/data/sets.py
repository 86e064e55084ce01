"""The standard data sets: `synthetic` (learnable random images, no files), `digits` (the 8x8 handwritten digits
shipped with minidl) and the canonical binary distributions of CIFAR-10 and MNIST, parsed strictly, so a truncated
or mislabeled download fails at load time instead of training on garbage.
"""
from __future__ import annotations

import gzip
import math
import os
from pathlib import Path

import numpy as np

from ..core.errors import DataError
from ..layers import args
from .dataset import Dataset
from .transform import InputTransform

__all__ = ["synthetic", "digits", "load_cifar10", "load_mnist", "CIFAR10_MEAN", "CIFAR10_STD", "MNIST_MEAN",
           "MNIST_STD"]

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


def digits(seed: int | None = None) -> Dataset:
    """The 8x8 handwritten digits (UCI optdigits' test set, as scikit-learn bundles it): 1797 images,
    (1, 8, 8), 10 classes; shipped with minidl (``minidl/data/datasets/digits.npz``), so no download and no
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
    Provenance and licence: ``minidl/data/datasets/README.md``.
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
    transform = InputTransform("uint8", CIFAR10_MEAN, CIFAR10_STD)
    x = transform.normalize(pixels.astype(np.float32))  # in place: the training set is 600 MB as float32
    return Dataset(x, labels.astype(np.int64), 10, name="cifar10/" + ("train" if train else "test"),
                   transform=transform)


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
    transform = InputTransform("uint8", (MNIST_MEAN,), (MNIST_STD,))
    x = transform.normalize(images[:, None, :, :].astype(np.float32))
    return Dataset(x, labels.astype(np.int64), 10, name="mnist/" + ("train" if train else "test"),
                   transform=transform)


def _mnist_test_present(directory: str | os.PathLike) -> bool:
    root = Path(directory).expanduser()
    roots = [root, root / "MNIST" / "raw"]
    return any(_find_mnist_file(roots, s) is not None for s in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"))


