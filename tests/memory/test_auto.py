"""Policy `auto`: the fastest plan that fits a budget, over liveness, recomputation, offload and workspace sizing,
and a BudgetError naming the smallest budget (which then works) when nothing fits; plans composed by hand of its
parts keep `none`'s bits (auto's own plans at every budget level: tests/runtime/test_policy_matrix.py)."""
import json

import numpy as np
import pytest

from minidl.cli import main
from minidl.core.errors import BudgetError
from minidl.memory.plan import EventKind
from minidl.memory.report import explain, tensor_decisions
from minidl.memory.schedulers.auto import auto_search
from minidl.optim import SGD
from tests import sessions
from tests.planning import planned

from .nets import NETS


def opt():
    return SGD(lr=0.05, momentum=0.9, weight_decay=1e-4)


def train(net, policy="liveness", plan=None):
    """Five steps, in debug mode, of `policy` or of a plan composed by hand (`plan`)."""
    return sessions.train(net, policy, steps=5, n=32, seed=11, data_seed=4, plan=plan, debug=True)


def smallest_budget(net):
    with pytest.raises(BudgetError) as e:
        planned(net, opt(), "auto", budget=4096)
    assert e.value.min_budget_bytes > 4096
    return e.value.min_budget_bytes


def test_without_a_budget_auto_is_liveness():
    net = NETS["resnet20"]()
    a = planned(net, opt(), "auto")
    b = planned(net, opt(), "liveness")
    assert a.policy == "auto" and a.peak_bytes == b.peak_bytes and a.min_budget_bytes == b.min_budget_bytes


def test_the_reported_minimum_is_feasible_and_one_byte_less_is_not():
    net = NETS["resnet20"]()
    m = smallest_budget(net)
    plan = planned(net, opt(), "auto", budget=m)
    assert plan.min_budget_bytes <= m
    with pytest.raises(BudgetError):
        planned(net, opt(), "auto", budget=m - 1)


def test_auto_returns_the_fastest_fitting_combination():
    net = NETS["resnet20"]()
    route = net.route(optimizer_slots=("momentum",), fused_update=True)  # the route auto plans under a budget
    hi = planned(net, opt(), "liveness").min_budget_bytes
    lo = smallest_budget(net)
    for budget in (hi, (lo + hi) // 2, lo):
        res = auto_search(route, budget, "k40c")
        fitting = [t for t in res.trials if t.fits]
        assert fitting and res.plan is not None
        best = min(t.est_step_time_s for t in fitting)
        assert next(t for t in res.trials if t.plan is res.plan).est_step_time_s == best
        assert res.plan.min_budget_bytes <= budget
    assert any(t.fits and t.name == "liveness" for t in auto_search(route, hi, "k40c").trials)


def test_tight_budgets_use_the_mechanisms():
    net = NETS["resnet20"]()
    m = smallest_budget(net)
    plan = planned(net, opt(), "auto", budget=m)
    kinds = {ev.kind for sp in plan.steps for ev in sp.before + sp.after}
    assert EventKind.OFFLOAD in kinds
    decisions = {what for _, what, _ in tensor_decisions(plan)}
    assert "kept" in decisions and ({"offloaded", "recomputed"} & decisions)
    # the most frugal plan also runs its convolutions with the smallest workspaces
    assert any(sp.refused for sp in plan.steps)


@pytest.mark.parametrize("key", ["resnet20", "densenet_tiny"])
def test_recompute_composed_with_offload_is_bit_identical(key):
    """Roots that recomputation reads are prefetched before the recomputation sequence needs them."""
    from minidl.memory.decisions.recompute import recompute_schedule
    from minidl.memory.planner import finalize
    from minidl.memory.schedulers.auto import OffloadSearch
    from minidl.memory.workspace import workspace_choices

    net = NETS[key]()
    route = net.route(optimizer_slots=("momentum",))
    ws = workspace_choices(route)
    rs = recompute_schedule(route, ws)
    reads = {s.root: s.root_reads[0] for s in rs.segments if s.root_reads}
    # the most frugal plan of this base: every candidate offloaded (checkpoints recomputation reads included)
    cr = OffloadSearch(route, rs.schedule, ws, 1, "cpu", reads).place_tight()
    assert cr.offloaded > 0
    plan = finalize(cr.plan, cr.plan.min_budget_bytes)
    kinds = {ev.kind for sp in plan.steps for ev in sp.before + sp.after}
    assert {EventKind.OFFLOAD, EventKind.RECOMPUTE} <= kinds
    ref = train(NETS[key](), "none").executor.state_dict()
    sess = train(net, plan=plan)
    got = sess.executor.state_dict()
    for k in ref:
        assert np.array_equal(ref[k], got[k]), k
    assert sess.executor.pool.peak == plan.peak_bytes


def test_explain_says_why_per_tensor():
    net = NETS["dropnet"]()
    m = smallest_budget(net)
    text = explain(planned(net, opt(), "auto", budget=m))
    assert "per tensor: why each activation is kept, offloaded or recomputed" in text
    assert "act:conv0" in text.split("per tensor")[1]


def test_cli_budget_alone_means_auto(capsys):
    assert main(["plan", "resnet", "--depth", "20", "--batch", "2", "--image-size", "16", "--budget", "64MiB",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "auto" and "recompute_flops_share" in out
    assert main(["plan", "resnet", "--depth", "20", "--batch", "2", "--image-size", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "liveness"
    assert main(["plan", "resnet", "--depth", "20", "--batch", "2", "--image-size", "16", "--policy",
                 "recompute", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recompute_flops_share"] > 0
    assert main(["plan", "resnet", "--depth", "20", "--batch", "2", "--image-size", "16", "--budget", "100KiB",
                 "--json"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["error"] == "BudgetError" and err["min_budget_bytes"] > 100 * 1024


def test_pinned_layout_places_small_long_lived_tensors_first_and_runs():
    from minidl.core.tensors import Role
    from minidl.memory.planner import finalize, liveness_schedule, place
    from minidl.memory.schedulers.auto import LAYOUTS, pin_long_lived
    from minidl.memory.workspace import workspace_choices

    net = NETS["resnet20"]()
    route = net.route(optimizer_slots=("momentum",))
    ws = workspace_choices(route)
    sched = pin_long_lived(route, liveness_schedule(route, ws), LAYOUTS["grads+aux pinned"])
    plan = finalize(place(route, ws, sched), None)
    first = [ev.tensor for ev in plan.steps[0].before]
    pinned = [t for t, s in route.tensors.items() if s.role in (Role.GRADIENT, Role.AUX, Role.LABEL)]
    assert set(first[:len(pinned)]) == set(pinned)
    sess = train(net, plan=plan)
    ref = train(NETS["resnet20"](), "none").executor.state_dict()
    got = sess.executor.state_dict()
    assert all(np.array_equal(ref[k], got[k]) for k in ref)
    assert sess.executor.pool.peak == plan.peak_bytes


def test_an_offloaded_checkpoint_comes_back_exactly_when_its_recomputation_reads_it():
    """Just in time means before the step whose recomputation sequence first reads the checkpoint, waited for
    right before that sequence: not one step earlier (a step's worth of memory held for nothing)."""
    from minidl.memory.decisions.recompute import recompute_schedule
    from minidl.memory.planner import finalize
    from minidl.memory.schedulers.auto import OffloadSearch
    from minidl.memory.workspace import workspace_choices

    net = NETS["resnet20"]()
    route = net.route(optimizer_slots=("momentum",))
    ws = workspace_choices(route)
    rs = recompute_schedule(route, ws)
    reads = {s.root: s.root_reads[0] for s in rs.segments if s.root_reads}
    plan = finalize(OffloadSearch(route, rs.schedule, ws, 1, "cpu", reads).place_tight().plan, None)
    checked = 0
    for root, a in reads.items():
        moved = [(k, at) for k, sp in enumerate(plan.steps) for at in ("before", "after")
                 for ev in getattr(sp, at) if ev.tensor == root and ev.kind is EventKind.PREFETCH]
        if not moved:
            continue
        assert moved == [(a, "before")], root
        kinds = [(ev.kind, ev.tensor) for ev in plan.steps[a].before]
        first_recompute = next(i for i, (k, _) in enumerate(kinds) if k is EventKind.RECOMPUTE)
        assert kinds.index((EventKind.WAIT, root)) < first_recompute, root
        checked += 1
    assert checked >= 5
    sess = train(net, plan=plan)
    assert sess.executor.pool.peak == plan.peak_bytes
    ref = train(NETS["resnet20"](), "none").executor.state_dict()
    got = sess.executor.state_dict()
    assert all(np.array_equal(ref[k], got[k]) for k in ref)


def test_auto_micro_batches_by_itself_where_no_single_batch_plan_fits(capsys):
    """VGG-16 at batch 1024 needs tens of GiB as one batch whatever is moved or recomputed; split into micro-batches
    it fits a 12 GB K40c, and plain auto finds that (the JSON says how many micro-batches, the plan says why)."""
    args = ["plan", "vgg", "--depth", "16", "--batch", "1024", "--image-size", "224", "--budget", "12GB",
            "--device", "k40c", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "auto" and out["micro_batches"] > 1 and out["min_budget_bytes"] <= 12 * 10**9
    assert "no single-batch plan fits" in out["decision"]
    assert main(args + ["--max-micro-batches", "1"]) == 2   # switched off: the single-batch minimum is far above
    err = json.loads(capsys.readouterr().out)
    assert err["error"] == "BudgetError" and err["min_budget_bytes"] > 12 * 10**9
