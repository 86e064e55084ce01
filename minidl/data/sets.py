"""The standard data sets: `synthetic`, `digits` (shipped), CIFAR-10 and MNIST's binary files, parsed strictly:
a truncated or mislabeled download fails at load time."""
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

# the published training-set statistics (not recomputed from the files present): train and test alike
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

_DIGITS_FILE = Path(__file__).with_name("datasets") / "digits.npz"  # provenance: datasets/README.md


def _grid_features(x: np.ndarray, grid: int) -> np.ndarray:
    """Block means over a grid x grid of each channel -> (N, C*grid*grid), times sqrt(block size): features of
    standard-normal pixels stay standard normal."""
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
    """Standard-normal images labelled ``argmax(grid block means @ W + b)``, W from the seed: a conv -> pool ->
    linear net can fit them exactly, so training checks the whole stack. `b` balances the classes."""
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
    # lower over-represented classes' bias, with a decaying step (fixed schedule: deterministic)
    for t in range(300):
        counts = np.bincount(np.argmax(scores + bias, axis=1), minlength=k)
        if counts.max() - counts.min() <= 1:
            break
        bias -= scale * (counts / n - 1.0 / k) * k / (1.0 + t / 10.0)
    y = np.argmax(scores + bias, axis=1).astype(np.int64)
    return Dataset(x, y, k, name="synthetic")


def digits(seed: int | None = None) -> Dataset:
    """scikit-learn's 8x8 digits (1797, 1x8x8, 10 classes), shipped; standardized by one mean and std (per-pixel
    statistics would divide by zero on the blank border). Shuffled by `seed`, else scikit-learn's order."""
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
    """uint8 images (1797, 8, 8) in 0..16 and labels: our copy, so README's first command needs no scikit-learn."""
    with np.load(_DIGITS_FILE) as f:
        return f["images"], f["target"]



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
    # a record's pixels are the R, G, B planes row-major: CHW
    pixels = raw[:, 1:].reshape(-1, 3, 32, 32)
    return pixels, labels


def load_cifar10(directory: str | os.PathLike, train: bool = True) -> Dataset:
    """CIFAR-10's binary files in `directory` or its cifar-10-batches-bin/; training loads every data_batch_*.bin
    present (at least one). Pixels become ``(x/255 - mean_c) / std_c``."""
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
    """MNIST's idx files, plain or gzipped, in `directory` or its MNIST/raw/ (torchvision's layout), headers
    checked strictly. Pixels become ``(x/255 - 0.1307) / 0.3081``, (N, 1, 28, 28)."""
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


