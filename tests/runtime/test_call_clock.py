"""A traced compiled step times its calls on the backend's clock (`Backend.call_clock`: the host's on the CPU, the
compute stream's events on a GPU), read when the step is over: the per-layer profile of benchmarks/gpu_profile.py
is those events. A fake clock here stands in for the device's: its durations, not the host's, reach the trace."""
from __future__ import annotations

import numpy as np

from minidl.backend.cpu.backend import CPUBackend
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import RunConfig, Session


class TickClock:
    """A device-like clock: a mark is a tick number (nothing is known until read), each tick 2 ms apart."""

    def __init__(self):
        self.ticks = 0
        self.reads = 0

    def mark(self):
        self.ticks += 1
        return self.ticks

    def read(self, start, end):
        self.reads += 1
        return 100.0 + start * 0.002, (end - start) * 0.002


class TickBackend(CPUBackend):
    def __init__(self):
        super().__init__()
        self.clock = TickClock()

    def call_clock(self):
        return self.clock


def _session(backend, trace=True):
    net = build_model("resnet", depth=8, batch=2, image_size=8, in_channels=3, num_classes=4)
    return Session(net, SGD(lr=0.1), seed=0, backend=backend, config=RunConfig(trace=trace))


def test_a_traced_compiled_step_reads_its_calls_on_the_backends_clock():
    be = TickBackend()
    sess = _session(be)
    ex = sess.executor
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    y = np.array([0, 3])
    ex.train_step(x, y)
    assert ex.step_runner == "compiled" and not ex.timed_calls
    compute = [e for e in ex.trace if e.track == "compute"]
    assert len(compute) == be.clock.reads == be.clock.ticks // 2 > 0
    assert {e.dur_s for e in compute} == {0.002}                       # one tick per call: the fake's time
    assert compute[0].start_s == 100.0 + 0.002 - ex.t0
    assert [e.step for e in compute] == sorted(e.step for e in compute)  # in call order


def test_the_host_clock_and_an_untraced_step_are_unchanged():
    be = CPUBackend()
    assert be.call_clock().read(1.5, 2.0) == (1.5, 0.5)
    ex = _session(TickBackend(), trace=False).executor
    assert ex.call_clock is None
    ex.train_step(np.zeros((2, 3, 8, 8), np.float32), np.array([0, 1]))
    assert ex.trace == [] and ex.timed_calls == []
