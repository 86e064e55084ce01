"""The input transform: stored pixels to the floats a network reads, one arithmetic for the training part, the
held-out part and the images `predict` is given, kept exactly through a checkpoint's JSON."""
from __future__ import annotations

import json

import numpy as np
import pytest

from minidl.core.errors import DataError
from minidl.data import load_data
from minidl.data.files import Arrays
from minidl.data.load import from_files
from minidl.data.transform import InputTransform, as_network_input


def _bytes(n: int, seed: int, c: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, c, 6, 6), dtype=np.uint8)


def test_the_training_part_and_new_images_get_the_same_bits():
    x = _bytes(30, 0)
    train, held = from_files(Arrays(x, np.arange(30) % 2, 2, "d.npz"), seed=1)
    t = InputTransform.from_json(json.loads(json.dumps(train.transform.to_json())), "checkpoint")
    assert t == train.transform   # JSON carries the float32 figures exactly
    perm = np.random.default_rng(1).permutation(30)   # Dataset.split's: the first 6 held out
    np.testing.assert_array_equal(t.apply(x[np.sort(perm[:6])], "input"), held.x)
    other = _bytes(30, 5)   # other files, scaled with the checkpoint's figures instead of their own
    again, _ = from_files(Arrays(other, np.arange(30) % 2, 2, "other.npz"), seed=1, transform=t)
    np.testing.assert_array_equal(again.x, t.apply(other[np.sort(perm[6:])], "input"))


def test_cifar_and_mnist_figures_are_their_published_constants_in_float32():
    from minidl.data import CIFAR10_MEAN, CIFAR10_STD

    t = InputTransform("uint8", CIFAR10_MEAN, CIFAR10_STD)
    x = _bytes(4, 2)
    want = x.astype(np.float32)
    want /= np.float32(255.0)
    want -= np.asarray(CIFAR10_MEAN, np.float32).reshape(1, 3, 1, 1)
    want /= np.asarray(CIFAR10_STD, np.float32).reshape(1, 3, 1, 1)
    np.testing.assert_array_equal(t.apply(x, "x"), want)


@pytest.mark.parametrize("x, words", [
    (np.zeros((2, 3, 6, 6), np.float32), "the pixels are float32, but the network was trained on uint8 pixels"),
    (np.zeros((2, 3, 6, 6), np.uint16), "the pixels are uint16"),
    (np.zeros((2, 1, 6, 6), np.uint8), "images of shape (2, 1, 6, 6), but the network was trained on images (N, 3"),
])
def test_pixels_of_another_kind_are_refused(x, words):
    t = InputTransform("uint8", (0.5, 0.5, 0.5), (0.2, 0.2, 0.2))
    with pytest.raises(DataError) as e:
        as_network_input(x, t, "--input x.npy")
    assert "--input x.npy" in str(e.value) and words in str(e.value), str(e.value)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e300])
def test_non_finite_inputs_are_refused_as_training_data_is(bad):
    x = np.zeros((3, 1, 4, 4), np.float64)
    x[1, 0, 2, 3] = bad
    with pytest.raises(DataError, match=r"--input x.npy: images contain .* \(first at sample 1, index \(0, 2, 3\)\)"):
        as_network_input(x, None, "--input x.npy")


def test_data_of_another_kind_than_the_checkpoint_s_is_refused(tmp_path):
    t = InputTransform("uint8", (0.5,), (0.2,))
    with pytest.raises(DataError, match="--data digits holds floats, as the source gives them, but the network was "
                                        "trained on uint8 pixels"):
        load_data("digits", transform=t)
    np.savez(tmp_path / "f.npz", x=np.zeros((10, 1, 6, 6), np.float32), y=np.arange(10) % 2)
    with pytest.raises(DataError, match="f.npz: the pixels are float32, but the network was trained on uint8"):
        load_data(f"npz:{tmp_path / 'f.npz'}", transform=t)
    with pytest.raises(DataError, match="is text, but the network was trained on images"):
        load_data("stdlib", transform=t)


def test_a_transform_refuses_figures_it_cannot_use():
    for mean, std in (((0.5,), (0.0,)), ((np.nan,), (1.0,)), ((0.5, 0.5), (1.0,)), ((), ())):
        with pytest.raises(DataError, match="one finite mean and one positive std per channel"):
            InputTransform("uint8", mean, std)
    with pytest.raises(DataError, match="not int32"):
        InputTransform("int32", (0.5,), (1.0,))
    with pytest.raises(DataError, match="--checkpoint c.npz: its input transform .* is unreadable"):
        InputTransform.from_json({"dtype": "uint8", "mean": [0.5]}, "--checkpoint c.npz")
