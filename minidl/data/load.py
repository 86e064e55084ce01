"""``--data SPEC`` to (train, held-out). `from_files` is the one place a user's files are scaled and split."""
from __future__ import annotations

from pathlib import Path

from ..core.errors import DataError
from .augment import Augment
from .dataset import Dataset
from .files import Arrays, read_image_folder, read_npy, read_npz
from .sets import _CIFAR_TEST_FILE, _cifar_dir, _mnist_test_present, digits, load_cifar10, load_mnist, synthetic
from .text import NEXT_TOKEN, SequenceDataset, sequences, stdlib_corpus, text_file
from .transform import DEPTHS, InputTransform

__all__ = ["from_files", "load_data", "data_paths", "is_text"]


def from_files(arrays: Arrays, seed: int = 0, heldout_fraction: float = 0.2,
               transform: InputTransform | None = None) -> tuple[Dataset, Dataset]:
    """(train, heldout): uint8/uint16 pixels scaled to [0, 1] and standardized by the training part's statistics
    (or a checkpoint's `transform`); floats taken as they are. Without a held-out part, `heldout_fraction` is split
    off by `seed`."""
    name = Path(arrays.name).name or arrays.name
    if arrays.x_heldout is None:   # split first: the statistics are the training part's alone
        train, held = Dataset(arrays.x, arrays.y, arrays.num_classes, name=name).split(heldout_fraction, seed)
    else:
        train = Dataset(arrays.x, arrays.y, arrays.num_classes, name=f"{name}/train")
        held = Dataset(arrays.x_heldout, arrays.y_heldout, arrays.num_classes, name=f"{name}/heldout")
    if transform is not None:
        transform.check(arrays.x, arrays.name)
    elif arrays.x.dtype.name in DEPTHS:   # stored values are exact in float32
        transform = InputTransform.fit(train.x, arrays.x.dtype.name)
    if transform is not None:
        for part in (train, held):
            part.transform = transform
            transform.normalize(part.x)
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
    transform: InputTransform | None = None,
) -> tuple[Dataset | SequenceDataset, Dataset | SequenceDataset | None]:
    """The CLI's ``--data`` value as (train, heldout or None). ``synthetic`` has no held-out set (its labels are a
    known function); cifar10/mnist hold out their test files when present. `image_shape`, `num_classes` and
    `num_samples` shape ``synthetic`` only. `transform` (a checkpoint's) scales a user's files; any other source
    must already match it."""
    if is_text(spec):
        if augment is not None:
            raise DataError(f"--data {spec}: text is not augmented (crops and flips are for images)")
        if transform is not None:
            raise DataError(f"--data {spec} is text, but the network was trained on images ({transform.describe()})")
        train, heldout = _load_text(spec.strip(), seq, objective)
    else:
        train, heldout = _load(spec, seed, image_shape, num_classes, num_samples, heldout_fraction, transform)
        if transform is not None and train.transform != transform:
            own = train.transform.describe() if train.transform is not None else "floats, as the source gives them"
            raise DataError(f"--data {spec} holds {own}, but the network was trained on {transform.describe()}: "
                            f"give it data of that kind")
        train.augment = augment
    for part in (train, heldout):
        if part is not None:
            part.source = spec.strip()
    return train, heldout


def is_text(spec) -> bool:
    """Whether a ``--data`` value names text rather than images."""
    return isinstance(spec, str) and spec.strip().partition(":")[0].strip().lower() in ("stdlib", "text")


def data_paths(spec: str) -> list[Path]:
    """The paths a ``--data`` value reads (the CLI refuses an output over one)."""
    kind, _, arg = spec.strip().partition(":") if isinstance(spec, str) else ("", "", "")
    kind, arg = kind.strip().lower(), arg.strip()
    if not arg or kind not in ("npz", "npy", "images", "cifar10", "mnist", "text"):
        return []
    parts = [a.strip() for a in arg.split(",")] if kind == "npy" else [arg]
    return [Path(a).expanduser() for a in parts if a]


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


def _load(spec, seed, image_shape, num_classes, num_samples, heldout_fraction,
          transform) -> tuple[Dataset, Dataset | None]:
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
        return from_files(_read_files(kind, arg, spec), seed, heldout_fraction, transform)
    if kind in ("cifar10", "mnist"):
        if not arg.strip():
            raise DataError(f"--data {kind} needs a directory: {kind}:DIR, got {spec!r}")
        directory = Path(arg.strip()).expanduser()
        if kind == "cifar10":
            train = load_cifar10(directory, train=True)
            test_present = (_cifar_dir(directory) / _CIFAR_TEST_FILE).is_file()
            return train, (load_cifar10(directory, train=False) if test_present else None)
        train = load_mnist(directory, train=True)
        # one t10k file of two is a broken download: load_mnist names the missing one
        return train, (load_mnist(directory, train=False) if _mnist_test_present(directory) else None)
    raise DataError(f"unknown --data value {spec!r}; {_SPEC_HELP}")

