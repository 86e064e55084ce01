"""Checkpoints that cannot lie (minidl/runtime/checkpoint.py's rules): damaged files of every kind are one clear
`CheckpointError`, a checkpoint that does not fit the run is refused naming what differs, the path written is
the path given, stale temporaries are cleaned, and a writer killed with SIGKILL at any moment (the rename
included) leaves the previous checkpoint or the new one, never anything else. Resume is exact under Adam,
dropout + BN, offload and recomputation."""
from __future__ import annotations

import json
import os
import random
import signal
import time

import numpy as np
import pytest

import minidl as dl
from minidl.cli import main
from minidl.core.errors import CheckpointError
from minidl.data import synthetic
from minidl.optim import SGD, Adam
from minidl.runtime import checkpoint as ck
from tests.memory.nets import dropnet
from tests.sessions import session_kw


def _data():
    return synthetic(48, (3, 12, 12), 5, seed=1)


def _session(opt=None, policy="none", seed=0, **kw):
    return dl.Session(dropnet(), opt or SGD(0.05, momentum=0.9), policy=policy, seed=seed, **session_kw(kw))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "good.npz"
    s = _session()
    s.fit(_data(), 3)
    s.save(path)
    return path


# -- damaged files ----------------------------------------------------------------------------------------------
def _damaged_variants(good: bytes, tmp_path):
    rng = random.Random(0)
    out = {"empty": b"", "text": b"hello, not a checkpoint\n", "pickle": b"\x80\x04\x95" + b"\x00" * 40}
    for cut in (10, len(good) // 3, len(good) // 2, len(good) - 30, len(good) - 1):
        out[f"truncated at {cut}"] = good[:cut]
    for _ in range(12):
        pos = rng.randrange(len(good))
        b = bytearray(good)
        b[pos] ^= 1 << rng.randrange(8)
        out[f"bit flipped at {pos}"] = bytes(b)
    return out


def test_damaged_files_of_every_kind_are_one_clear_error(saved, tmp_path):
    good = saved.read_bytes()
    ref = ck.load_checkpoint(saved)
    for what, blob in _damaged_variants(good, tmp_path).items():
        p = tmp_path / "bad.npz"
        p.write_bytes(blob)
        try:
            params, opt, meta = ck.load_checkpoint(p)
        except CheckpointError as e:
            assert str(p) in str(e), what
            with pytest.raises(CheckpointError):
                _session().load(p)
            continue
        # a flip in a zip field that carries no data (a timestamp, say) is harmless: the same values load
        assert what.startswith("bit flipped") and meta == ref[2], what
        for k, v in ref[0].items():
            assert np.array_equal(params[k], v), what
    plain = tmp_path / "plain.npz"
    np.savez(plain, w=np.ones(3))  # a valid npz, but not a checkpoint
    npy = tmp_path / "arr.npy"
    np.save(npy, np.ones(3))
    for p, words in ((plain, "no manifest"), (npy, "not a minidl checkpoint"), (tmp_path, "directory"),
                     (tmp_path / "missing.npz", "does not exist")):
        with pytest.raises(CheckpointError, match=words):
            _session().load(p)


def test_every_bit_flip_in_a_small_checkpoint_is_caught(tmp_path):
    """Exhaustive over the bytes of a small checkpoint: a flip anywhere is either caught or (in zip padding
    fields that carry no data) harmless; it never loads different values."""
    p = tmp_path / "s.npz"
    ck.save_checkpoint(p, {"w": np.arange(6, dtype=np.float32)}, {"w.momentum": np.ones(6, np.float32)}, {"i": 1})
    good = p.read_bytes()
    caught = 0
    for pos in range(len(good)):
        b = bytearray(good)
        b[pos] ^= 0x10
        p.write_bytes(bytes(b))
        try:
            params, opt, meta = ck.load_checkpoint(p)
        except CheckpointError:
            caught += 1
            continue
        assert np.array_equal(params["w"], np.arange(6, dtype=np.float32)) and meta["i"] == 1
        assert np.array_equal(opt["w.momentum"], np.ones(6, np.float32))
    assert caught > len(good) // 2


def _rewrite(src, dst, meta_update=None, drop=(), params_update=None, allow_any_dtype=False, monkeypatch=None):
    params, opt, meta = ck.load_checkpoint(src)
    meta.pop("has_optimizer_state")
    meta.update(meta_update or {})
    params.update(params_update or {})
    for k in drop:
        opt.pop(k, None)
    if allow_any_dtype:
        monkeypatch.setattr(ck, "_check_dtype", lambda *a: None)
    ck.save_checkpoint(dst, params, opt, meta)
    if allow_any_dtype:
        monkeypatch.undo()


@pytest.mark.parametrize("bc", [10**10, -1, 2.5, "3"])
def test_impossible_data_positions_are_refused_at_once(saved, tmp_path, bc):
    p = tmp_path / "m.npz"
    _rewrite(saved, p, {"batches_consumed": bc})  # self-consistent file (checksums recomputed), bad content
    sess = _session()
    replayed = []
    sess.executor.load_state_dict = lambda *a, **k: replayed.append("state")  # nothing may be applied either
    with pytest.raises(CheckpointError, match="batches_consumed"):
        sess.load(p)
    # 10^10 used to hang replaying the data order: refused before the position is taken over or anything loaded
    assert sess.batches_consumed == 0 and replayed == []


@pytest.mark.parametrize("update, words", [
    ({"iteration": 10**9, "batches_consumed": 10**9}, "its data position (epoch 0, offset 12) is not where"),
    ({"iteration": 10**9, "batches_consumed": 10**9, "data_position": None}, "has no data position"),
    ({"data_position": {"epoch": 0, "offset": 5, "rng": None}}, "its data position (epoch 0, offset 5)"),
    ({"data_position": {"epoch": 0, "offset": 12, "rng": {"bit_generator": "MT19937"}}}, "generator state"),
    ({"data": None}, "the data set (None samples)"),
])
def test_a_data_position_the_data_set_cannot_have_given_is_refused_at_once(saved, tmp_path, update, words):
    """Self-consistent files (checksums recomputed) whose data position is impossible: 10^9 batches used to be
    replayed one by one at the next fit (for hours); now the position is checked against the recorded data set
    and batch at load, before anything is applied."""
    p = tmp_path / "m.npz"
    _rewrite(saved, p, update)
    sess = _session()
    applied = []
    sess.executor.load_state_dict = lambda *a, **k: applied.append("state")
    with pytest.raises(CheckpointError) as e:
        sess.load(p)
    assert words in str(e.value) and str(p) in str(e.value)
    assert sess.batches_consumed == 0 and applied == []


def test_a_far_data_position_is_restored_without_replaying_the_batches_before_it(saved, tmp_path):
    """A position 10^9 batches in (epoch 10^8, 12 batches of 4 each) is one permutation away: the fit starts at
    once, on the batches that position stands for."""
    rng = ck.load_checkpoint(saved)[2]["data_position"]["rng"]
    far = {"epoch": 10**8, "offset": 8, "rng": rng}
    p = tmp_path / "far.npz"
    _rewrite(saved, p, {"iteration": 12 * 10**8 + 2, "batches_consumed": 12 * 10**8 + 2, "data_position": far})
    sess = _session()
    sess.load(p)
    sess.fit(_data(), 2)
    assert sess.batches_consumed == 12 * 10**8 + 4
    assert sess._data_position()["epoch"] == 10**8 and sess._data_position()["offset"] == 16


@pytest.mark.parametrize("k", [12, 17])
@pytest.mark.parametrize("kept", ["position", "count"])
def test_resume_across_epochs_is_exact(tmp_path, k, kept):
    """Several epochs (12 batches each): resumed at an epoch's end (k=12) or inside the next one (k=17), from the
    data position or (a checkpoint of an older writer) from the count of batches alone, the resumed run is the
    straight run, bit for bit."""
    straight = _session()
    straight.fit(_data(), 30)
    first = _session()
    first.fit(_data(), k)
    first.save(tmp_path / "k.npz")
    if kept == "count":
        _rewrite(tmp_path / "k.npz", tmp_path / "k.npz", {"data_position": None})
    resumed = _session()
    resumed.load(tmp_path / "k.npz")
    resumed.fit(_data(), 30 - k)
    for name, v in straight.executor.state_dict().items():
        assert np.array_equal(resumed.executor.state_dict()[name], v), name


def test_a_diverged_step_gives_its_batch_to_the_next_fit():
    """A step the guard stopped consumed nothing: the next fit trains on that batch, as a run without the
    failed step would have."""
    from minidl.core.errors import DivergenceError

    data = _data()
    straight = _session()
    straight.fit(data, 5)
    sess = _session()
    sess.fit(data, 2)
    step = sess.executor.train_step

    def diverging(x, y):  # as the guard raises: after the forward, before anything is applied
        sess.executor.train_step = step
        raise DivergenceError("step 2: injected", 2)
    sess.executor.train_step = diverging
    with pytest.raises(DivergenceError):
        sess.fit(data, 3)
    assert sess.batches_consumed == sess.iteration
    sess.fit(data, 5 - sess.iteration)
    for name, v in straight.executor.state_dict().items():
        assert np.array_equal(sess.executor.state_dict()[name], v), name


def test_a_hand_edited_manifest_fails_its_checksum(saved, tmp_path):
    import zipfile
    p = tmp_path / "edited.npz"
    with zipfile.ZipFile(saved) as zin, zipfile.ZipFile(p, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == ck.MANIFEST_KEY + ".npy":
                data = data.replace(b'"batches_consumed": 3', b'"batches_consumed": 1')
            zout.writestr(item, data)
    with pytest.raises(CheckpointError, match="manifest does not match its checksum"):
        ck.load_checkpoint(p)


def _with_array_replaced(src, dst, key):
    """A copy of checkpoint `src` whose array `key` is another valid .npy of the same shape and dtype (one value
    changed): a well-formed zip entry with a correct CRC-32, so only the manifest's SHA-256 can tell."""
    import io
    import zipfile
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == key + ".npy":
                arr = np.load(io.BytesIO(data))
                arr.flat[0] = arr.flat[0] + 1
                buf = io.BytesIO()
                np.save(buf, arr)
                data = buf.getvalue()
            zout.writestr(item, data)
    return dst


@pytest.mark.parametrize("key", ["conv0.weight", "bn1.running_var", ck.OPT_PREFIX + "fc2.weight.momentum"])
def test_an_array_replaced_by_a_valid_entry_fails_its_digest(saved, tmp_path, key):
    """Bit flips are caught by the zip's CRC-32 before the digest is read; an array swapped for another valid
    entry (a parameter, a buffer, an optimizer state) passes the CRC and must be caught by its SHA-256."""
    assert key in ck.read_manifest(saved)["arrays"]
    p = _with_array_replaced(saved, tmp_path / "swapped.npz", key)
    with pytest.raises(CheckpointError, match=f"array {key!r} does not match its checksum"):
        ck.load_checkpoint(p)
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        _session().load(p)


def test_optimizer_state_removed_is_refused(saved, tmp_path, monkeypatch):
    # arrays removed from the file but still in its manifest: damaged
    import zipfile
    p = tmp_path / "noopt.npz"
    with zipfile.ZipFile(saved) as zin, zipfile.ZipFile(p, "w") as zout:
        for item in zin.infolist():
            if not item.filename.startswith(ck.OPT_PREFIX):
                zout.writestr(item, zin.read(item.filename))
    with pytest.raises(CheckpointError, match="arrays missing"):
        _session().load(p)
    # saved without optimizer state: a momentum run refuses it (momentum would restart at zero) ...
    q = tmp_path / "params.npz"
    s = _session()
    s.save(q, with_optimizer=False)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        _session().load(q)
    _session().load(q, params_only=True)  # ... unless asked for the parameters alone


def test_complex_parameters_are_refused(saved, tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="complex"):
        ck.save_checkpoint(tmp_path / "c.npz", {"w": np.ones(3, np.complex64)}, None, {})
    p = tmp_path / "c2.npz"
    params, _, _ = ck.load_checkpoint(saved)
    w = params["conv0.weight"].astype(np.complex64)
    _rewrite(saved, p, params_update={"conv0.weight": w}, allow_any_dtype=True, monkeypatch=monkeypatch)
    with pytest.raises(CheckpointError, match="complex64"):
        _session().load(p)


@pytest.mark.parametrize("other,words", [
    (lambda: _session(Adam(1e-3)), ["optimizer sgd in the checkpoint, adam here"]),
    (lambda: _session(SGD(0.05)), ["momentum: 0.9 in the checkpoint, 0.0 here"]),
    (lambda: _session(seed=1), ["seed 0 in the checkpoint, 1 here"]),
    (lambda: dl.Session(dl.models.build_model("lenet", batch=4), SGD(0.05, momentum=0.9)),
     ["parameters only in the checkpoint", "parameters only in this network"]),
])
def test_a_checkpoint_of_another_run_is_refused_naming_what_differs(saved, other, words):
    with pytest.raises(CheckpointError) as e:
        other().load(saved)
    for w in words:
        assert w in str(e.value)


def test_another_learning_rate_resumes(saved):
    """lr is the one value a resumed run may change (e.g. lower after a divergence): the state keeps its meaning."""
    s = _session(SGD(0.01, momentum=0.9))
    assert s.load(saved)["iteration"] == 3 and s.executor.iteration == 3


def test_a_shape_mismatch_names_the_parameter(saved):
    net = dl.Network("dropnet")  # same names, another width
    from minidl.layers import BatchNorm2d, Conv2d, Dropout, Flatten, Linear, MaxPool2d, ReLU, SoftmaxCrossEntropy
    x = net.input((4, 3, 12, 12), name="data")
    y = net.input((4,), dtype="int64", name="label")
    h = x
    for i, c in enumerate((6, 9)):
        h = MaxPool2d(2, name=f"pool{i}")(ReLU(name=f"relu{i}")(BatchNorm2d(name=f"bn{i}")(
            Conv2d(c, 3, padding=1, name=f"conv{i}")(h))))
    h = Dropout(0.5, name="drop")(ReLU(name="fc_relu")(Linear(16, name="fc1")(Flatten(name="flat")(h))))
    net.set_loss(SoftmaxCrossEntropy(name="loss")(Linear(5, name="fc2")(h), y))
    with pytest.raises(CheckpointError, match=r"conv1.weight: \(8, 6, 3, 3\) float32 in the checkpoint, "
                                              r"\(9, 6, 3, 3\) float32 here"):
        dl.Session(net, SGD(0.05, momentum=0.9)).load(saved)
    meta = dl.Session(net, SGD(0.05, momentum=0.9)).load(saved, strict=False)  # partial load, explicitly
    assert "conv1.weight" in meta["not_loaded"] and "conv0.weight" not in meta["not_loaded"]


def test_another_data_set_is_refused_at_fit(saved):
    s = _session()
    s.load(saved)
    with pytest.raises(CheckpointError, match="samples: 48 in the checkpoint, 40 here"):
        s.fit(synthetic(40, (3, 12, 12), 5, seed=1), 1)


def test_a_checkpoint_records_what_rebuilds_its_run(tmp_path, monkeypatch):
    """The zoo's recipe of the network, the --data source and the input transform of a user's bytes: what
    `minidl evaluate --checkpoint` needs and nothing else. The source may be spelled otherwise on resume, and a
    checkpoint written without source and transform resumes (the rest of its data still checked)."""
    from minidl.data import load_data
    from minidl.models import build_model

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.integers(0, 256, (40, 1, 8, 8), dtype=np.uint8), y=np.arange(40) % 4)
    train, _ = load_data(f"npz:{tmp_path / 'd.npz'}")

    def session():
        return dl.Session(build_model("lenet", batch=8, image_size=8, num_classes=4), SGD(0.05))

    s = session()
    s.fit(train, 1)
    meta = ck.read_manifest(s.save(tmp_path / "c.npz"))["meta"]
    assert meta["recipe"] == {"model": "lenet", "options": {"batch": 8, "image_size": 8, "num_classes": 4}}
    assert meta["data"]["source"] == f"npz:{tmp_path / 'd.npz'}"
    assert meta["data"]["transform"] == train.transform.to_json() and meta["data"]["transform"]["dtype"] == "uint8"
    monkeypatch.chdir(tmp_path)
    again = session()
    again.load(tmp_path / "c.npz")
    again.fit(load_data("npz:d.npz")[0], 1)   # the same data, another spelling: it resumes
    real = ck.load_checkpoint

    def older(path):
        params, opt, meta = real(path)
        meta["data"] = {k: meta["data"][k] for k in ("samples", "image_shape", "num_classes")}
        return params, opt, meta

    monkeypatch.setattr("minidl.runtime.session.load_checkpoint", older)
    again = session()
    again.load(tmp_path / "c.npz")
    again.fit(train, 1)
    again.load(tmp_path / "c.npz")
    with pytest.raises(CheckpointError, match="samples: 32 in the checkpoint, 24 here"):
        again.fit(train.subset(np.arange(24)), 1)


# -- paths ------------------------------------------------------------------------------------------------------
def test_the_path_written_is_the_path_given(tmp_path):
    s = _session()
    assert s.save(tmp_path / "ckpt") == tmp_path / "ckpt" and (tmp_path / "ckpt").is_file()
    assert not (tmp_path / "ckpt.npz").exists()
    with pytest.raises(CheckpointError, match="is a directory"):
        s.save(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        s.save(tmp_path / "no" / "such" / "dir.npz")
    assert not (tmp_path / "no").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left behind


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_checkpoint_gets_the_mode_the_umask_gives_any_new_file(tmp_path, umask):
    path = tmp_path / "run.npz"
    old = os.umask(umask)
    try:
        for _ in range(2):  # written, then replaced atomically: the same mode both times
            ck.save_checkpoint(path, _state(0), None, {"i": 0})
            assert path.stat().st_mode & 0o777 == 0o666 & ~umask
            (tmp_path / "plain").write_bytes(b"")
            assert path.stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "run.npz"]


def test_stale_temporaries_of_dead_writers_are_cleaned(tmp_path):
    target = tmp_path / "c.npz"
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    stale = tmp_path / f".c.npz.{dead}.abc123.tmp"
    live = tmp_path / f".c.npz.{os.getppid()}.def456.tmp"  # a running process: not ours to remove
    stale.write_bytes(b"half a checkpoint")
    live.write_bytes(b"someone else's write in progress")
    _session().save(target)
    assert not stale.exists() and live.exists()


# -- a writer killed at any moment ------------------------------------------------------------------------------
def _state(i: int) -> dict[str, np.ndarray]:
    return {"w": np.full(300_000, i, np.float32), "b": np.full(7, -i, np.float64)}


def _writer(path, hook=None):
    """Fork a process that saves checkpoints 1, 2, 3... to `path` forever, writing one byte to a pipe after each
    completed save; returns (pid, the pipe's read end) once it runs."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        try:
            os.close(r)
            if hook:
                setattr(ck, hook, lambda tmp: os.kill(os.getpid(), signal.SIGSTOP))
            os.write(w, b"s")
            i = 1
            while True:
                ck.save_checkpoint(path, _state(i), {"w.momentum": np.full(5, i, np.float32)}, {"i": i})
                os.write(w, b"x")
                i += 1
        finally:
            os._exit(1)
    os.close(w)
    os.read(r, 1)
    return pid, r


def _check_on_disk(path) -> int:
    params, opt, meta = ck.load_checkpoint(path)  # raises if damaged
    i = meta["i"]
    for k, v in _state(i).items():
        assert np.array_equal(params[k], v), (k, i)
    assert np.array_equal(opt["w.momentum"], np.full(5, i, np.float32))
    return i


def test_kill_9_at_any_moment_leaves_the_old_or_the_new_checkpoint(tmp_path):
    path = tmp_path / "run.npz"
    ck.save_checkpoint(path, _state(0), {"w.momentum": np.zeros(5, np.float32)}, {"i": 0})
    rng = random.Random(14)
    seen = set()
    t = time.perf_counter()
    ck.save_checkpoint(tmp_path / "probe.npz", _state(1), None, {})
    one_save = time.perf_counter() - t
    (tmp_path / "probe.npz").unlink()
    for k in range(25):
        pid, r = _writer(path)
        for _ in range(k % 3):  # let 0, 1 or 2 saves complete first, so the kills land in different writes ...
            os.read(r, 1)
        time.sleep(rng.uniform(0.0, 1.5 * one_save))  # ... and at a random point of the next one
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        seen.add(_check_on_disk(path))
    assert len(seen) > 1  # the kills landed at different points of different writes
    # the temporaries of the killed writers go with the next save
    ck.save_checkpoint(path, _state(99), {"w.momentum": np.full(5, 99, np.float32)}, {"i": 99})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.npz"]


@pytest.mark.parametrize("hook,expect_new", [("_before_rename", False), ("_after_rename", True)])
def test_kill_9_at_the_rename(tmp_path, hook, expect_new):
    path = tmp_path / "run.npz"
    ck.save_checkpoint(path, _state(0), {"w.momentum": np.zeros(5, np.float32)}, {"i": 0})
    pid, r = _writer(path, hook)
    _, status = os.waitpid(pid, os.WUNTRACED)  # stopped by the hook, exactly at the rename
    assert os.WIFSTOPPED(status)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    assert _check_on_disk(path) == (1 if expect_new else 0)


# -- exact resume -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt,policy", [
    (lambda: Adam(1e-3), "none"),
    (lambda: SGD(0.05, momentum=0.9), "recompute"),
    (lambda: Adam(1e-3, weight_decay=1e-4), "offload"),
])
def test_resume_is_exact(tmp_path, opt, policy):
    """dropnet has BN (running statistics) and dropout (masks keyed by iteration): k steps, save, resume in a
    fresh session, m more steps == k + m steps straight, bit for bit."""
    straight = _session(opt(), policy)
    straight.fit(_data(), 7)
    first = _session(opt(), policy)
    first.fit(_data(), 4)
    first.save(tmp_path / "k.npz")
    resumed = _session(opt(), policy)
    resumed.load(tmp_path / "k.npz")
    resumed.fit(_data(), 3)
    for k, v in straight.executor.state_dict().items():
        assert np.array_equal(resumed.executor.state_dict()[k], v), k
    for k, v in straight.executor.optimizer_state().items():
        assert np.array_equal(resumed.executor.optimizer_state()[k], v), k


def test_cli_resume_of_a_damaged_file_is_one_line(capsys, tmp_path):
    p = tmp_path / "bad.npz"
    p.write_bytes(b"PK\x03\x04 not really")
    assert main(["train", "lenet", "--batch", "4", "--steps", "1", "--no-progress", "--resume", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minidl: error: ") and str(p) in err[0]


def test_cli_resume_params_only(capsys, tmp_path):
    a = tmp_path / "a.npz"
    common = ["train", "lenet", "--data", "digits", "--batch", "8", "--steps", "2", "--no-progress", "--json"]
    assert main([*common, "--save", str(a)]) == 0
    assert main([*common, "--optimizer", "adam", "--resume", str(a)]) == 2
    assert "optimizer sgd in the checkpoint, adam here" in capsys.readouterr().out
    assert main([*common, "--optimizer", "adam", "--resume", str(a), "--resume-params-only"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["iteration"] == 2
