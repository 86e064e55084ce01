"""The startup clock (`minidl/core/startup.py`): exclusive phases that add up to the whole, nothing recorded
before `begin()` or on another thread, the startup closed at the first step, and `minidl train --json` reporting
it from a real command."""
from __future__ import annotations

import json
import threading

import pytest

from minidl.cli import main
from minidl.core import startup


def _clock():
    ticks = iter(range(1000))
    return startup.StartupClock(clock=lambda: float(next(ticks)))


def test_phases_are_exclusive_and_add_up_to_the_startup():
    c = _clock()
    c.begin(origin=-3.0)                    # t=0: 3 s after the process started
    with c.phase("planning"):               # t=1
        with c.phase("cudnn_graphs"):       # t=2
            pass                            # t=3
        assert c.current == "planning"      # (reads no time)
        with c.phase("cudnn_graphs"):       # t=4
            pass                            # t=5
    c.enter("first_step")                   # t=6 planning left, t=7 (enter/leave: what numba's listener calls)
    c.leave("kernels")                      # not the innermost phase: ignored (reads no time)
    c.leave("first_step")                   # t=8
    c.first_step_done()                     # t=9: 12 s after the start
    with c.phase("capture"):                # t=10
        pass                                # t=11
    rep = c.report()
    assert rep.startup_s == 12.0
    assert rep.parts == {"imports": 3.0, "planning": 3.0, "cudnn_graphs": 2.0, "first_step": 1.0, "other": 3.0}
    assert sum(rep.parts.values()) == rep.startup_s
    assert rep.later == {"capture": 1.0}
    assert rep.line() == ("startup 12.0 s to the end of the first step (imports 3.0, planning 3.0, other 3.0, "
                          "cudnn graphs 2.0, first step 1.0 s); then capture 1.0 s")


def test_nothing_is_recorded_before_begin_after_stop_or_on_another_thread():
    c = _clock()
    with c.phase("planning"):
        assert c.current is None
    assert c.report().startup_s is None and c.report().parts == {}
    c.begin()
    seen = []

    def elsewhere():
        with c.phase("kernels"):
            seen.append(c.current)
    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    assert seen == [None] and "kernels" not in c.report().parts
    c.first_step_done()
    first = c.report().startup_s
    c.first_step_done()                     # once only
    assert c.report().startup_s == first
    c.stop()
    with c.phase("capture"):
        pass
    assert c.report().later == {}


def test_the_process_age_is_known_on_linux():
    age = startup.process_age()
    if age is None:
        pytest.skip("no /proc here")
    assert age >= 0.0


def test_train_json_reports_the_startup_and_its_parts(capsys):
    assert main(["train", "lenet", "--batch", "8", "--steps", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    parts = r["startup_parts"]
    assert {"imports", "backend", "inputs", "planning", "arena", "first_step", "other"} <= set(parts)
    assert r["startup_s"] == pytest.approx(sum(parts.values()))
    assert r["startup_after_first_step"] == {} and r["startup_caches"] == {}   # the CPU: no graph capture, no plans
    assert not startup.CLOCK.running                                            # the command stopped it
