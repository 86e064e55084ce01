"""The Python API a newcomer types first: top-level names, sizes as strings, docstrings."""
import numpy as np
import pytest

import minidl as dl
from minidl.models import build_model
from tests.sessions import session_kw


def _tiny(batch=8):
    return build_model("lenet", batch=batch, image_size=8, in_channels=1, num_classes=10)


def test_top_level_names():
    from minidl.optim import SGD, Adam
    from minidl.runtime.session import Session

    assert dl.Session is Session and dl.SGD is SGD and dl.Adam is Adam
    assert dl.parse_size("16MiB") == 16 * 2**20


def test_session_takes_budget_as_string():
    a = dl.Session(_tiny(), dl.SGD(lr=0.1), policy="liveness", budget="16MiB")
    b = dl.Session(_tiny(), dl.SGD(lr=0.1), policy="liveness", budget=16 * 2**20)
    assert a.plan.arena_bytes == b.plan.arena_bytes and a.plan.peak_bytes == b.plan.peak_bytes
    dl.Session(_tiny(), dl.SGD(lr=0.1), policy="offload", budget="16MiB", config=dl.RunConfig(host_limit_bytes="1MiB"))


def test_bad_size_string_names_the_option():
    with pytest.raises(dl.OptionError, match="budget: .*'lots'"):
        dl.Session(_tiny(), dl.SGD(lr=0.1), budget="lots")
    with pytest.raises(dl.OptionError, match="host_limit_bytes"):
        dl.Session(_tiny(), dl.SGD(lr=0.1), config=dl.RunConfig(host_limit_bytes="3 parsecs"))


def _digits_session(batch=32, **kw):
    from minidl.data import digits

    train, held = digits().split(0.2, seed=0)
    net = build_model("lenet", batch=batch, image_size=8, in_channels=1, num_classes=10)
    return dl.Session(net, dl.SGD(lr=0.05, momentum=0.9), **session_kw(kw)), train, held


def test_network_summary_is_the_info_table(capsys):
    from minidl.cli import main

    net = build_model("lenet", batch=8, image_size=8, in_channels=1, num_classes=10)
    s = net.summary()
    assert s.params == net.num_params() == 21_386 and s.layers == 12 and s.weighted_layers == 5
    assert [r.name for r in s.rows] == [n.name for n in net.nodes]
    assert repr(s) == str(s) == s.format() and "21,386 parameters" in str(s)
    assert main(["info", "lenet", "--batch", "8", "--image-size", "8", "--in-channels", "1", "--num-classes", "10",
                 "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in out.items() if k != "model"} == s.to_json()


def test_evaluate_counts_every_sample_and_predict_matches():
    sess, train, held = _digits_session()
    sess.fit(train, 20, progress=False)
    assert len(held) % sess.batch != 0  # 359 samples: a partial last batch
    loss, acc = sess.evaluate(held)
    logits = sess.predict(held.x)
    assert logits.shape == (len(held), 10)
    classes = sess.predict_classes(held.x)
    np.testing.assert_array_equal(classes, logits.argmax(1))
    assert acc == float((classes == held.y).mean())  # every sample counted, the partial batch included
    assert acc * len(held) == round(acc * len(held))
    # the padded last batch gives the same logits as the same samples inside a full batch
    tail = len(held) - len(held) % sess.batch
    np.testing.assert_allclose(logits[tail:], sess.predict(held.x[tail - 5:])[5:], rtol=1e-6, atol=1e-6)
    # the loss is the mean cross-entropy of those logits
    lp = logits - logits.max(1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(1, keepdims=True))
    assert loss == pytest.approx(-lp[np.arange(len(held)), held.y].mean(), rel=1e-9)


def test_predict_rejects_wrong_shape():
    sess, _, _ = _digits_session(batch=8)
    with pytest.raises(dl.DataError, match=r"input 'data': images must be .* of shape \(N, 1, 8, 8\), got float32 "
                                           r"of shape \(3, 1, 9, 9\)"):
        sess.predict(np.zeros((3, 1, 9, 9), np.float32))
    with pytest.raises(dl.DataError, match=r"input 'data': images must be numeric .* got <U1"):
        sess.predict(np.full((3, 1, 8, 8), "a"))


@pytest.mark.parametrize("bad", [np.nan, -np.inf, 1e300])
def test_predict_refuses_non_finite_images_as_training_does(bad):
    """A NaN (or a float64 beyond float32) would be predicted as class 0 with nothing to say so."""
    sess, _, _ = _digits_session(batch=8)
    x = np.zeros((3, 1, 8, 8), np.float64)
    x[2, 0, 1, 5] = bad
    with pytest.raises(dl.DataError, match=r"input 'data': images contain .* \(first at sample 2, index \(0, 1, 5\)\)"):
        sess.predict_classes(x)


def test_fit_progress_bar_only_on_a_terminal(capsys):
    sess, train, _ = _digits_session(batch=8)
    sess.fit(train, 2)  # pytest's stderr is not a terminal: no bar by default
    assert "step/s" not in capsys.readouterr().err
    sess.fit(train, 2, progress=True)
    assert "2/2" in capsys.readouterr().err


def test_save_every_writes_the_completed_steps(tmp_path):
    sess, train, _ = _digits_session(batch=8, seed=1)
    path = tmp_path / "run.npz"
    res = sess.fit(train, 7, progress=False, save_every=3, save_path=path)
    assert res.saved == [path, path]  # after steps 3 and 6
    from minidl.runtime.checkpoint import load_checkpoint

    params, _, meta = load_checkpoint(path)
    assert meta["iteration"] == 6 and meta["batches_consumed"] == 6
    # resuming from it and running one more step equals the uninterrupted run's 7th step, bit for bit
    again, _, _ = _digits_session(batch=8, seed=1)
    again.load(path)
    again.fit(train, 1, progress=False)
    for k, v in sess.executor.state_dict().items():
        np.testing.assert_array_equal(v, again.executor.state_dict()[k], err_msg=k)


def test_lr_schedule_sets_the_optimizer_rate_each_step():
    from minidl.optim.schedules import StepLR

    sess, train, _ = _digits_session(batch=8, lr_schedule=StepLR(2, 0.5))
    seen = []
    sess.fit(train, 5, progress=False, on_step=lambda k, loss, dt: seen.append(sess.optimizer.lr))
    assert seen == [0.05, 0.05, 0.025, 0.025, 0.0125]


def test_resume_continues_the_schedule_bit_for_bit(tmp_path):
    from minidl.optim import Cosine, WarmUp

    sched = WarmUp(Cosine(4), 2)
    whole, train, _ = _digits_session(batch=8, seed=2, lr_schedule=sched)
    whole.fit(train, 6, progress=False)
    first, _, _ = _digits_session(batch=8, seed=2, lr_schedule=sched)
    first.fit(train, 3, progress=False, save_every=3, save_path=tmp_path / "ck.npz")
    second, _, _ = _digits_session(batch=8, seed=2, lr_schedule=sched)
    second.load(tmp_path / "ck.npz")
    second.fit(train, 3, progress=False)
    assert second.optimizer.lr == whole.optimizer.lr == sched.lr(0.05, 5)
    for k, v in whole.executor.state_dict().items():
        np.testing.assert_array_equal(v, second.executor.state_dict()[k], err_msg=k)


def test_public_api_has_docstrings():
    """Every public class, function and method a newcomer reaches from `minidl` (and minidl.optim) says what it
    does: help(dl.Session) and an editor's hover are the first documentation anyone reads."""
    import inspect

    import minidl.optim as optim

    objs = [dl.Network, dl.Session, dl.TrainResult, dl.parse_size, dl.format_bytes, dl.OptionError]
    objs += [getattr(optim, n) for n in optim.__all__]
    missing = []
    for obj in objs:
        if not inspect.getdoc(obj):
            missing.append(obj.__name__)
        if not inspect.isclass(obj) or issubclass(obj, BaseException):
            continue
        for name, member in vars(obj).items():
            if name.startswith("_"):
                continue
            fn = member.fget if isinstance(member, property) else getattr(obj, name)
            if callable(fn) and not inspect.getdoc(fn):  # a docstring inherited from the base class counts
                missing.append(f"{obj.__name__}.{name}")
    assert not missing, f"no docstring: {missing}"


def test_seed_and_steps_are_integers_never_truncated():
    with pytest.raises(dl.OptionError, match=r"Session: seed must be an integer >= 0, got 1.5 \(float\)"):
        dl.Session(_tiny(), dl.SGD(lr=0.1), seed=1.5)
    with pytest.raises(dl.OptionError, match=r"Session: seed must be an integer >= 0, got -1"):
        dl.Session(_tiny(), dl.SGD(lr=0.1), seed=-1)
    sess, train, _ = _digits_session(batch=8, seed=np.int64(3))
    assert sess.seed == 3
    with pytest.raises(dl.OptionError, match=r"Session.fit: steps must be an integer >= 0, got 2.5 \(float\)"):
        sess.fit(train, 2.5)


@pytest.mark.parametrize("compiled", [True, False])
def test_train_step_refuses_a_bad_batch_naming_the_input(compiled):
    """Float and bool labels were truncated or read as classes 0/1, string labels raised numpy's error, a wrong
    batch shape a plain ValueError: each is a DataError naming the input, what it expects and what it got, raised
    before anything runs (the step is not counted)."""
    sess = dl.Session(_tiny(batch=4), dl.SGD(lr=0.1), config=dl.RunConfig(compiled=compiled))
    ex = sess.executor
    x, y = np.zeros((4, 1, 8, 8), np.float32), np.array([0, 1, 2, 3])
    want_y = r"input 'label': labels must be integers in \[0, 10\) of shape \(4,\), got "
    want_x = r"input 'data': images must be numeric \(float or integer\) of shape \(4, 1, 8, 8\), got "
    cases = [
        ((x, y.astype(np.float64) + 0.7), want_y + r"float64 of shape \(4,\)"),
        ((x, y.astype(bool)), want_y + r"bool of shape \(4,\)"),
        ((x, np.array(["0", "1", "2", "3"])), want_y + r"<U1 of shape \(4,\)"),
        ((x, y[:3]), want_y + r"int64 of shape \(3,\)"),
        ((x, y.reshape(4, 1)), want_y + r"int64 of shape \(4, 1\)"),
        ((x, np.array([0, 1, 2, 10])), r"input 'label': label 10 is outside \[0, 10\)"),
        ((x, np.array([0, -1, 2, 3])), r"input 'label': label -1 is outside \[0, 10\)"),
        ((x[:3], y[:3]), want_x + r"float32 of shape \(3, 1, 8, 8\)"),
        ((x.reshape(4, 8, 8), y), want_x + r"float32 of shape \(4, 8, 8\)"),
        ((x.astype(bool), y), want_x + r"bool of shape \(4, 1, 8, 8\)"),
        ((np.full(x.shape, "a"), y), want_x + r"<U1 of shape \(4, 1, 8, 8\)"),
        (([[1.0], [1.0, 2.0]], y), r"input 'data': images must be an array, got list"),
    ]
    for (xb, yb), match in cases:
        with pytest.raises(dl.DataError, match=match):
            ex.train_step(xb, yb)
        with pytest.raises(dl.DataError, match=match):
            ex.evaluate(xb, yb)
    assert ex.iteration == 0
    assert np.isfinite(ex.train_step(x, [0, 1, 2, 3])) and ex.iteration == 1  # a list of ints is a batch


def test_run_options_travel_in_one_checked_config_value():
    """The rarely used options are one frozen RunConfig: its sizes are checked where it is written (naming the
    field), the session keeps it, and the old keywords are gone from Session's signature."""
    import dataclasses
    import inspect

    cfg = dl.RunConfig(paged="64KiB", host_limit_bytes="1MiB", debug=True)
    assert (cfg.paged, cfg.host_limit_bytes) == (64 * 2**10, 2**20)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.debug = False
    with pytest.raises(dl.OptionError, match=r"paged: .*'a lot'"):
        dl.RunConfig(paged="a lot")
    sess = dl.Session(_tiny(), dl.SGD(lr=0.1), config=dl.RunConfig(trace=True, compiled=False))
    assert sess.config.trace and sess.executor.step_runner == "interpreted"
    with pytest.raises(dl.OptionError, match="config must be a RunConfig, got dict"):
        dl.Session(_tiny(), dl.SGD(lr=0.1), config={"debug": True})
    assert not set(inspect.signature(dl.Session).parameters) & {f.name for f in dataclasses.fields(dl.RunConfig)}
