"""The per-layer profile (`minidl/runtime/profile.py`): a traced step's calls summed per (layer kind, phase), each
row the median over the steps, beside the route's FLOPs, bytes and simulated seconds; the rest of the step is
`other`. Timed here on the fake device clock of test_call_clock.py (every call 2 ms), so each row's time is exact."""
from __future__ import annotations

import numpy as np
import pytest

from minidl.memory.simulate import get_profile, step_costs
from minidl.runtime.profile import OTHER, profile_steps

from .test_call_clock import TickBackend, _session


def _batches(n):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((2, 3, 8, 8)).astype(np.float32), np.array([0, 3])) for _ in range(n)]


def test_rows_are_the_traced_calls_per_kind_and_phase():
    sess = _session(TickBackend())
    rows, walls = profile_steps(sess.executor, _batches(3), device=get_profile("h100"))
    assert len(walls) == 3 and rows[-1].kind == OTHER and rows[-1].calls == 0
    measured = rows[:-1]
    assert all(r.seconds == pytest.approx(r.calls * 0.002) for r in measured)
    assert [r.seconds for r in measured] == sorted((r.seconds for r in measured), reverse=True)
    by = {(r.kind, r.phase): r for r in measured}
    convs = sum(1 for n in sess.net.layer_nodes if n.type_name == "conv")
    assert by["conv", "forward"].calls == by["conv", "backward"].calls == convs
    assert ("update", "update") in by
    costs = step_costs(sess.executor.route, get_profile("h100"))
    assert sum(r.flops for r in measured) == sum(c.flops for c in costs)
    assert sum(r.sim_s for r in measured) == pytest.approx(sum(c.time_s for c in costs))


def test_profiling_needs_a_tracing_executor():
    with pytest.raises(ValueError, match="trace=True"):
        profile_steps(_session(TickBackend(), trace=False).executor, _batches(1))
