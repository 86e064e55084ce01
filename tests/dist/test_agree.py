"""Before the first step the ranks check that they run the same training (minidl/dist/agree.py): tested with the
ranks as threads of one process, whose all-gather is a real exchange of their rows (no MPI needed)."""
from __future__ import annotations

import threading

import pytest

from minidl.core.errors import DistError, DivergenceError, OptionError, exit_status
from minidl.data import synthetic
from minidl.dist.agree import check_same, differences
from minidl.dist.comm import Communicator, Request
from minidl.dist.launch import guarded
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import Session


class ThreadRanks(Communicator):
    """Rank `rank` of the threads sharing `rows`: an all-gather posts this rank's row, waits for every rank's,
    and copies them in (then waits again, so no rank overwrites its slot before all have read)."""

    def __init__(self, rank: int, size: int, shared: dict):
        super().__init__(rank, size, timeout_s=30.0)
        self.shared = shared

    def start_allgather(self, buf, second: bool = False) -> Request:
        rows, barrier = self.shared["rows"], self.shared["barrier"]
        rows[self.rank] = buf[self.rank].copy()
        barrier.wait(self.timeout_s)
        for r in range(self.size):
            buf[r] = rows[r]
        barrier.wait(self.timeout_s)
        return Request(done=True)


def run_ranks(work, n=2):
    """work(comm) on n threads, one per rank: [(result or None, exception or None)] in rank order."""
    shared = {"rows": [None] * n, "barrier": threading.Barrier(n)}
    out = [(None, None)] * n

    def one(r):
        try:
            out[r] = (work(ThreadRanks(r, n, shared)), None)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out[r] = (None, e)
    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_exchange_gives_every_rank_every_ranks_bytes_in_rank_order():
    out = run_ranks(lambda c: c.exchange(b"x" * (3 + 10 * c.rank), "test"), n=3)
    for got, err in out:
        assert err is None and got == [b"xxx", b"x" * 13, b"x" * 23]


def test_differences_name_each_entry_and_every_ranks_value():
    assert differences([{"a": 1, "b": [1, 2]}, {"a": 1, "b": [1, 2]}]) == []
    assert differences([{"a": 1, "s": "x"}, {"a": 2, "s": "x", "c": True}]) == [
        "a: 1 on rank 0, 2 on rank 1", "c: absent on rank 0, true on rank 1"]
    assert Communicator().exchange(b"abc", "x") == [b"abc"]
    check_same(Communicator(), {"anything": 1})  # one process: nothing to agree with


BASE = {"classes": 10, "seed": 0, "lr": 0.05, "momentum": 0.9, "batch": 8, "policy": "liveness"}


def _fit(comm, opts, steps=0):
    net = build_model("lenet", batch=opts["batch"], image_size=8, in_channels=1, num_classes=opts["classes"])
    sess = Session(net, SGD(opts["lr"], momentum=opts["momentum"]), policy=opts["policy"], seed=opts["seed"],
                   comm=comm)
    sess.fit(synthetic(256, (1, 8, 8), 10, seed=0), steps)
    return sess


@pytest.mark.parametrize("option, other, names", [
    ("classes", 5, r"parameter \S+\.weight: \"?\(10, \d+\) float32\"? on rank 0, \"?\(5, \d+\) float32\"? on rank 1"),
    ("seed", 1, "seed: 0 on rank 0, 1 on rank 1"),
    ("lr", 0.1, "optimizer lr: 0.05 on rank 0, 0.1 on rank 1"),
    ("momentum", 0.0, "optimizer momentum: 0.9 on rank 0, 0.0 on rank 1"),
    ("batch", 4, "batch: 8 on rank 0, 4 on rank 1"),
    ("policy", "recompute", "policy: liveness on rank 0, recompute on rank 1"),
])
def test_ranks_started_with_different_options_all_stop_before_the_first_step_naming_it(option, other, names):
    def work(comm):
        opts = dict(BASE, **({option: other} if comm.rank == 1 else {}))
        return _fit(comm, opts, steps=3)
    out = run_ranks(work)
    for r, (_, err) in enumerate(out):
        assert isinstance(err, DistError), (r, err)
        assert "not started with the same training options" in str(err)
        assert __import__("re").search(names, str(err)), str(err)


def test_ranks_with_the_same_options_agree():
    out = run_ranks(lambda comm: _fit(comm, BASE))
    assert [err for _, err in out] == [None, None]
    a, b = (sess for sess, _ in out)
    assert a._agreed == b._agreed and a._agreed["seed"] == 0


class Recorder(Communicator):
    """Rank 0 of 2 that records how it was told to fail instead of aborting a job."""

    def __init__(self):
        super().__init__(0, 2)
        self.failed = []

    def fail(self, message, code=1):
        self.failed.append((message, code))


@pytest.mark.parametrize("error, code", [(DivergenceError("step 3: the loss is nan", 3), 3),
                                         (DistError("the ranks differ"), 2), (OptionError("--lr"), 2),
                                         (RuntimeError("a bug"), 1), (KeyboardInterrupt(), 130)])
def test_a_failing_rank_aborts_the_job_with_the_status_one_process_exits_with(error, code):
    comm = Recorder()

    def work():
        raise error
    with pytest.raises(type(error)):
        guarded(comm, work)
    assert comm.failed == [(f"{type(error).__name__}: {error}", code)]
    assert exit_status(error) == code
