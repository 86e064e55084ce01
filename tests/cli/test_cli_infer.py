"""`minidl evaluate` and `minidl predict` attacked as the core is: a checkpoint alone rebuilds its run, new images
go through the training run's input transform (the same bits by --input as by --data), and bad values, damaged
files, colliding paths and the wrong kind of model for the data each end in one line naming the option or file."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from minidl.cli import main
from minidl.data.files import read_image_folder


def _run(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _refused(capsys, argv, *words) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


def _folder(root, depth: str) -> None:
    """train/ and test/ folders of 3 classes (which third of the image is bright), 8x8, RGB bytes or 16-bit gray."""
    rng = np.random.default_rng(0)
    for part, n in (("train", 48), ("test", 15)):
        for i in range(n):
            c = i % 3
            img = rng.integers(0, 60, (8, 8, 3)).astype(np.uint8)
            img[:, c * 3:c * 3 + 2] += 180
            d = root / part / f"k{c}"
            d.mkdir(parents=True, exist_ok=True)
            if depth == "uint16":
                Image.fromarray(img[:, :, 0].astype(np.uint16) * 257 + 3).save(d / f"{i:02d}.png")
            else:
                Image.fromarray(img).save(d / f"{i:02d}.png")


@pytest.mark.parametrize("depth", ["uint8", "uint16"])
def test_a_checkpoint_alone_evaluates_and_predicts_and_input_agrees_with_data(tmp_path, capsys, depth):
    _folder(tmp_path / "imgs", depth)
    spec, ck = f"images:{tmp_path / 'imgs'}", tmp_path / "ck.npz"
    trained = _run(capsys, "train", "lenet", "--data", spec, "--batch", "8", "--steps", "12", "--lr", "0.1",
                   "--save", str(ck), "--no-progress")
    ev = _run(capsys, "evaluate", "--checkpoint", str(ck))
    assert (ev["model"], ev["data"], ev["samples"], ev["accuracy"]) == ("lenet", spec, 15, trained["accuracy"])
    by_data = _run(capsys, "predict", "--checkpoint", str(ck))
    assert by_data["data"] == spec and by_data["accuracy"] == trained["accuracy"]
    raw = tmp_path / "held.npy"
    np.save(raw, read_image_folder(tmp_path / "imgs").x_heldout)   # the held-out images as stored
    by_input = _run(capsys, "predict", "--checkpoint", str(ck), "--input", str(raw))
    assert by_input["classes"] == by_data["classes"]   # 100% agreement: one transform, the same bits
    assert _run(capsys, "predict", "lenet", "--batch", "4", "--checkpoint", str(ck), "--input", str(raw))[
        "classes"] == by_data["classes"]   # an option given overrides the checkpoint's, within its network
    _refused(capsys, ["predict", "--checkpoint", str(ck), "--input", str(raw), "--image-size", "9"],
             "the options build a network reading samples of shape (", "9, 9)", "was trained on (")
    _refused(capsys, ["evaluate", "resnet", "--depth", "8", "--checkpoint", str(ck)], "does not fit this network")
    other = {"uint8": np.float32, "uint16": np.uint8}[depth]
    np.save(tmp_path / "other.npy", np.load(raw).astype(other))
    _refused(capsys, ["predict", "--checkpoint", str(ck), "--input", str(tmp_path / "other.npy")],
             f"--input {tmp_path / 'other.npy'}: the pixels are {np.dtype(other)}", f"give the images as {depth}")


@pytest.fixture(scope="module")
def floats(tmp_path_factory):
    """LeNet trained on 8x8 float images of an .npz (taken as they are: no transform)."""
    d = tmp_path_factory.mktemp("floats")
    rng = np.random.default_rng(1)
    np.savez(d / "d.npz", x=rng.standard_normal((40, 1, 8, 8)).astype(np.float32), y=np.arange(40) % 4)
    assert main(["train", "lenet", "--data", f"npz:{d / 'd.npz'}", "--batch", "8", "--steps", "2",
                 "--save", str(d / "ck.npz"), "--no-progress", "--json"]) == 0
    return d


def _npy(path, a, **kw):
    np.save(path, a, **kw)
    return str(path)


def test_bad_inputs_are_one_line_naming_the_option(floats, tmp_path, capsys):
    ck = str(floats / "ck.npz")
    x = np.zeros((3, 1, 8, 8), np.float64)
    nan, huge = x.copy(), x.copy()
    nan[1, 0, 2, 2], huge[2, 0, 0, 1] = np.nan, 1e300
    for a, words in ((nan, "images contain nan (first at sample 1"), (huge, "images contain inf (first at sample 2"),
                     (np.zeros((3, 1, 9, 9), np.float32), "images of shape (1, 9, 9), but the network of"),
                     (np.zeros((3, 8, 8), np.float32), "images must be an array (N, C, H, W), got shape (3, 8, 8)"),
                     (np.zeros((3, 1, 8, 8), bool), "images must be numeric")):
        path = _npy(tmp_path / "x.npy", a)
        _refused(capsys, ["predict", "--checkpoint", ck, "--input", path], f"--input {path}", words)
    np.savez(tmp_path / "x.npz", x=x)
    _refused(capsys, ["predict", "--checkpoint", ck, "--input", str(tmp_path / "x.npz")],
             "an .npz archive, not one .npy array")
    path = _npy(tmp_path / "p.npy", np.array([{"pixel": 1}] * 3, dtype=object), allow_pickle=True)
    _refused(capsys, ["predict", "--checkpoint", ck, "--input", path], "holds Python objects (a pickle)")
    (tmp_path / "cut.npy").write_bytes(open(_npy(tmp_path / "c.npy", x), "rb").read()[:100])
    _refused(capsys, ["predict", "--checkpoint", ck, "--input", str(tmp_path / "cut.npy")], "cut.npy: not a readable")
    _refused(capsys, ["predict", "--checkpoint", ck, "--input", path, "--data", "digits"], "not both")
    broken = tmp_path / "broken.npz"
    broken.write_bytes(open(ck, "rb").read()[:-200])
    _refused(capsys, ["evaluate", "--checkpoint", str(broken)], str(broken), "damaged")


def test_an_output_onto_the_checkpoint_s_own_data_is_refused(floats, capsys):
    data = floats / "d.npz"
    before = data.read_bytes()
    _refused(capsys, ["predict", "--checkpoint", str(floats / "ck.npz"), "--output", str(data)],
             "--output", "destroy an input")
    assert data.read_bytes() == before


def test_the_wrong_kind_of_model_for_the_data_is_one_line(floats, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("a few words of text, repeated. " * 40)
    ck = str(floats / "ck.npz")
    _refused(capsys, ["train", "lenet", "--data", f"text:{text}", "--steps", "1"],
             f"--data text:{text} is text (token sequences), but model 'lenet' reads images")
    _refused(capsys, ["evaluate", "--checkpoint", ck, "--data", "stdlib"], "is text", "'lenet' reads images")
    _refused(capsys, ["evaluate", "gpt2", "--checkpoint", ck], "model 'gpt2' reads token sequences")
    lm = tmp_path / "lm.npz"
    gpt = ["gpt2", "--layers", "1", "--width", "16", "--heads", "2", "--seq", "16"]
    trained = _run(capsys, "train", *gpt, "--batch", "4", "--steps", "1", "--data", f"text:{text}", "--save",
                   str(lm))
    ev = _run(capsys, "evaluate", "--checkpoint", str(lm))
    assert ev["model"] == "gpt2" and ev["loss"] == pytest.approx(trained["heldout_loss"], rel=1e-6)
    _refused(capsys, ["predict", "--checkpoint", str(lm)], "predict gives the classes of images")
    _refused(capsys, ["predict", "--checkpoint", str(lm), "--input", _npy(tmp_path / "x.npy", np.zeros((2, 16)))],
             "model 'gpt2' reads token sequences")


def test_a_checkpoint_without_recipe_or_data_needs_them_given(tmp_path, capsys):
    """A network built by hand (or a checkpoint of an older minidl): MODEL and its options are needed, and a
    session saved before it trained on anything needs --data."""
    import minidl as dl
    from minidl.data import load_data
    from minidl.models import build_model

    net = build_model("lenet", batch=8, image_size=8, num_classes=10)
    net.recipe = None
    sess = dl.Session(net, dl.SGD(0.05))
    sess.fit(load_data("digits")[0], 2)
    sess.save(tmp_path / "hand.npz")
    capsys.readouterr()   # what the fit said (on a cold cache, that the CPU kernels compile) is not the refusal
    _refused(capsys, ["evaluate", "--checkpoint", str(tmp_path / "hand.npz")], "does not record its model",
             "give MODEL")
    ev = _run(capsys, "evaluate", "lenet", "--checkpoint", str(tmp_path / "hand.npz"))
    assert ev["data"] == "digits" and ev["samples"] == 359
    dl.Session(build_model("lenet", batch=8, image_size=8, num_classes=10), dl.SGD(0.05)).save(tmp_path / "new.npz")
    _refused(capsys, ["evaluate", "--checkpoint", str(tmp_path / "new.npz")], "does not record the data",
             "give --data")
    assert _run(capsys, "evaluate", "--checkpoint", str(tmp_path / "new.npz"), "--data", "digits")["samples"] == 359
