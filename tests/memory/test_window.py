"""Policy `window` (nnabla's out-of-core schedule): the window's own rules.

What must hold (bits and peaks against `none`: tests/runtime/test_policy_matrix.py): a budget below liveness's
minimum swaps tensors and fits; a budget the liveness plan meets moves nothing; a budget below the tightest
window's arena fails before any step, naming that arena; the events respect the two pointers (every swap-in is
waited on before its use, every swap-out is released or cancelled before the tensor returns).
"""
from __future__ import annotations

import re

import pytest

import minidl as dl
from minidl.memory.plan import EventKind
from minidl.memory.planner import default_workspace
from minidl.memory.policies import available_policies
from minidl.memory.report import explain
from minidl.memory.schedulers.window import AccessOrder, window_min_budget, window_schedule
from tests.planning import planned

from .nets import NETS, opt


def route_of(key):
    return NETS[key]().route(training=True, optimizer_slots=tuple(opt().slots))


def budgets(key):
    """(liveness arena, between it and the window's minimum, the window's minimum)."""
    live = planned(NETS[key](), opt(), "liveness").min_budget_bytes
    floor = window_min_budget(route_of(key))
    assert floor < live
    return live, (live + floor) // 2, floor


def test_policy_is_registered():
    assert "window" in available_policies()


@pytest.mark.parametrize("key", sorted(NETS))
@pytest.mark.parametrize("which", [1, 2])
def test_budgets_below_liveness_swap_and_fit(key, which):
    budget = budgets(key)[which]
    plan = planned(NETS[key](), opt(), "window", budget)
    assert plan.prefetched_bytes > 0
    assert plan.min_budget_bytes <= budget


def test_a_budget_the_liveness_plan_meets_moves_nothing():
    live = planned(NETS["resnet20"](), opt(), "liveness")
    plan = planned(NETS["resnet20"](), opt(), "window", live.min_budget_bytes)
    assert plan.offloaded_bytes == plan.prefetched_bytes == 0
    assert plan.peak_bytes == live.peak_bytes


def test_unbounded_window_is_liveness():
    route = route_of("densenet_tiny")
    ws = default_workspace(route)
    wr = window_schedule(route, AccessOrder.record(route, ws), [float("inf")] * len(route.steps), float("inf"), ws)
    assert not wr.schedule.markers
    assert all(len(r) == 1 and r[0].start_kind is EventKind.ALLOC and r[0].end_kind is EventKind.FREE
               for r in wr.schedule.residencies.values())
    assert all(st.head == len(route.steps) for st in wr.steps)


def test_below_the_tightest_window_fails_naming_it():
    floor = window_min_budget(route_of("resnet20"))
    with pytest.raises(dl.BudgetError) as e:
        planned(NETS["resnet20"](), opt(), "window", floor - 512)
    assert e.value.min_budget_bytes == floor
    assert f"{floor:,} B" in str(e.value)
    assert planned(NETS["resnet20"](), opt(), "window", floor).min_budget_bytes <= floor


def test_window_goes_below_the_offload_floor():
    """Swapping deltas, gradients and re-swapping read-only tensors reaches budgets the tensor cache cannot."""
    with pytest.raises(dl.BudgetError) as e:
        planned(NETS["resnet20"](), opt(), "offload", 1)
    assert window_min_budget(route_of("resnet20")) < e.value.min_budget_bytes


def test_events_obey_the_window():
    """Per tensor, in plan order: a swap-in is waited on before the tensor is read; no tensor is swapped out
    twice without a release in between; a released tensor comes back only by a prefetch; a tensor whose host copy
    is current (not written since its copy) is freed without a second copy."""
    key = "densenet_tiny"   # just above its minimum, some read-only tensors come back twice
    live, _, floor = budgets(key)
    # Where exactly they do moves with every change of the convolutions' workspace sizes, so a few budgets a
    # little above the minimum are checked, and at least one of them must free a tensor without a second copy.
    no_copies = [_check_window_events(planned(NETS[key](), opt(), "window", floor + (live - floor) * k // 40))
                 for k in (0, 1, 2, 4, 8)]
    assert max(no_copies) > 0, no_copies


def _check_window_events(plan) -> int:
    """Assert the event invariants of `test_events_obey_the_window` on one plan; the number of swap-outs that
    freed a tensor without copying it again."""
    route = plan.route
    state: dict[str, str] = {}
    copied_at: dict[str, int] = {}   # step after which the last copy out started
    copies: dict[str, int] = {}
    no_copy = 0
    written = {t: [s.index for s in route.steps if t in s.writes or any(a.into == t for a in s.accumulate)]
               for t in route.tensors}
    for k, (step, sp) in enumerate(zip(route.steps, plan.steps)):
        for ev in sp.before:
            s = state.get(ev.tensor)
            if ev.kind is EventKind.PREFETCH:
                assert s == "host", (k, ev)
                state[ev.tensor] = "landing"
            elif ev.kind is EventKind.WAIT:
                assert s == "landing", (k, ev)
                state[ev.tensor] = "dev"
            elif ev.kind is EventKind.RELEASE:
                assert s == "out", (k, ev)
                state[ev.tensor] = "host"
            elif ev.kind is EventKind.FREE:      # a swap-out without a copy: the host copy must be current
                assert s == "dev" and ev.tensor in copied_at, (k, ev)
                assert not [w for w in written[ev.tensor] if copied_at[ev.tensor] < w < k], (k, ev)
                state[ev.tensor] = "host"
                no_copy += 1
            elif ev.kind is EventKind.ALLOC:
                assert s is None, (k, ev)
                state[ev.tensor] = "dev"
        touched = set(step.reads) | set(step.writes)
        assert all(state[t] in ("dev", "out") for t in touched if t in state), k
        for ev in sp.after:
            if ev.kind is EventKind.OFFLOAD:
                assert state[ev.tensor] == "dev", (k, ev)
                copies[ev.tensor] = copies.get(ev.tensor, 0) + 1
                copied_at[ev.tensor] = k
                state[ev.tensor] = "out"
            elif ev.kind is EventKind.FREE:
                assert state.pop(ev.tensor) in ("dev", "out"), (k, ev)
    assert not state
    # activations are written once: some come back more than once, but they are copied out only once
    assert max(n for t, n in copies.items() if t.startswith("act:")) == 1
    return no_copy


def test_explain_shows_head_and_tail():
    key = "resnet20"
    plan = planned(NETS[key](), opt(), "window", budgets(key)[1])
    text = explain(plan)
    assert "= window [0, " in text and "pending swap-outs" in text
    assert "tail released" in text and "window head reached" in text


def test_a_step_that_cannot_fit_is_rescheduled_with_its_window_budget_lowered(monkeypatch):
    """When the placed plan misses the budget (holes), the window budget is lowered at the binding step only and the
    schedule is redone, instead of falling back to the tightest window everywhere."""
    import minidl.memory.schedulers.window as window

    caps = []
    real = window.window_schedule

    def recording(route, order, cap, limit, ws):
        caps.append(list(cap))
        return real(route, order, cap, limit, ws)

    monkeypatch.setattr(window, "window_schedule", recording)
    budget = budgets("densenet_tiny")[2]
    caps.clear()
    plan = planned(NETS["densenet_tiny"](), opt(), "window", budget)
    assert plan.min_budget_bytes <= budget
    first, rescheduled = caps[1], caps[2:]      # caps[0]: the whole-step window (liveness) tried first
    assert rescheduled
    lowered = [k for k, (a, b) in enumerate(zip(rescheduled[0], first)) if a != b]
    assert len(lowered) == 1 and rescheduled[0][lowered[0]] < first[lowered[0]]


@pytest.mark.parametrize("key", ["densenet_tiny", "resnet20"])
def test_each_prefetch_is_issued_as_soon_as_the_head_reaches_its_use(key):
    """The schedule itself, not only its results: a tensor swapped back in for its use at step j is prefetched
    before the first step whose window (the head recorded in the step's note) takes in step j, and waited on
    right before step j. A prefetch issued later hides less of its copy but changes no result, so only this
    check sees it."""
    live, _, floor = budgets(key)
    checked = 0
    for k in (0, 1, 4, 20):
        plan = planned(NETS[key](), opt(), "window", floor + (live - floor) * k // 40)
        heads = [int(re.match(r"window \[(\d+), (\d+)\)", sp.note).group(2)) for sp in plan.steps]
        issued: dict[str, tuple[int, int]] = {}   # tensor -> (step issued before, step its reason names)
        for step, sp in enumerate(plan.steps):
            for ev in sp.before:
                if ev.kind is EventKind.PREFETCH:
                    m = re.search(r"swapped in (\d+) steps ahead.*\(step (\d+)\)", ev.reason)
                    ahead, use = int(m[1]), int(m[2])
                    assert step + ahead == use, ev.reason
                    issued[ev.tensor] = (step, use)
                elif ev.kind is EventKind.WAIT:
                    first = min(s for s, h in enumerate(heads) if h > step)   # the head takes in this step
                    assert issued.pop(ev.tensor) == (first, step), (ev.tensor, step, heads[first - 1:step + 1])
                    checked += 1
        assert not issued
    assert checked > 10, checked
