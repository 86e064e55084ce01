"""A run never writes over what it reads or over another file it writes: every collision is refused before
anything is built, read or written, and the file is left as it was."""
import numpy as np
import pytest

from minidl.cli import main

TRAIN = ["train", "lenet", "--data", "digits", "--batch", "16", "--steps", "2"]


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "c.npz"
    assert main([*TRAIN, "--save", str(path)]) == 0
    return path


def _refused(argv, capsys, *words) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


def test_log_onto_the_resumed_checkpoint_is_refused_and_the_checkpoint_kept(ckpt, capsys):
    before = ckpt.read_bytes()
    _refused([*TRAIN, "--resume", str(ckpt), "--log", str(ckpt)], capsys, "--log", "--resume", "destroy an input")
    assert ckpt.read_bytes() == before


def test_outputs_onto_the_data_file_are_refused(tmp_path, capsys):
    data = tmp_path / "d.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.random((40, 1, 8, 8), np.float32), y=np.arange(40) % 4)
    before = data.read_bytes()
    for option in ("--log", "--save", "--plot", "--trace"):
        _refused(["train", "lenet", "--data", f"npz:{data}", "--batch", "8", "--steps", "1", option, str(data)],
                 capsys, option, "--data npz:", "destroy an input")
    assert data.read_bytes() == before
    labels = tmp_path / "y.npy"
    np.save(labels, np.arange(40) % 4)
    _refused(["train", "lenet", "--data", f"npy:{tmp_path / 'x.npy'},{labels}", "--log", str(labels)],
             capsys, "--log", "destroy an input")


def test_two_outputs_on_one_file_are_refused(tmp_path, capsys):
    path = tmp_path / "same"
    _refused([*TRAIN, "--save", str(path), "--log", str(path)], capsys, "--save", "--log", "same file")
    _refused([*TRAIN, "--plot", str(path), "--trace", str(tmp_path / "." / "same")], capsys, "same file")
    # the early-stop copy beside --save is an output too
    _refused([*TRAIN, "--save", str(tmp_path / "r.npz"), "--early-stop", "2", "--log", str(tmp_path / "r.best.npz")],
             capsys, "best checkpoint", "same file")
    assert not path.exists()


def test_a_symlink_to_an_input_is_the_input(ckpt, tmp_path, capsys):
    link = tmp_path / "link.csv"
    link.symlink_to(ckpt)
    before = ckpt.read_bytes()
    _refused([*TRAIN, "--resume", str(ckpt), "--log", str(link)], capsys, "destroy an input")
    assert ckpt.read_bytes() == before


def test_outputs_inside_an_image_folder_are_refused(tmp_path, capsys):
    from PIL import Image

    for c in ("a", "b"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(np.full((8, 8), 40 * i, np.uint8)).save(tmp_path / "imgs" / c / f"{i}.png")
    _refused(["train", "lenet", "--data", f"images:{tmp_path / 'imgs'}", "--batch", "4", "--steps", "1",
              "--plot", str(tmp_path / "imgs" / "a" / "t.png")], capsys, "--plot", "inside", "images:")
    assert sorted(p.name for p in (tmp_path / "imgs" / "a").iterdir()) == [f"{i}.png" for i in range(6)]


def test_predict_output_onto_its_input_or_checkpoint_is_refused(ckpt, tmp_path, capsys):
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((2, 1, 8, 8), np.float32))
    for target in (x, ckpt):
        before = target.read_bytes()
        _refused(["predict", "lenet", "--checkpoint", str(ckpt), "--input", str(x), "--output", str(target)],
                 capsys, "--output", "destroy an input")
        assert target.read_bytes() == before


def test_save_may_continue_the_resumed_checkpoint(ckpt):
    assert main([*TRAIN, "--resume", str(ckpt), "--save", str(ckpt)]) == 0
