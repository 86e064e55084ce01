"""Readers of a user's own data: arrays in `.npz` / `.npy` files, and a folder of images per class.

They read and check; they do not scale. Each returns `Arrays`: the images as stored (uint8 pixels or floats, laid
out (N, C, H, W)), integer labels, the class count, and the held-out part when the files have one. `data.load_data`
turns that into `Dataset`s (pixels scaled and standardized with the training part's statistics, a held-out part
split off when the files have none), so every source is normalized by one piece of code.

Every refusal is a `DataError` naming the file or folder and the values found: a wrong shape, a label outside the
classes, a class folder with no image, images of different sizes. A silently reshaped or relabelled data set
trains, and its accuracy is the only sign, far too late.

Layouts:

* ``npz:PATH`` -- arrays ``x`` (images) and ``y`` (labels), or Keras's ``x_train``/``y_train``; ``x_test`` and
  ``y_test`` when present are the held-out part; an optional scalar ``num_classes`` (else the largest label + 1).
* ``npy:IMAGES.npy,LABELS.npy`` -- the same two arrays in two files.
* ``images:DIR`` -- ``DIR/<class>/<image>`` (torchvision's ImageFolder layout), or ``DIR/train/<class>/...`` with
  ``DIR/test/...`` (or ``DIR/val/...``) as the held-out part. Classes are the folder names in sorted order.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.errors import DataError
from ..core.guards import check_images, check_labels

__all__ = ["Arrays", "read_npz", "read_npy", "read_image_folder", "IMAGE_SUFFIXES"]

# What a class folder's images may be (torchvision's list, less the formats Pillow reads only with plug-ins); other
# files (a README, a .DS_Store) are not images and are left alone.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")

# Pillow modes with one channel: a folder whose images all have one of them loads as (N, 1, H, W).
_GRAY_MODES = ("1", "L", "I", "I;16", "I;16B", "I;16L", "F")


@dataclass(frozen=True, slots=True)
class Arrays:
    """What a file source holds, as stored: images (N, C, H, W) (uint8 pixels or floats), labels int64 (N,),
    the class count, the held-out images and labels when the source has them, and the class names of an
    image folder (None for arrays)."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str
    x_heldout: np.ndarray | None = None
    y_heldout: np.ndarray | None = None
    class_names: tuple[str, ...] | None = None


def _images(x, where: str) -> np.ndarray:
    """(N, C, H, W) images, or (N, H, W) with a channel axis added; a channels-last array is refused with the
    transpose that fixes it (guessing the layout would train on scrambled pixels when the guess is wrong)."""
    x = check_images(x, where)
    if x.ndim == 3:
        return x[:, None, :, :]
    if x.ndim != 4:
        raise DataError(f"{where}: images must be (N, C, H, W) or (N, H, W), got shape {x.shape}")
    if x.shape[3] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        raise DataError(f"{where}: shape {x.shape} looks channels-last (N, H, W, C); store the images as "
                        f"(N, C, H, W), e.g. x.transpose(0, 3, 1, 2)")
    if 0 in x.shape:
        raise DataError(f"{where}: images of shape {x.shape} have an empty dimension")
    return x


def _labels(y, n: int, where: str) -> np.ndarray:
    y = check_labels(y, None, where)
    if y.ndim != 1 or len(y) != n:
        raise DataError(f"{where}: labels must be a 1-D array of {n} integers (one per image), got shape {y.shape}")
    return y.astype(np.int64, copy=False)


def _arrays(x, y, x_test, y_test, num_classes, name: str, where_x: str, where_y: str) -> Arrays:
    """Check the arrays of one source and count its classes."""
    x = _images(x, where_x)
    y = _labels(y, len(x), where_y)
    if len(x) == 0:
        raise DataError(f"{where_x}: no images (N = 0)")
    if x_test is not None:
        x_test = _images(x_test, f"{name}: x_test")
        y_test = _labels(y_test, len(x_test), f"{name}: y_test")
        if x_test.shape[1:] != x.shape[1:]:
            raise DataError(f"{name}: x_test's images are {x_test.shape[1:]}, the training images {x.shape[1:]}")
    found = max(int(y.max()), int(y_test.max()) if y_test is not None and len(y_test) else -1) + 1
    if num_classes is None:
        num_classes = found
    for labels, where in ((y, where_y), (y_test, f"{name}: y_test")):
        if labels is not None:
            check_labels(labels, num_classes, where)
    return Arrays(x, y, int(num_classes), name, x_test, y_test)


def _load(path: Path, what: str):
    if not path.is_file():
        raise DataError(f"{what}: no file at {path}")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:   # not numpy's format, truncated, or object arrays
        raise DataError(f"{path}: not a readable {what} file ({e})") from None


def read_npz(path: str | Path) -> Arrays:
    """Images and labels from one `.npz` (the module docstring lists its arrays)."""
    path = Path(path).expanduser()
    with _load(path, ".npz") as f:
        if not hasattr(f, "files"):
            raise DataError(f"{path}: a single .npy array, not an .npz archive; use npy:IMAGES.npy,LABELS.npy")
        keys = set(f.files)
        for xk, yk in (("x", "y"), ("x_train", "y_train")):
            if xk in keys and yk in keys:
                break
        else:
            raise DataError(f"{path}: needs arrays 'x' and 'y' (or 'x_train' and 'y_train'), has "
                            f"{sorted(keys) or 'none'}")
        has_test = "x_test" in keys or "y_test" in keys
        if has_test and not ("x_test" in keys and "y_test" in keys):
            raise DataError(f"{path}: has {'x_test' if 'x_test' in keys else 'y_test'} without its pair; a "
                            f"held-out part needs both x_test and y_test")
        num_classes = None
        if "num_classes" in keys:
            k = f["num_classes"]
            if k.shape != () or not np.issubdtype(k.dtype, np.integer) or int(k) < 1:
                raise DataError(f"{path}: num_classes must be one integer >= 1, got {k!r}")
            num_classes = int(k)
        return _arrays(f[xk], f[yk], f["x_test"] if has_test else None, f["y_test"] if has_test else None,
                       num_classes, str(path), f"{path}: {xk}", f"{path}: {yk}")


def read_npy(images: str | Path, labels: str | Path) -> Arrays:
    """Images and labels from two `.npy` files."""
    xp, yp = Path(images).expanduser(), Path(labels).expanduser()
    x, y = _load(xp, ".npy"), _load(yp, ".npy")
    for p, a in ((xp, x), (yp, y)):
        if not isinstance(a, np.ndarray):
            a.close()
            raise DataError(f"{p}: an .npz archive, not one .npy array; use npz:{p}")
    return _arrays(x, y, None, None, None, f"{xp},{yp}", str(xp), str(yp))


def _class_folders(root: Path) -> list[Path]:
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist or is not a directory")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise DataError(f"image folder {root} has no class folders; expected {root}/<class>/<image>.png")
    return folders


def _image_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.iterdir()
                   if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise DataError(f"class folder {folder} has no images (looked for {', '.join(IMAGE_SUFFIXES)})")
    return files


def _read_images(files: list[Path], first: tuple[Path, tuple[int, int]] | None) -> tuple[list, bool, tuple]:
    """Pixels (H, W, 3) uint8 of each file, whether all were grayscale, and the (file, size) all must share."""
    from PIL import Image, UnidentifiedImageError

    pixels, gray = [], True
    for p in files:
        try:
            with Image.open(p) as im:
                if first is None:
                    first = (p, im.size)
                if im.size != first[1]:
                    raise DataError(f"{p}: image is {im.size[0]}x{im.size[1]} pixels, but {first[0]} is "
                                    f"{first[1][0]}x{first[1][1]}; every image must have the same size")
                gray = gray and im.mode in _GRAY_MODES
                pixels.append(np.asarray(im.convert("RGB"), dtype=np.uint8))
        except (UnidentifiedImageError, OSError) as e:
            raise DataError(f"{p}: not an image Pillow can read ({e})") from None
    return pixels, gray, first


def read_image_folder(directory: str | Path) -> Arrays:
    """Images from a folder per class (the module docstring gives the layouts), as uint8 (N, C, H, W): one
    channel when every image is grayscale, else RGB (an alpha channel is dropped). Needs Pillow."""
    root = Path(directory).expanduser()
    held = next((root / s for s in ("test", "val") if (root / s).is_dir()), None)
    split = (root / "train").is_dir() and held is not None
    train_root = root / "train" if split else root
    folders = _class_folders(train_root)
    names = tuple(p.name for p in folders)
    first = None
    parts = {}
    for part, part_root in (("train", train_root), ("heldout", held if split else None)):
        if part_root is None:
            continue
        pixels, labels, gray = [], [], True
        for folder in _class_folders(part_root):
            if folder.name not in names:
                raise DataError(f"class folder {folder} has no counterpart in {train_root} (its classes: "
                                f"{', '.join(names)})")
            got, g, first = _read_images(_image_files(folder), first)
            pixels += got
            labels += [names.index(folder.name)] * len(got)
            gray = gray and g
        parts[part] = (pixels, labels, gray)
    gray = all(g for _, _, g in parts.values())

    def stack(pixels):
        x = np.stack(pixels).transpose(0, 3, 1, 2)   # (N, H, W, 3) -> (N, 3, H, W)
        return np.ascontiguousarray(x[:, :1] if gray else x)

    x, y = stack(parts["train"][0]), np.asarray(parts["train"][1], np.int64)
    xh = yh = None
    if "heldout" in parts:
        xh, yh = stack(parts["heldout"][0]), np.asarray(parts["heldout"][1], np.int64)
    return Arrays(x, y, len(names), str(root), xh, yh, names)
