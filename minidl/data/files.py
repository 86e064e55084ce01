"""Readers of a user's own data: arrays in `.npz` / `.npy` files, and a folder of images per class.

They read and check, never scale: `Arrays` holds (N, C, H, W) images as stored; `data.load_data` scales all sources.
Every refusal is a `DataError` naming the file and the values found: a silently reshaped, rescaled or relabelled
data set trains, and its accuracy is the only sign.
* ``npz:PATH``: ``x``/``y`` or ``x_train``/``y_train``; ``x_test``/``y_test`` held out; optional ``num_classes``.
* ``npy:IMAGES.npy,LABELS.npy``: the same two arrays in two files.
* ``images:DIR``: ``DIR/<class>/<image>`` (ImageFolder), or ``DIR/train/...`` with ``DIR/test`` or ``DIR/val``
  held out; classes in sorted order; images at their depth (uint8, 16-bit or float grayscale), one per folder.
"""
from __future__ import annotations

import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.errors import DataError
from ..core.guards import check_images, check_labels
from .transform import DEPTHS

__all__ = ["Arrays", "read_npz", "read_npy", "read_array", "read_image_folder", "IMAGE_SUFFIXES"]

# torchvision's list less Pillow's plug-in formats; other files in a class folder are ignored
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")

# Pillow modes deeper than 8 bits (one channel) -> the dtype kept; other modes are 8-bit, read as RGB or gray
_DEEP_MODES = {"I;16": np.uint16, "I;16B": np.uint16, "I;16L": np.uint16, "I;16N": np.uint16, "F": np.float32}
_GRAY_MODES = ("1", "L", "I") + tuple(_DEEP_MODES)


@dataclass(frozen=True, slots=True)
class Arrays:
    """A file source as stored: (N, C, H, W) images, int64 labels, held-out part, an image folder's class names."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str
    x_heldout: np.ndarray | None = None
    y_heldout: np.ndarray | None = None
    class_names: tuple[str, ...] | None = None


def _images(x, where: str) -> np.ndarray:
    """(N, C, H, W) images (a channel axis added to (N, H, W)); channels-last and integers other than 8 or 16 bits
    are refused, not guessed."""
    x = check_images(x, where)
    if np.issubdtype(x.dtype, np.integer) and x.dtype.name not in DEPTHS:
        raise DataError(f"{where}: pixels stored as {x.dtype}, which has no depth to scale by: store them as uint8 "
                        f"(0..255) or uint16 (0..65535), which are scaled to [0, 1], or as floats, which are taken as "
                        f"they are")
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
    """Labels as stored (cast after the range check: a uint64 beyond int64 would turn negative)."""
    y = check_labels(y, None, where)
    if y.ndim != 1 or len(y) != n:
        raise DataError(f"{where}: labels must be a 1-D array of {n} integers (one per image), got shape {y.shape}")
    return y


def _arrays(x, y, x_test, y_test, num_classes, name: str, where_x: str, where_y: str) -> Arrays:
    """Check one source; classes: `num_classes`, else largest label + 1, at most the sample count."""
    x = _images(x, where_x)
    y = _labels(y, len(x), where_y)
    if len(x) == 0:
        raise DataError(f"{where_x}: no images (N = 0)")
    parts = [(y, where_y)]
    if x_test is not None:
        x_test = _images(x_test, f"{name}: x_test")
        y_test = _labels(y_test, len(x_test), f"{name}: y_test")
        parts.append((y_test, f"{name}: y_test"))
        if x_test.shape[1:] != x.shape[1:]:
            raise DataError(f"{name}: x_test's images are {x_test.shape[1:]}, the training images {x.shape[1:]}")
        if (x_test.dtype.name in DEPTHS or x.dtype.name in DEPTHS) and x_test.dtype != x.dtype:
            raise DataError(f"{name}: x_test's pixels are {x_test.dtype}, the training images' {x.dtype}: the "
                            f"held-out part must be scaled as the training part is; store both alike")
    if num_classes is None:
        samples = sum(len(labels) for labels, _ in parts)
        for labels, where in parts:
            if len(labels) and int(labels.max()) >= samples:
                i = int(np.argmax(labels))
                raise DataError(f"{where}: label {int(labels[i])} (sample {i}) is outside [0, {samples}): without "
                                f"num_classes in the file the classes are counted from the labels, and more "
                                f"classes than the {samples} labelled samples cannot be right; fix the label, or "
                                f"store num_classes in the file")
        num_classes = max(int(labels.max()) for labels, _ in parts if len(labels)) + 1
    for labels, where in parts:
        check_labels(labels, num_classes, where)
    y = y.astype(np.int64)
    y_test = y_test.astype(np.int64) if y_test is not None else None
    return Arrays(x, y, int(num_classes), name, x_test, y_test)


_PICKLED = "Object arrays cannot be loaded"   # numpy's message for a pickle under allow_pickle=False


def _unreadable(where: str, e: Exception) -> DataError:
    if isinstance(e, ValueError) and _PICKLED in str(e):
        return DataError(f"{where}: holds Python objects (a pickle), not numbers; minidl reads numeric arrays and "
                         f"never unpickles: save the images and labels as numeric arrays (np.save, np.savez)")
    return DataError(f"{where}: not a readable .npy array: damaged or truncated ({type(e).__name__}: {e})")


def _load(path: Path, what: str):
    if not path.is_file():
        raise DataError(f"{what}: no file at {path}")
    try:
        return np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 -- a damaged file raises anything
        if isinstance(e, ValueError) and _PICKLED in str(e):
            raise _unreadable(str(path), e) from None
        raise DataError(f"{path}: not a readable {what} file ({type(e).__name__}: {e})") from None


def _member(f, key: str, path: Path) -> np.ndarray:
    """Member `key`, read whole (CRC checked); damage, a pickle or a non-.npy member is a DataError."""
    where = f"{path}: array {key!r}"
    try:
        a = f[key]
    except Exception as e:  # noqa: BLE001 -- as in _load
        raise _unreadable(where, e) from None
    if not isinstance(a, np.ndarray):   # a member without the .npy header comes as raw bytes
        raise DataError(f"{where}: not an .npy array (the member {key}.npy has no .npy header)")
    return a


def read_array(path: str | Path, what: str) -> np.ndarray:
    """One array from a `.npy` file; `what` names it in errors."""
    path = Path(path).expanduser()
    a = _load(path, what)
    if not isinstance(a, np.ndarray):
        a.close()
        raise DataError(f"{what} {path}: an .npz archive, not one .npy array; save the array alone with np.save")
    return a


def read_npz(path: str | Path) -> Arrays:
    """Images and labels from one `.npz`."""
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
            k = _member(f, "num_classes", path)
            if k.shape != () or not np.issubdtype(k.dtype, np.integer) or int(k) < 1:
                raise DataError(f"{path}: num_classes must be one integer >= 1, got {k!r}")
            num_classes = int(k)
        test = [_member(f, k, path) for k in ("x_test", "y_test")] if has_test else [None, None]
        return _arrays(_member(f, xk, path), _member(f, yk, path), *test, num_classes, str(path), f"{path}: {xk}",
                       f"{path}: {yk}")


def read_npy(images: str | Path, labels: str | Path) -> Arrays:
    """Images and labels from two `.npy` files."""
    xp, yp = Path(images).expanduser(), Path(labels).expanduser()
    for p in (xp, yp):
        if p.is_file() and zipfile.is_zipfile(p):
            raise DataError(f"{p}: an .npz archive, not one .npy array; use npz:{p}")
    x, y = read_array(xp, "images"), read_array(yp, "labels")
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


@dataclass(slots=True)
class _Seen:
    """What the first image fixes for every other."""

    path: Path
    size: tuple[int, int]
    dtype: str
    mode: str


def _pixels(p: Path, im) -> tuple[np.ndarray, str]:
    """(H, W, 3) uint8 or (H, W, 1) uint16/float32 pixels and the dtype name; 32-bit integers and NaN refused."""
    mode = im.mode
    if mode == "I" and im.format == "PNG":   # 16-bit grayscale PNG as Pillow < 10.3 opens it
        mode = "I;16"
    if mode in _DEEP_MODES:
        a = np.asarray(im).astype(_DEEP_MODES[mode])   # I;16B to native order
        if not np.isfinite(a).all():
            r, c = np.argwhere(~np.isfinite(a))[0]
            raise DataError(f"{p}: float image (mode F) holding {a[r, c]} at row {r}, column {c}; clean it")
        return a[:, :, None], a.dtype.name
    if mode in ("I", "I;32", "I;32B", "I;32L"):
        raise DataError(f"{p}: mode {im.mode} (32-bit integer pixels) has no depth to scale by; save it as an 8-bit "
                        f"or a 16-bit image, or as floats (mode F)")
    return np.asarray(im.convert("RGB"), dtype=np.uint8), "uint8"


def _read_images(files: list[Path], first: _Seen | None) -> tuple[list, bool, _Seen]:
    """Pixels (H, W, C) of each file, whether all were gray, and the first's `_Seen`. Pillow's decompression-bomb
    warning is an error: no training image is that large."""
    from PIL import Image

    pixels, gray = [], True
    for p in files:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(p) as im:
                    got, dtype = _pixels(p, im)
                    seen = _Seen(p, im.size, dtype, im.mode)
        except DataError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise DataError(f"{p}: too large to be a training image ({e}); minidl reads images of at most "
                            f"{Image.MAX_IMAGE_PIXELS:,} pixels") from None
        except Exception as e:  # noqa: BLE001 -- a damaged image raises anything
            raise DataError(f"{p}: not an image Pillow can read ({type(e).__name__}: {e})") from None
        if first is None:
            first = seen
        if seen.size != first.size:
            raise DataError(f"{p}: image is {seen.size[0]}x{seen.size[1]} pixels, but {first.path} is "
                            f"{first.size[0]}x{first.size[1]}; every image must have the same size")
        if seen.dtype != first.dtype:
            raise DataError(f"{p}: mode {seen.mode} ({seen.dtype} pixels), but {first.path} is mode {first.mode} "
                            f"({first.dtype}); every image must have the same depth, so that one scale fits all")
        gray = gray and seen.mode in _GRAY_MODES
        pixels.append(got)
    return pixels, gray, first


def read_image_folder(directory: str | Path) -> Arrays:
    """Images from a folder per class, (N, C, H, W) as stored: one channel when all are gray, else RGB (alpha
    dropped). Needs Pillow."""
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
        x = np.stack(pixels).transpose(0, 3, 1, 2)
        return np.ascontiguousarray(x[:, :1] if gray else x)

    x, y = stack(parts["train"][0]), np.asarray(parts["train"][1], np.int64)
    xh = yh = None
    if "heldout" in parts:
        xh, yh = stack(parts["heldout"][0]), np.asarray(parts["heldout"][1], np.int64)
    return Arrays(x, y, len(names), str(root), xh, yh, names)
