"""Tests of minidl.data: real-format files written here, loaded back, and checked value by value."""
from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from minidl.data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    BatchIterator,
    Dataset,
    digits,
    from_arrays,
    load_cifar10,
    load_data,
    load_mnist,
    synthetic,
)

# ---------------------------------------------------------------------------------------------------------
# helpers that write the real on-disk formats
# ---------------------------------------------------------------------------------------------------------


def make_cifar_records(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, bytes]:
    """n random CIFAR-10 records -> (pixels uint8 (n, 3072), labels uint8 (n,), file bytes)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    pixels = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    raw = np.concatenate([labels[:, None], pixels], axis=1)
    return pixels, labels, raw.tobytes()


def write_cifar(directory, name: str, n: int, seed: int):
    pixels, labels, blob = make_cifar_records(n, seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(blob)
    return pixels, labels


def cifar_expected(pixels: np.ndarray) -> np.ndarray:
    x = pixels.reshape(-1, 3, 32, 32).astype(np.float64) / 255.0
    mean = np.array(CIFAR10_MEAN).reshape(1, 3, 1, 1)
    std = np.array(CIFAR10_STD).reshape(1, 3, 1, 1)
    return (x - mean) / std


def idx_bytes(arr: np.ndarray, magic: int) -> bytes:
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def write_idx(path, arr: np.ndarray, magic: int, gz: bool = False) -> None:
    data = idx_bytes(arr, magic)
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def write_mnist(directory, prefix: str, n: int, seed: int, gz: bool = False):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    directory.mkdir(parents=True, exist_ok=True)
    write_idx(directory / f"{prefix}-images-idx3-ubyte", images, 0x803, gz)
    write_idx(directory / f"{prefix}-labels-idx1-ubyte", labels, 0x801, gz)
    return images, labels


# ---------------------------------------------------------------------------------------------------------
# CIFAR-10
# ---------------------------------------------------------------------------------------------------------


def test_cifar10_exact_pixels_labels_and_normalization(tmp_path):
    pixels, labels = write_cifar(tmp_path, "data_batch_1.bin", 20, seed=1)
    ds = load_cifar10(tmp_path, train=True)
    assert ds.x.shape == (20, 3, 32, 32) and ds.x.dtype == np.float32 and ds.x.flags.c_contiguous
    assert ds.y.dtype == np.int64 and ds.num_classes == 10 and ds.image_shape == (3, 32, 32)
    np.testing.assert_array_equal(ds.y, labels.astype(np.int64))
    np.testing.assert_allclose(ds.x, cifar_expected(pixels), rtol=1e-5, atol=1e-5)
    # One pixel by hand: record 7, green channel, row 5, column 11 -> byte 1 + 1024*1 + 32*5 + 11.
    raw = (tmp_path / "data_batch_1.bin").read_bytes()
    byte = raw[7 * 3073 + 1 + 1024 + 32 * 5 + 11]
    assert ds.x[7, 1, 5, 11] == pytest.approx((byte / 255 - 0.4822) / 0.2435, abs=1e-5)
    assert ds.y[7] == raw[7 * 3073]


def test_cifar10_test_file_and_subdirectory_and_multiple_batches(tmp_path):
    sub = tmp_path / "cifar-10-batches-bin"
    p1, l1 = write_cifar(sub, "data_batch_1.bin", 20, seed=1)
    p3, l3 = write_cifar(sub, "data_batch_3.bin", 5, seed=3)
    pt, lt = write_cifar(sub, "test_batch.bin", 20, seed=9)
    train = load_cifar10(tmp_path)  # parent directory: finds the cifar-10-batches-bin/ layout
    np.testing.assert_array_equal(train.y, np.concatenate([l1, l3]))
    np.testing.assert_allclose(train.x, cifar_expected(np.concatenate([p1, p3])), atol=1e-5)
    test = load_cifar10(sub, train=False)
    np.testing.assert_array_equal(test.y, lt)
    np.testing.assert_allclose(test.x, cifar_expected(pt), atol=1e-5)


def test_cifar10_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_cifar10(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="data_batch_1.bin"):
        load_cifar10(tmp_path)  # empty directory: names the expected files
    write_cifar(tmp_path, "test_batch.bin", 3, seed=0)
    with pytest.raises(FileNotFoundError, match="no CIFAR-10 training batches.*data_batch_5.bin"):
        load_cifar10(tmp_path, train=True)
    # truncated record
    (tmp_path / "data_batch_1.bin").write_bytes(make_cifar_records(2, 0)[2][:-1])
    with pytest.raises(ValueError, match="not a positive multiple of the 3073"):
        load_cifar10(tmp_path)
    # bad label
    raw = bytearray(make_cifar_records(2, 0)[2])
    raw[3073] = 10
    (tmp_path / "data_batch_1.bin").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="record 1 has label 10"):
        load_cifar10(tmp_path)


def test_cifar10_missing_test_file(tmp_path):
    write_cifar(tmp_path, "data_batch_2.bin", 2, seed=0)
    with pytest.raises(FileNotFoundError, match="test_batch.bin"):
        load_cifar10(tmp_path, train=False)


# ---------------------------------------------------------------------------------------------------------
# MNIST
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_exact_values(tmp_path, gz):
    images, labels = write_mnist(tmp_path, "train", 6, seed=2, gz=gz)
    test_images, test_labels = write_mnist(tmp_path, "t10k", 4, seed=3, gz=gz)
    ds = load_mnist(tmp_path, train=True)
    assert ds.x.shape == (6, 1, 28, 28) and ds.x.dtype == np.float32 and ds.num_classes == 10
    np.testing.assert_array_equal(ds.y, labels.astype(np.int64))
    expected = (images.astype(np.float64) / 255 - 0.1307) / 0.3081
    np.testing.assert_allclose(ds.x[:, 0], expected, atol=1e-5)
    assert ds.x[4, 0, 27, 3] == pytest.approx((images[4, 27, 3] / 255 - 0.1307) / 0.3081, abs=1e-5)
    test = load_mnist(tmp_path, train=False)
    np.testing.assert_array_equal(test.y, test_labels)
    np.testing.assert_allclose(test.x[:, 0], (test_images / 255 - 0.1307) / 0.3081, atol=1e-5)


def test_mnist_bad_magic(tmp_path):
    write_mnist(tmp_path, "train", 3, seed=0)
    images = np.zeros((3, 28, 28), np.uint8)
    write_idx(tmp_path / "train-images-idx3-ubyte", images, 0x801)  # label magic in the image file
    with pytest.raises(ValueError, match="bad idx magic 0x00000801, expected 0x00000803"):
        load_mnist(tmp_path)


def test_mnist_gzipped_file_without_gz_suffix_is_reported(tmp_path):
    write_mnist(tmp_path, "train", 3, seed=0)
    path = tmp_path / "train-labels-idx1-ubyte"
    path.write_bytes(gzip.compress(path.read_bytes()))
    with pytest.raises(ValueError, match="bad idx magic"):
        load_mnist(tmp_path)


def test_mnist_truncated_and_trailing(tmp_path):
    write_mnist(tmp_path, "train", 3, seed=0)
    path = tmp_path / "train-images-idx3-ubyte"
    good = path.read_bytes()
    path.write_bytes(good[:-5])
    with pytest.raises(ValueError, match="truncated"):
        load_mnist(tmp_path)
    path.write_bytes(good + b"\0")
    with pytest.raises(ValueError, match="trailing bytes"):
        load_mnist(tmp_path)
    path.write_bytes(good[:10])
    with pytest.raises(ValueError, match="truncated idx header"):
        load_mnist(tmp_path)


def test_mnist_truncated_gzip(tmp_path):
    write_mnist(tmp_path, "train", 3, seed=0, gz=True)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:30])
    with pytest.raises(ValueError, match="cannot decompress"):
        load_mnist(tmp_path)


def test_mnist_count_mismatch_and_bad_label(tmp_path):
    write_mnist(tmp_path, "train", 3, seed=0)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([1, 2], np.uint8), 0x801)
    with pytest.raises(ValueError, match="3 images.*2 labels"):
        load_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([1, 12, 3], np.uint8), 0x801)
    with pytest.raises(ValueError, match="label 12 at index 1"):
        load_mnist(tmp_path)


def test_mnist_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_mnist(tmp_path / "nope")
    write_mnist(tmp_path, "train", 2, seed=0)
    (tmp_path / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte"):
        load_mnist(tmp_path)
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        load_mnist(tmp_path, train=False)


# ---------------------------------------------------------------------------------------------------------
# load_data
# ---------------------------------------------------------------------------------------------------------


def test_load_data_specs(tmp_path):
    train, held = load_data("synthetic", seed=3, image_shape=(1, 8, 8), num_classes=4, num_samples=40)
    assert held is None and train.x.shape == (40, 1, 8, 8) and train.num_classes == 4
    assert load_data("synthetic", seed=0)[0].x.shape == (512, 3, 32, 32)

    write_cifar(tmp_path / "c", "data_batch_1.bin", 20, seed=1)
    train, held = load_data(f"cifar10:{tmp_path / 'c'}", seed=0)
    assert len(train) == 20 and held is None
    write_cifar(tmp_path / "c", "test_batch.bin", 20, seed=2)
    train, held = load_data(f"cifar10:{tmp_path / 'c'}", seed=0)
    assert len(held) == 20

    write_mnist(tmp_path / "m", "train", 5, seed=1, gz=True)
    train, held = load_data(f"mnist:{tmp_path / 'm'}", seed=0)
    assert len(train) == 5 and held is None
    write_mnist(tmp_path / "m", "t10k", 3, seed=2)
    assert len(load_data(f"MNIST:{tmp_path / 'm'}", seed=0)[1]) == 3
    # half a test set is a broken download, not "no test set"
    (tmp_path / "m" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        load_data(f"mnist:{tmp_path / 'm'}", seed=0)


@pytest.mark.parametrize("spec,match", [
    ("", "empty"),
    ("imagenet", "unknown --data"),
    ("cifar10", "needs a directory"),
    ("mnist:", "needs a directory"),
    ("synthetic:5", "takes no"),
])
def test_load_data_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        load_data(spec, seed=0)


def test_load_data_digits_split():
    train, held = load_data("digits", seed=5)
    assert len(train) + len(held) == 1797 and len(held) == round(0.2 * 1797)
    train2, held2 = load_data("digits", seed=5)
    np.testing.assert_array_equal(held.x, held2.x)
    np.testing.assert_array_equal(train.y, train2.y)
    _, held3 = load_data("digits", seed=6)
    assert not np.array_equal(held.y, held3.y) or not np.array_equal(held.x, held3.x)


# ---------------------------------------------------------------------------------------------------------
# digits, Dataset, from_arrays
# ---------------------------------------------------------------------------------------------------------


def test_digits():
    ds = digits()
    assert ds.x.shape == (1797, 1, 8, 8) and ds.x.dtype == np.float32
    assert ds.num_classes == 10 and set(np.unique(ds.y)) == set(range(10))
    assert abs(float(ds.x.mean())) < 1e-4 and abs(float(ds.x.std()) - 1) < 1e-4
    from sklearn.datasets import load_digits

    raw = load_digits().images / 16.0
    np.testing.assert_allclose(ds.x[:, 0], (raw - raw.mean()) / raw.std(), atol=1e-5)
    a, b = digits(seed=1), digits(seed=1)
    np.testing.assert_array_equal(a.x, b.x)
    assert sorted(a.y.tolist()) == sorted(ds.y.tolist())


def test_digits_shipped_copy_equals_scikit_learns():
    """The bundled npz is scikit-learn's digits, so `--data digits` gives the very arrays it gave when it
    read them from scikit-learn (the old code path, recomputed here, bit for bit, with and without a seed)."""
    sk = pytest.importorskip("sklearn.datasets")
    bunch = sk.load_digits()
    for seed in (None, 3):
        x = bunch.images.astype(np.float64) / 16.0
        x = ((x - x.mean()) / x.std())[:, None, :, :]
        y = bunch.target.astype(np.int64)
        if seed is not None:
            perm = np.random.default_rng(seed).permutation(len(y))
            x, y = x[perm], y[perm]
        ds = digits(seed)
        np.testing.assert_array_equal(ds.x, x.astype(np.float32))
        np.testing.assert_array_equal(ds.y, y)


def test_split_deterministic_and_disjoint():
    x = np.arange(50, dtype=np.float32).reshape(50, 1, 1, 1)
    ds = Dataset(x, np.arange(50) % 5, 5)
    tr, he = ds.split(0.2, seed=0)
    assert len(tr) == 40 and len(he) == 10
    assert sorted(np.concatenate([tr.x.ravel(), he.x.ravel()]).tolist()) == list(range(50))
    tr2, he2 = ds.split(0.2, seed=0)
    np.testing.assert_array_equal(he.x, he2.x)
    assert not np.array_equal(he.x, ds.split(0.2, seed=1)[1].x)
    tr3, he3 = ds.split(7, seed=0)
    assert len(he3) == 7 and len(tr3) == 43
    np.testing.assert_array_equal(tr.y, tr.x.ravel().astype(int) % 5)  # labels stay with their images
    for bad in (0, 50, 1.0, 0.0):
        with pytest.raises(ValueError):
            ds.split(bad)


def test_dataset_validation():
    x = np.zeros((4, 1, 2, 2), np.float32)
    with pytest.raises(ValueError, match="outside"):
        Dataset(x, np.array([0, 1, 2, 3]), 3)
    with pytest.raises(ValueError, match="4-D"):
        Dataset(x[:, 0], np.zeros(4, int), 2)
    with pytest.raises(ValueError, match="integers"):
        Dataset(x, np.zeros(4), 2)


def test_from_arrays():
    ds = from_arrays(np.ones((5, 3, 4), np.uint8), np.array([0, 2, 1, 0, 2], np.int32))
    assert ds.x.shape == (5, 1, 3, 4) and ds.x.dtype == np.float32 and ds.y.dtype == np.int64
    assert ds.num_classes == 3 and ds.image_shape == (1, 3, 4)
    assert from_arrays(np.ones((2, 2, 3, 3)), [0, 1], num_classes=10).num_classes == 10
    cases = [
        ((np.ones((5, 4)), np.zeros(5, int)), "4-D"),
        ((np.ones((5, 2, 2)), np.zeros((5, 1), int)), "1-D"),
        ((np.ones((5, 2, 2)), np.zeros(5)), "integer"),
        ((np.ones((5, 2, 2)), np.zeros(4, int)), "5 samples but y has 4"),
        ((np.ones((2, 2, 2)), np.array([0, -1])), "negative"),
        ((np.full((2, 2, 2), np.nan), np.array([0, 1])), "NaN"),
        ((np.array([["a"]] * 2).reshape(2, 1, 1), np.array([0, 1])), "numeric"),
    ]
    for (x, y), match in cases:
        with pytest.raises(ValueError, match=match):
            from_arrays(x, y)
    with pytest.raises(ValueError, match="label 3 is outside"):
        from_arrays(np.ones((2, 2, 2)), [0, 3], num_classes=3)


# ---------------------------------------------------------------------------------------------------------
# synthetic
# ---------------------------------------------------------------------------------------------------------


def test_synthetic_deterministic_balanced_and_learnable():
    a = synthetic(400, (3, 8, 8), 5, seed=7)
    b = synthetic(400, (3, 8, 8), 5, seed=7)
    c = synthetic(400, (3, 8, 8), 5, seed=8)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    assert not np.array_equal(a.x, c.x)
    assert a.x.dtype == np.float32 and a.x.shape == (400, 3, 8, 8) and a.num_classes == 5
    assert abs(float(a.x.mean())) < 0.05 and abs(float(a.x.std()) - 1) < 0.05
    counts = np.bincount(a.y, minlength=5)
    assert counts.min() >= 60  # balanced: 80 each ideally
    # Learnable: a linear model on 2x2 mean-pooled channels fits the labels (they are an argmax of one).
    from sklearn.linear_model import LogisticRegression

    pooled = a.x.reshape(400, 3, 2, 4, 2, 4).mean(axis=(3, 5)).reshape(400, -1)
    acc = LogisticRegression(C=1e4, max_iter=5000).fit(pooled, a.y).score(pooled, a.y)
    assert acc > 0.95


def test_synthetic_arg_errors():
    with pytest.raises(ValueError):
        synthetic(0, (3, 8, 8), 10, 0)
    with pytest.raises(ValueError):
        synthetic(10, (8, 8), 10, 0)


# ---------------------------------------------------------------------------------------------------------
# BatchIterator
# ---------------------------------------------------------------------------------------------------------


def small_dataset(n: int = 10) -> Dataset:
    x = np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1) * np.ones((1, 2, 2, 2), np.float32)
    return Dataset(x, np.arange(n) % 3, 3)


def ids(xb: np.ndarray) -> list[int]:
    return xb[:, 0, 0, 0].astype(int).tolist()


def test_batch_iterator_deterministic_and_contiguous():
    ds = small_dataset()
    a = [ids(BatchIterator(ds, 3, seed=4).next_batch()[0])]
    it1, it2 = BatchIterator(ds, 3, seed=4), BatchIterator(ds, 3, seed=4)
    seq1 = [ids(next(it1)[0]) for _ in range(10)]
    seq2 = [ids(it2.next_batch()[0]) for _ in range(10)]
    assert seq1 == seq2 and seq1[0] == a[0]
    assert seq1 != [ids(next(BatchIterator(ds, 3, seed=5))[0]) for _ in range(10)]
    xb, yb = BatchIterator(ds, 3, seed=4).next_batch()
    assert xb.shape == (3, 2, 2, 2) and xb.dtype == np.float32 and xb.flags.c_contiguous
    assert yb.dtype == np.int64 and yb.flags.c_contiguous
    np.testing.assert_array_equal(yb, np.array(ids(xb)) % 3)  # labels follow their images
    it1.reset()
    assert [ids(next(it1)[0]) for _ in range(10)] == seq1


def test_batch_iterator_epochs_reshuffle_and_cover():
    ds = small_dataset(12)
    it = BatchIterator(ds, 4, seed=0)
    assert it.batches_per_epoch == 3 == len(it)
    epochs = [sum((ids(x) for x, _ in it.epoch()), []) for _ in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(12))  # each epoch is a permutation
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert it.epoch_index == 2
    # drop_last: 10 samples, batch 4 -> 2 batches per epoch, 2 samples dropped, then a new epoch
    it = BatchIterator(small_dataset(10), 4, seed=0)
    first = [ids(x) for x, _ in it.epoch()]
    assert len(first) == 2 and len(set(sum(first, []))) == 8
    next(it)
    assert it.epoch_index == 1


def test_batch_iterator_no_shuffle_and_partial_last():
    it = BatchIterator(small_dataset(10), 4, seed=0, shuffle=False, drop_last=False)
    assert it.batches_per_epoch == 3
    assert [ids(x) for x, _ in it.epoch()] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert ids(next(it)[0]) == [0, 1, 2, 3]


def test_batch_iterator_next_into_arena_views():
    ds = small_dataset(12)
    arena = np.zeros(4096, dtype=np.uint8)
    x_out = arena[:4 * 8 * 4].view(np.float32).reshape(4, 2, 2, 2)
    y_out = arena[1024:1024 + 4 * 8].view(np.int64)
    ref = BatchIterator(ds, 4, seed=9)
    it = BatchIterator(ds, 4, seed=9)
    for _ in range(7):  # crosses epoch boundaries
        xr, yr = ref.next_batch()
        assert it.next_into(x_out, y_out) is None
        np.testing.assert_array_equal(x_out, xr)
        np.testing.assert_array_equal(y_out, yr)
    assert x_out.base is not None and np.shares_memory(x_out, arena)
    # non-contiguous outputs work too
    big = np.zeros((4, 2, 2, 4), np.float32)
    yb = np.zeros(8, np.int64)
    xr, yr = ref.next_batch()
    it.next_into(big[..., ::2], yb[::2])
    np.testing.assert_array_equal(big[..., ::2], xr)
    np.testing.assert_array_equal(yb[::2], yr)


def test_batch_iterator_next_into_errors():
    it = BatchIterator(small_dataset(12), 4, seed=0)
    with pytest.raises(ValueError, match="x_out must be float32"):
        it.next_into(np.zeros((3, 2, 2, 2), np.float32), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="x_out must be float32"):
        it.next_into(np.zeros((4, 2, 2, 2), np.float64), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="y_out must be int64"):
        it.next_into(np.zeros((4, 2, 2, 2), np.float32), np.zeros(4, np.int32))
    it = BatchIterator(small_dataset(10), 4, seed=0, drop_last=False)
    with pytest.raises(ValueError, match="drop_last=True"):
        it.next_into(np.zeros((4, 2, 2, 2), np.float32), np.zeros(4, np.int64))


def test_batch_iterator_arg_errors():
    with pytest.raises(ValueError, match="exceeds"):
        BatchIterator(small_dataset(3), 4, seed=0)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        BatchIterator(small_dataset(3), 0, seed=0)
    assert BatchIterator(small_dataset(3), 4, seed=0, drop_last=False).next_batch()[0].shape[0] == 3


def test_counts_and_shapes_are_integers_never_truncated():
    """A float count or size is refused with an OptionError naming the argument, not read as int(2.7) = 2."""
    import minidl as dl

    cases = [
        (lambda: synthetic(10.5, (1, 4, 4), 3), "synthetic: num_samples must be an integer >= 1, got 10.5"),
        (lambda: synthetic(10, (1, 4.5, 4), 3), "synthetic: image_shape must be .* entry 1 is 4.5"),
        (lambda: synthetic(10, (1, 4, 4), 2.9), "synthetic: num_classes must be an integer >= 1, got 2.9"),
        (lambda: synthetic(10, (1, 4, 4), True), "num_classes must be an integer >= 1, got True"),
        (lambda: Dataset(np.zeros((2, 1, 2, 2)), np.array([0, 1]), 2.5, name="d"),
         "Dataset 'd': num_classes must be an integer >= 1, got 2.5"),
        (lambda: BatchIterator(small_dataset(4), 2.0), "batch_size must be an integer >= 1, got 2.0"),
    ]
    for make, match in cases:
        with pytest.raises(dl.OptionError, match=match):
            make()
    assert synthetic(np.int64(6), (np.int32(1), 4, 4), np.int16(3)).num_classes == 3
