"""Early stopping on the held-out loss: when it stops, what it keeps, and that watching changes no step."""
import json
import math

import numpy as np
import pytest

from minidl.cli import main
from minidl.core.errors import OptionError
from minidl.data import digits
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.earlystop import EarlyStop, EarlyStopWatch
from minidl.runtime.session import Session


def _session(lr: float, batch: int = 32) -> Session:
    net = build_model("lenet", batch=batch, image_size=8, in_channels=1, num_classes=10)
    return Session(net, SGD(lr=lr, momentum=0.9), seed=1)


def test_a_held_out_loss_that_stops_improving_stops_the_run_and_the_best_is_kept(tmp_path):
    """At lr 0 the held-out loss never moves: the first evaluation is the best, `patience` more do not improve on
    it, and fit returns there instead of running its 200 steps; the best state's checkpoint is the one of step 4."""
    train, held = digits().split(0.2, seed=0)
    sess = _session(0.0)
    res = sess.fit(train, 200, progress=False, heldout=held,
                   early_stop=EarlyStop(patience=3, every=4, best_path=tmp_path / "best.npz"))
    assert res.stopped_early and res.steps == 16 and sess.iteration == 16
    w = res.early_stop
    assert [i for i, _ in w.evaluations] == [4, 8, 12, 16] and w.best_iteration == 4
    assert w.best_loss == w.evaluations[0][1] == sess.evaluate(held)[0]
    assert res.best_saved == tmp_path / "best.npz"
    again = _session(0.0)
    meta = again.load(res.best_saved)
    assert meta["iteration"] == 4


def test_improvement_resets_the_patience_and_min_delta_sets_what_counts():
    w = EarlyStopWatch(EarlyStop(patience=2, min_delta=0.1), every=1)
    seen = [w.observe(i, loss) for i, loss in enumerate([3.0, 2.0, 1.95, 1.85, 1.89, 1.88], start=1)]
    assert seen == [True, True, False, True, False, False] and w.stop and w.best_iteration == 4
    nan = EarlyStopWatch(EarlyStop(patience=1), every=1)
    assert not nan.observe(1, math.nan) and nan.stop and nan.best_iteration is None


def test_watching_the_held_out_loss_changes_no_training_step():
    """Evaluating between steps (inference mode, the pool left as it was) leaves every later step's bits alone."""
    train, held = digits().split(0.2, seed=0)
    plain, watched = _session(0.05), _session(0.05)
    a = plain.fit(train, 12, progress=False)
    b = watched.fit(train, 12, progress=False, heldout=held, early_stop=EarlyStop(patience=50, every=3))
    assert a.losses == b.losses and not b.stopped_early and len(b.early_stop.evaluations) == 4
    pa, pb = plain.executor.state_dict(), watched.executor.state_dict()
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)


def test_early_stop_is_checked_where_it_is_written():
    train, held = digits().split(0.2, seed=0)
    with pytest.raises(OptionError, match="early_stop needs heldout"):
        _session(0.1).fit(train, 5, progress=False, early_stop=EarlyStop(2))
    with pytest.raises(OptionError, match="patience must be an integer >= 1, got 0"):
        EarlyStop(0)
    with pytest.raises(OptionError, match="early_stop must be an EarlyStop"):
        _session(0.1).fit(train, 5, progress=False, heldout=held, early_stop=3)


def test_the_command_line_stops_early_says_when_and_keeps_the_best(capsys, tmp_path):
    save = tmp_path / "r.npz"
    argv = ["train", "lenet", "--data", "digits", "--batch", "32", "--steps", "100", "--lr", "0",
            "--early-stop", "2", "--eval-every", "5", "--save", str(save), "--no-progress"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "early stop after 15 of 100 steps: the held-out loss did not improve in 2 evaluations (every 5 steps); " \
           "best held-out loss " in text and " at step 5" in text
    assert f"wrote best checkpoint (step 5): {tmp_path / 'r.best.npz'}" in text
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stopped_early"] and out["steps_done"] == 15 and out["early_stop"]["best_iteration"] == 5
    assert main(["evaluate", "lenet", "--data", "digits", "--checkpoint", out["best_saved"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(out["early_stop"]["best_heldout_loss"],
                                                                       rel=1e-12)
    assert main(["train", "lenet", "--steps", "5", "--early-stop", "2"]) == 2
    assert "--data synthetic has no held-out part" in capsys.readouterr().err
    assert main(["train", "lenet", "--data", "digits", "--steps", "5", "--eval-every", "2"]) == 2
    assert "give --early-stop PATIENCE too" in capsys.readouterr().err
