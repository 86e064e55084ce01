"""A user's own data: `.npz`/`.npy` arrays and folders of images per class (written here), their refusals, and the
crops and flips of training batches."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

import minidl as dl
from minidl.cli import main
from minidl.core.errors import DataError, OptionError
from minidl.data import BatchIterator, Dataset, load_data
from minidl.data.augment import Augment, parse_augment
from minidl.data.files import read_image_folder, read_npz


def pixels(n: int, seed: int, shape=(3, 8, 8)) -> tuple[np.ndarray, np.ndarray]:
    """n uint8 images whose class (0..2) is which third of the image is bright: learnable in a few steps."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.integers(0, 60, (n, *shape), dtype=np.uint8)
    w = shape[2] // 3
    for i, c in enumerate(y):
        x[i, :, :, c * w:(c + 1) * w] += 180
    return x, y.astype(np.int64)


def write_folder(root, x: np.ndarray, y: np.ndarray, names=("cat", "dog", "emu")) -> None:
    for i, (img, c) in enumerate(zip(x, y)):
        d = root / names[c]
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.ascontiguousarray(img.transpose(1, 2, 0).squeeze(axis=2) if img.shape[0] == 1
                                             else img.transpose(1, 2, 0))).save(d / f"{i:04d}.png")


# -- arrays ---------------------------------------------------------------------------------------------------


def test_npz_with_a_test_part_is_standardized_by_the_training_part(tmp_path):
    x, y = pixels(40, 0)
    xt, yt = pixels(12, 1)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    train, held = load_data(f"npz:{tmp_path / 'd.npz'}", seed=5)
    assert (len(train), len(held), train.num_classes, train.image_shape) == (40, 12, 3, (3, 8, 8))
    scaled = x / 255.0
    mean, std = scaled.mean(axis=(0, 2, 3), keepdims=True), scaled.std(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_allclose(train.x, (scaled - mean) / std, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(held.x, (xt / 255.0 - mean) / std, rtol=1e-5, atol=1e-5)
    assert train.y.tolist() == y.tolist() and held.y.tolist() == yt.tolist()


def test_bytes_are_standardized_by_the_training_part_alone_when_the_held_out_part_is_split_off(tmp_path):
    x, y = pixels(40, 8)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    train, held = load_data(f"npz:{tmp_path / 'd.npz'}", seed=4)
    np.testing.assert_allclose(train.x.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(train.x.std(axis=(0, 2, 3)), 1, atol=1e-4)
    assert np.abs(held.x.mean(axis=(0, 2, 3))).max() > 1e-3   # the held-out part's own figures were not used


def test_npz_without_a_test_part_holds_out_a_fifth_by_seed_and_floats_stay_as_they_are(tmp_path):
    x = np.random.default_rng(0).standard_normal((50, 8, 8)).astype(np.float32)   # (N, H, W): one channel
    y = np.arange(50) % 4
    np.savez(tmp_path / "d.npz", x=x, y=y)
    train, held = load_data(f"npz:{tmp_path / 'd.npz'}", seed=2)
    assert (len(train), len(held), train.image_shape, train.num_classes) == (40, 10, (1, 8, 8), 4)
    again = load_data(f"npz:{tmp_path / 'd.npz'}", seed=2)[1]
    np.testing.assert_array_equal(held.x, again.x)
    assert set(map(float, held.x[:, 0, 0, 0])) <= set(map(float, x[:, 0, 0]))   # values untouched


def test_npy_pair(tmp_path):
    x, y = pixels(20, 3)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    train, held = load_data(f"npy:{tmp_path / 'x.npy'},{tmp_path / 'y.npy'}")
    assert len(train) + len(held) == 20 and train.num_classes == 3


@pytest.mark.parametrize("arrays, message", [
    (dict(x=np.zeros((4, 8, 8, 3), np.uint8), y=np.zeros(4, np.int64)), "looks channels-last (N, H, W, C)"),
    (dict(x=np.zeros((4, 3, 8, 8), np.uint8), y=np.zeros(5, np.int64)), "1-D array of 4 integers"),
    (dict(x=np.zeros((4, 3, 8, 8), np.uint8), y=np.array([0, 1, 2, 3]), num_classes=3),
     "label 3 is outside [0, 3)"),
    (dict(x=np.zeros((4, 3, 8, 8), np.uint8), y=np.array([0, -1, 2, 3])), "label -1 is outside [0, 4)"),
    (dict(x=np.zeros((4, 3, 8, 8), np.uint8), y=np.array([0.0, 1, 2, 3])), "labels must be integers"),
    (dict(images=np.zeros((4, 3, 8, 8)), labels=np.zeros(4, np.int64)), "needs arrays 'x' and 'y'"),
    (dict(x=np.zeros((4, 3, 8, 8)), y=np.zeros(4, np.int64), x_test=np.zeros((2, 3, 8, 8))),
     "x_test without its pair"),
    (dict(x=np.zeros((4, 8)), y=np.zeros(4, np.int64)), "got shape (4, 8)"),
])
def test_bad_arrays_are_refused_naming_the_file_and_the_values(tmp_path, arrays, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError) as e:
        load_data(f"npz:{path}")
    assert message in str(e.value) and str(path) in str(e.value)


def test_missing_or_unreadable_files_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="no file at"):
        read_npz(tmp_path / "none.npz")
    (tmp_path / "junk.npz").write_bytes(b"not numpy")
    with pytest.raises(DataError, match="junk.npz: not a readable"):
        read_npz(tmp_path / "junk.npz")
    with pytest.raises(DataError, match="npy takes two files"):
        load_data(f"npy:{tmp_path / 'x.npy'}")


# -- image folders --------------------------------------------------------------------------------------------


def test_image_folder_per_class_reads_the_pixels_and_names_the_classes(tmp_path):
    x, y = pixels(15, 4)
    write_folder(tmp_path / "imgs", x, y)
    (tmp_path / "imgs" / "cat" / "notes.txt").write_text("not an image: left alone")
    arrays = read_image_folder(tmp_path / "imgs")
    assert arrays.class_names == ("cat", "dog", "emu") and arrays.x.dtype == np.uint8
    order = np.lexsort((np.arange(15), y))   # class by class, files in name order
    np.testing.assert_array_equal(arrays.x, x[order])
    assert arrays.y.tolist() == y[order].tolist()
    train, held = load_data(f"images:{tmp_path / 'imgs'}", seed=1)
    assert (len(train), len(held), train.image_shape) == (12, 3, (3, 8, 8))


def test_image_folder_with_train_and_test_and_grayscale(tmp_path):
    x, y = pixels(12, 5, shape=(1, 6, 6))
    write_folder(tmp_path / "d" / "train", x, y)
    write_folder(tmp_path / "d" / "test", x[:4], y[:4])
    train, held = load_data(f"images:{tmp_path / 'd'}")
    assert (len(train), len(held), train.image_shape, held.num_classes) == (12, 4, (1, 6, 6), 3)


def test_bad_image_folders_are_refused_naming_the_folder_or_file(tmp_path):
    x, y = pixels(6, 6)[0], np.array([0, 1, 2, 0, 1, 2])
    write_folder(tmp_path / "a", x, y)
    (tmp_path / "a" / "fox").mkdir()
    with pytest.raises(DataError, match=r"class folder .*fox has no images"):
        load_data(f"images:{tmp_path / 'a'}")
    write_folder(tmp_path / "b", x, y)
    Image.new("RGB", (9, 8)).save(tmp_path / "b" / "cat" / "zz.png")
    with pytest.raises(DataError, match=r"zz.png: image is 9x8 pixels, but .* is 8x8"):
        load_data(f"images:{tmp_path / 'b'}")
    write_folder(tmp_path / "c", x, y)
    (tmp_path / "c" / "dog" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match="broken.png: not an image Pillow can read"):
        load_data(f"images:{tmp_path / 'c'}")
    (tmp_path / "e").mkdir()
    with pytest.raises(DataError, match="has no class folders"):
        load_data(f"images:{tmp_path / 'e'}")
    with pytest.raises(DataError, match="does not exist"):
        load_data(f"images:{tmp_path / 'none'}")


# -- augmentation ---------------------------------------------------------------------------------------------


def test_crop_and_flip_are_the_padded_image_shifted_and_mirrored():
    x = np.arange(2 * 1 * 4 * 4, dtype=np.float32).reshape(2, 1, 4, 4) + 1
    out = x.copy()
    Augment(crop_padding=2, flip=True).apply(out, (0, 0, 0))
    padded = np.pad(x, ((0, 0), (0, 0), (2, 2), (2, 2)))
    for i in range(2):
        windows = [padded[i, :, a:a + 4, b:b + 4] for a in range(5) for b in range(5)]
        assert any(np.array_equal(out[i], w) or np.array_equal(out[i], w[:, :, ::-1]) for w in windows)
    again = x.copy()
    Augment(crop_padding=2, flip=True).apply(again, (0, 0, 0))
    np.testing.assert_array_equal(out, again)   # a pure function of the key


def test_batches_are_augmented_by_their_place_so_a_resume_sees_the_same_batches():
    data = Dataset(np.random.default_rng(0).standard_normal((20, 3, 8, 8)), np.arange(20) % 2, 2,
                   augment=Augment(4, True))
    plain = Dataset(data.x, data.y, 2)
    it, ref = BatchIterator(data, 8, seed=3), BatchIterator(plain, 8, seed=3)
    first = [it.next_batch()[0] for _ in range(5)]
    refs = [ref.next_batch()[0] for _ in range(5)]
    assert not any(np.array_equal(a, b) for a, b in zip(first, refs))   # augmented ...
    it2 = BatchIterator(data, 8, seed=3)
    for _ in range(3):
        it2.next_batch()
    resumed = BatchIterator(data, 8, seed=3)
    resumed.seek(it2.position())
    np.testing.assert_array_equal(resumed.next_batch()[0], first[3])   # ... by where the batch stands
    xo, yo = np.empty((8, 3, 8, 8), np.float32), np.empty(8, np.int64)
    into = BatchIterator(data, 8, seed=3)
    into.next_into(xo, yo)
    np.testing.assert_array_equal(xo, first[0])


def test_the_held_out_part_is_never_augmented(tmp_path):
    train, held = load_data("digits", seed=0, augment=Augment(2, True))
    assert train.augment == Augment(2, True) and held.augment is None


@pytest.mark.parametrize("spec, want", [("crop,flip", Augment(4, True)), ("flip", Augment(0, True)),
                                        ("crop:2", Augment(2, False)), ("none", None)])
def test_augment_spec(spec, want):
    assert parse_augment(spec) == want


def test_a_bad_augment_spec_names_the_forms(capsys):
    with pytest.raises(OptionError, match="'rotate' is not an augmentation"):
        parse_augment("crop,rotate")
    with pytest.raises(SystemExit):
        main(["train", "lenet", "--augment", "crop:x"])
    assert "'crop:x' is not an augmentation; a comma-separated list" in capsys.readouterr().err


# -- the command line, end to end -----------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["images", "npz"])
def test_a_cifar_style_resnet_trains_from_files_with_augmentation_and_evaluates_as_it_did(capsys, tmp_path,
                                                                                          source):
    """ResNet (CIFAR's, 3 stages) on 8x8 PNGs in class folders (or an .npz), crops and flips on; `evaluate` and
    `predict` on its checkpoint give the run's own held-out accuracy."""
    x, y = pixels(80, 7)
    if source == "images":
        write_folder(tmp_path / "imgs", x, y)
        spec = f"images:{tmp_path / 'imgs'}"
    else:
        np.savez(tmp_path / "d.npz", x=x, y=y)
        spec = f"npz:{tmp_path / 'd.npz'}"
    ck = tmp_path / "ck.npz"
    model = ["resnet", "--depth", "8"]
    assert main(["train", *model, "--data", spec, "--augment", "crop:2,flip", "--batch", "16", "--steps", "6",
                 "--save", str(ck), "--no-progress", "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["steps_done"] == 6 and 0.0 <= trained["accuracy"] <= 1.0
    assert main(["evaluate", *model, "--data", spec, "--checkpoint", str(ck), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["accuracy"] == trained["accuracy"] and ev["samples"] == 16
    assert main(["predict", *model, "--data", spec, "--checkpoint", str(ck), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == trained["accuracy"]


# -- what a file holds, read as it is or refused naming the file ------------------------------------------------


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height 8-bit grayscale pixels, with almost no data behind it."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def test_16_bit_images_are_read_at_their_depth_and_scaled_by_it(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 65536, (12, 6, 6)).astype(np.uint16)
    y = np.arange(12) % 3
    for i, (img, c) in enumerate(zip(x, y)):
        (tmp_path / "d" / f"k{c}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(tmp_path / "d" / f"k{c}" / f"{i:02d}.png")
    arrays = read_image_folder(tmp_path / "d")
    order = np.lexsort((np.arange(12), y))
    assert arrays.x.dtype == np.uint16 and arrays.x.shape == (12, 1, 6, 6)
    np.testing.assert_array_equal(arrays.x[:, 0], x[order])
    train, held = load_data(f"images:{tmp_path / 'd'}", seed=0)
    assert train.transform.dtype == "uint16"
    scaled = np.concatenate([train.x, held.x]).reshape(-1)
    assert abs(scaled.mean()) < 0.2 and 0.8 < scaled.std() < 1.2   # not squeezed into 255s
    assert (np.isclose(train.x, train.x.max())).mean() < 0.05


def test_float_images_are_read_as_they_are(tmp_path):
    x = np.random.default_rng(1).standard_normal((6, 5, 5)).astype(np.float32)
    for i, img in enumerate(x):
        (tmp_path / "d" / f"k{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(tmp_path / "d" / f"k{i % 2}" / f"{i}.tiff")
    arrays = read_image_folder(tmp_path / "d")
    assert arrays.x.dtype == np.float32
    np.testing.assert_array_equal(arrays.x[:, 0], x[[0, 2, 4, 1, 3, 5]])
    train, _ = load_data(f"images:{tmp_path / 'd'}", seed=0)
    assert train.transform is None


def test_images_that_cannot_be_scaled_are_refused_naming_the_file_and_its_mode(tmp_path):
    write_folder(tmp_path / "mixed", *pixels(6, 2, shape=(1, 6, 6)))
    Image.fromarray(np.full((6, 6), 300, np.uint16)).save(tmp_path / "mixed" / "dog" / "deep.png")
    with pytest.raises(DataError, match=r"deep.png: mode I;16 \(uint16 pixels\), but .* is mode L \(uint8\)"):
        read_image_folder(tmp_path / "mixed")
    (tmp_path / "i32" / "a").mkdir(parents=True)
    Image.fromarray(np.full((6, 6), 70000, np.int32)).save(tmp_path / "i32" / "a" / "wide.tif")
    with pytest.raises(DataError, match=r"wide.tif: mode I \(32-bit integer pixels\) has no depth to scale by"):
        read_image_folder(tmp_path / "i32")
    (tmp_path / "nan" / "a").mkdir(parents=True)
    img = np.zeros((6, 6), np.float32)
    img[2, 3] = np.nan
    Image.fromarray(img).save(tmp_path / "nan" / "a" / "bad.tiff")
    with pytest.raises(DataError, match=r"bad.tiff: float image \(mode F\) holding nan at row 2, column 3"):
        read_image_folder(tmp_path / "nan")


@pytest.mark.parametrize("side", [30000, 12000])   # beyond Pillow's error limit; between its warning and error
def test_an_image_declaring_too_many_pixels_is_refused_naming_it_without_warnings(tmp_path, side):
    import warnings

    write_folder(tmp_path / "d", *pixels(3, 3))
    (tmp_path / "d" / "cat" / "huge.png").write_bytes(_png_header(side, side))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DataError, match=rf"huge.png: too large to be a training image .*{side * side} pixels"):
            read_image_folder(tmp_path / "d")


def test_a_held_out_folder_without_one_of_the_classes_keeps_the_training_labels(tmp_path):
    x, y = pixels(12, 9)
    y = np.arange(12) % 3
    write_folder(tmp_path / "d" / "train", x, y)
    keep = y != 1   # no "dog" in the held-out part: "emu" is still class 2
    write_folder(tmp_path / "d" / "test", x[keep], y[keep])
    arrays = read_image_folder(tmp_path / "d")
    assert arrays.class_names == ("cat", "dog", "emu") and arrays.num_classes == 3
    assert sorted(arrays.y_heldout.tolist()) == sorted(y[keep].tolist()) == [0] * 4 + [2] * 4
    np.testing.assert_array_equal(arrays.x_heldout[arrays.y_heldout == 2], x[y == 2])


def test_a_constant_channel_of_bytes_becomes_zeros_and_trains(tmp_path):
    x, y = pixels(40, 10)
    x[:, 1] = 77   # the green plane blank in every image
    np.savez(tmp_path / "d.npz", x=x, y=y)
    train, held = load_data(f"npz:{tmp_path / 'd.npz'}", seed=0)
    assert train.transform.std[1] == 1.0
    assert np.isfinite(train.x).all() and not train.x[:, 1].any() and not held.x[:, 1].any()
    from minidl.models import build_model

    net = build_model("lenet", batch=8, image_size=8, in_channels=3, num_classes=3)
    sess = dl.Session(net, dl.SGD(0.05, momentum=0.9))
    assert np.isfinite(sess.fit(train, 2, progress=False).losses).all()


def _damaged(tmp_path) -> dict:
    """name -> an .npz whose x member cannot be read as numbers, each damaged its own way."""
    import io
    import zipfile

    x, y = pixels(10, 11)
    good = tmp_path / "good.npz"
    np.savez(good, x=x, y=y)
    data = bytearray(good.read_bytes())
    data[data.find(b"\x93NUMPY") + 200] ^= 0xFF   # a flipped byte inside x's pixels: a bad CRC
    (tmp_path / "crc.npz").write_bytes(bytes(data))
    (tmp_path / "cut.npz").write_bytes(good.read_bytes()[:700])
    np.savez(tmp_path / "pickled.npz", x=np.array([{"pixel": 1}] * 10, dtype=object), y=y)
    with zipfile.ZipFile(tmp_path / "raw.npz", "w") as z:
        z.writestr("x.npy", b"not an array")
        buf = io.BytesIO()
        np.save(buf, y)
        z.writestr("y.npy", buf.getvalue())
    return {"crc.npz": "array 'x': not a readable .npy array: damaged or truncated (BadZipFile: Bad CRC-32",
            "cut.npz": "not a readable .npz file (BadZipFile",
            "pickled.npz": "array 'x': holds Python objects (a pickle), not numbers",
            "raw.npz": "array 'x': not an .npy array (the member x.npy has no .npy header)"}


def test_damaged_archives_and_pickles_are_refused_naming_the_file_and_member(tmp_path):
    for name, words in _damaged(tmp_path).items():
        with pytest.raises(DataError) as e:
            load_data(f"npz:{tmp_path / name}")
        assert str(tmp_path / name) in str(e.value) and words in str(e.value), str(e.value)
        assert "allow_pickle" not in str(e.value)
    np.save(tmp_path / "x.npy", np.array([{"pixel": 1}] * 4, dtype=object), allow_pickle=True)
    np.save(tmp_path / "y.npy", np.zeros(4, np.int64))
    with pytest.raises(DataError, match=r"x.npy: holds Python objects \(a pickle\)"):
        load_data(f"npy:{tmp_path / 'x.npy'},{tmp_path / 'y.npy'}")


_U64_MAX_LAST = (np.arange(20) % 3).astype(np.uint64)
_U64_MAX_LAST[19] = np.iinfo(np.uint64).max


@pytest.mark.parametrize("arrays, message", [
    (dict(x=np.zeros((20, 1, 8, 8), np.uint8), y=np.r_[np.arange(19) % 3, 10**9]),
     "y: label 1000000000 (sample 19) is outside [0, 20)"),
    (dict(x=np.zeros((20, 1, 8, 8), np.uint8), y=_U64_MAX_LAST),
     "y: label 18446744073709551615 (sample 19) is outside [0, 20)"),
    (dict(x=np.zeros((20, 1, 8, 8), np.uint8), y=_U64_MAX_LAST,
          num_classes=3), "y: label 18446744073709551615 is outside [0, 3)"),
    (dict(x=np.zeros((4, 1, 8, 8), np.int64), y=np.arange(4)), "pixels stored as int64, which has no depth"),
    (dict(x=np.zeros((4, 1, 8, 8), np.uint8), y=np.arange(4), x_test=np.zeros((2, 1, 8, 8), np.float32),
          y_test=np.arange(2)), "x_test's pixels are float32, the training images' uint8"),
])
def test_values_are_reported_as_what_they_are(tmp_path, arrays, message):
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError) as e:
        load_data(f"npz:{path}")
    assert message in str(e.value) and str(path) in str(e.value), str(e.value)
