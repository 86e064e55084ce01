"""What a first run says while it waits (`runtime/progress.py`): a line on stderr while numba compiles the CPU
kernels, on a terminal or without one, nothing of it when they come from the cache, and no time left estimated
from the first step (which compiles them). A compile is planted: a kernel made by minidl's `njit` that no earlier
call compiled, called inside the first step, as a cold cache's kernels are."""
from __future__ import annotations

import re
import time

import numpy as np

import minidl as dl
from minidl.core.jit_cache import njit
from minidl.data import synthetic
from minidl.models import build_model

SAID = "compiling the CPU kernels once (cached for the next runs)"


def _session():
    net = build_model("lenet", batch=8, image_size=8, in_channels=1, num_classes=10)
    return dl.Session(net, dl.SGD(lr=0.05, momentum=0.9)), synthetic(32, (1, 8, 8), 10)


def _first_step_compiles(sess, monkeypatch, pause_s: float = 0.0):
    """The session's first step compiles a fresh kernel (and then, with `pause_s`, stands still that long)."""
    @njit(cache=False)
    def fresh(x):
        return x * 2.0

    real, calls = sess.executor.train_step, []

    def step(x, y):
        if not calls:
            fresh(np.float64(len(calls)))
            time.sleep(pause_s)
        calls.append(1)
        return real(x, y)

    monkeypatch.setattr(sess.executor, "train_step", step)


def test_a_compiling_first_step_is_said_without_a_terminal(capsys, monkeypatch):
    sess, data = _session()
    _first_step_compiles(sess, monkeypatch)
    sess.fit(data, 3)   # progress=None, and stderr is no terminal here
    err = capsys.readouterr().err
    assert err.count(SAID) == 1, err
    assert "compiled in" in err and "training 3 steps" in err, err
    sess.fit(data, 2)   # every kernel compiled: nothing to say
    assert capsys.readouterr().err == ""


def test_the_bar_says_it_compiles_and_estimates_from_warm_steps_only(capsys, monkeypatch):
    """A first step of 1.5 s (compiling) then fast ones: the bar names the compile, and no time left it shows comes
    from the first step (which would read ~3 s for the three steps left)."""
    sess, data = _session()
    _first_step_compiles(sess, monkeypatch, pause_s=1.5)
    sess.fit(data, 4, progress=True)
    err = capsys.readouterr().err
    assert SAID in err, err
    left = re.findall(r"<(\d\d):(\d\d)", err)
    assert left and all(int(m) * 60 + int(s) == 0 for m, s in left), err
    assert "images/s" in err, err
