"""The tensor cache: the host store and its transfer thread, the offload plan, and training through both.

What must hold (bits and peaks against `none`: tests/runtime/test_policy_matrix.py): a budget the liveness plan
meets moves nothing; a smaller one moves tensors and fits; an impossible
one fails before any step, naming the smallest budget that works; the thread never lets a kernel read a block
it is still writing nor frees a block it is still reading; and its errors surface in the executor's thread.
"""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

import minidl as dl
from minidl import layers as L
from minidl.memory.decisions.offload import find_candidates, plan_offload
from minidl.memory.host import HostStore, TransferError
from minidl.memory.plan import EventKind
from minidl.memory.planner import default_workspace, liveness_schedule
from minidl.memory.policies import available_policies
from minidl.memory.simulate import DeviceProfile, simulate
from minidl.models import build_model
from minidl.runtime.session import Session
from tests.planning import planned

from . import nets
from .nets import data_for, opt, reference_states

_real_copyto = np.copyto


# ---------------------------------------------------------------------------------------------------------
# Networks
# ---------------------------------------------------------------------------------------------------------

def resnet20(batch=4):
    return build_model("resnet", depth=20, batch=batch, image_size=32, num_classes=10)


def small_vgg(batch=4):
    """VGG-11's convolution stack (no BN) at 32x32 with a single classifier layer: ReLU outputs, not conv
    outputs, are what survives to backward here, so this is where non-checkpoint candidates matter."""
    net = dl.Network("vgg11_cifar")
    x = net.input((batch, 3, 32, 32), name="data")
    y = net.input((batch,), dtype="int64", name="label")
    h = x
    for s, widths in enumerate(((8,), (16,), (32, 32), (32, 32), (32, 32)), start=1):
        for i, c in enumerate(widths, start=1):
            h = L.ReLU(name=f"relu{s}_{i}")(L.Conv2d(c, 3, padding=1, name=f"conv{s}_{i}")(h))
        h = L.MaxPool2d(2, stride=2, name=f"pool{s}")(h)
    net.set_loss(L.SoftmaxCrossEntropy(name="loss")(L.Linear(10, name="fc")(h), y))
    return net


NETS = {"resnet20": resnet20, "vgg11_cifar": small_vgg}




def budgets(key):
    """(liveness minimum, a budget between it and the offload floor, the floor)."""
    live = planned(NETS[key](), opt(), "liveness").min_budget_bytes
    with pytest.raises(dl.BudgetError) as e:
        planned(NETS[key](), opt(), "offload", 1)
    floor = e.value.min_budget_bytes
    assert floor < live
    return live, (live + floor) // 2, floor


def train(key, policy, budget=None, steps=5, **kw):
    return nets.train(key, policy, budget, steps, nets=NETS, **kw)


@pytest.fixture(scope="module")
def reference():
    return reference_states(train)


def assert_same(ref, sess):
    got = sess.executor.state_dict()
    assert ref.keys() == got.keys()
    for name in ref:
        assert np.array_equal(ref[name], got[name]), name


def transfer_events(plan, tid):
    """[(step, kind)] of the transfer events of `tid`, in plan order."""
    out = []
    for k, sp in enumerate(plan.steps):
        for ev in sp.before + sp.after:
            if ev.tensor == tid and ev.kind in (EventKind.OFFLOAD, EventKind.RELEASE, EventKind.PREFETCH,
                                                EventKind.WAIT):
                out.append((k, ev.kind))
    return out


# ---------------------------------------------------------------------------------------------------------
# The host store and its thread
# ---------------------------------------------------------------------------------------------------------

def test_round_trip_is_exact_and_counted():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 1000)).astype(np.float32)
    trace = []
    with HostStore(trace=trace) as h:
        h.offload("a", a, 3)
        h.wait_offload("a")
        assert np.array_equal(h.host_copy("a"), a)
        back = np.zeros_like(a)
        h.prefetch("a", back, 7)
        h.wait_prefetch("a")
        assert np.array_equal(back, a)
        h.end_iteration()
        s = h.stats()
    assert (s.offloads, s.prefetches, s.offloaded_bytes, s.prefetched_bytes) == (1, 1, a.nbytes, a.nbytes)
    assert s.iterations == 1 and s.ram_bytes == a.nbytes and s.disk_bytes == 0
    assert 0.0 <= s.hidden_fraction <= 1.0 and s.bandwidth > 0
    assert [(e.track, e.step) for e in trace] == [("transfer", 3), ("transfer", 7)]
    assert trace[0].name == "offload a" and trace[1].name == "prefetch a"


def test_buffers_are_reused_across_iterations():
    a = np.arange(10000, dtype=np.float32)
    with HostStore() as h:
        for it in range(3):
            h.offload("a", a + it, 0)
            h.wait_offload("a")
            buf = h.host_copy("a")
            out = np.empty_like(a)
            h.prefetch("a", out, 1)
            h.wait_prefetch("a")
            assert np.array_equal(out, a + it)
            h.end_iteration()
            assert h.host_copy("a") is buf
        assert h.stats().ram_bytes == a.nbytes


def test_disk_tier_spills_beyond_the_host_limit(tmp_path):
    arrays = {f"t{i}": np.full((256, 256), i, np.float32) for i in range(4)}
    limit = 2 * arrays["t0"].nbytes
    with HostStore(limit_bytes=limit, spill_dir=tmp_path) as h:
        for tid, a in arrays.items():
            h.offload(tid, a, 0)
        for tid in arrays:
            h.wait_offload(tid)
        assert [h.on_disk(t) for t in arrays] == [False, False, True, True]
        assert isinstance(h.host_copy("t3"), np.memmap)
        for tid, a in arrays.items():
            out = np.empty_like(a)
            h.prefetch(tid, out, 1)
            h.wait_prefetch(tid)
            assert np.array_equal(out, a)
        s = h.stats()
        assert s.ram_bytes == limit and s.disk_bytes == 2 * arrays["t0"].nbytes
        assert s.spilled_bytes == 4 * arrays["t0"].nbytes  # two tensors, out and back


def test_release_waits_for_the_copy_out(monkeypatch):
    """With a slow copy, wait_offload returns only once the host holds the data: then the source may go."""
    def slow_copyto(dst, src, **kw):
        if threading.current_thread().name == "minidl-transfer":
            time.sleep(0.05)
        _real_copyto(dst, src, **kw)

    monkeypatch.setattr(np, "copyto", slow_copyto)
    a = np.arange(1000, dtype=np.float64)
    with HostStore() as h:
        h.offload("a", a, 0)
        assert h.in_flight == 1
        h.wait_offload("a")
        a[:] = np.nan  # what the executor's debug mode does to a freed block
        out = np.empty_like(a)
        h.prefetch("a", out, 1)
        h.wait_prefetch("a")
        assert np.array_equal(out, np.arange(1000, dtype=np.float64))
        assert h.stats().stall_time_s >= 0.05


def test_worker_errors_surface_in_the_callers_thread():
    a = np.ones(100, np.float32)
    with HostStore() as h:
        h.offload("a", a, 0)
        h.wait_offload("a")
        ro = np.empty_like(a)
        ro.setflags(write=False)  # the copy into it fails on the worker thread
        h.prefetch("a", ro, 4)
        with pytest.raises(TransferError, match=r"prefetch of 'a' \(issued at step 4\) failed: ValueError"):
            h.wait_prefetch("a")
        # the thread survived and keeps working
        out = np.zeros_like(a)
        h.prefetch("a", out, 5)
        h.wait_prefetch("a")
        assert np.array_equal(out, a)


def test_unwaited_errors_surface_at_end_of_iteration():
    a = np.ones(100, np.float32)
    with HostStore() as h:
        h.offload("a", a, 0)
        h.wait_offload("a")
        ro = np.empty_like(a)
        ro.setflags(write=False)
        h.prefetch("a", ro, 0)
        with pytest.raises(TransferError, match="failed"):
            h.end_iteration()
        assert h.in_flight == 0


def assert_misuse_is_named(h: HostStore) -> None:
    """Every misuse of a host store raises a TransferError that says what was wrong (shared by both engines)."""
    with pytest.raises(TransferError, match="never offloaded"):
        h.prefetch("x", np.zeros(3), 0)
    with pytest.raises(TransferError, match="no offload in flight"):
        h.wait_offload("x")
    with pytest.raises(TransferError, match="no prefetch in flight"):
        h.wait_prefetch("x")
    h.offload("x", np.zeros(3), 0)
    with pytest.raises(TransferError, match="offloaded twice"):
        h.offload("x", np.zeros(3), 0)
    h.wait_offload("x")
    with pytest.raises(TransferError, match="host copy is"):
        h.prefetch("x", np.zeros(4), 0)


def test_misuse_is_named():
    with HostStore() as h:
        assert_misuse_is_named(h)
    with pytest.raises(ValueError):
        HostStore(limit_bytes=-1)


def test_close_stops_the_thread():
    h = HostStore()
    t = h._thread
    h.offload("a", np.ones(10), 0)
    h.close()
    assert not t.is_alive()
    with pytest.raises(TransferError, match="not running"):
        h.offload("b", np.ones(10), 0)


# ---------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------

def test_policy_is_registered():
    assert "offload" in available_policies()


@pytest.mark.parametrize("budget", ["none", "liveness"])
def test_a_budget_that_fits_moves_nothing(budget):
    live = planned(resnet20(), opt(), "liveness")
    b = None if budget == "none" else live.min_budget_bytes
    plan = planned(resnet20(), opt(), "offload", b)
    assert plan.offloaded_bytes == plan.prefetched_bytes == 0
    assert plan.peak_bytes == live.peak_bytes and plan.min_budget_bytes == live.min_budget_bytes
    assert not any(ev.kind in (EventKind.OFFLOAD, EventKind.PREFETCH) for sp in plan.steps
                   for ev in sp.before + sp.after)


@pytest.mark.parametrize("key", list(NETS))
def test_smaller_budgets_fit_and_move_more(key):
    live, mid, floor = budgets(key)
    moved = []
    for b in (live - (live - floor) // 4, mid, floor):
        plan = planned(NETS[key](), opt(), "offload", b)
        assert plan.min_budget_bytes <= b == plan.arena_bytes
        assert plan.offloaded_bytes == plan.prefetched_bytes > 0
        moved.append(plan.offloaded_bytes)
    assert moved == sorted(moved)


def test_transfer_events_are_ordered_around_the_gap():
    live, mid, floor = budgets("resnet20")
    plan = planned(resnet20(), opt(), "offload", mid)
    route = plan.route
    n_fwd = len(route.forward_steps)
    offloaded = {ev.tensor for sp in plan.steps for ev in sp.after if ev.kind is EventKind.OFFLOAD}
    assert offloaded
    for tid in offloaded:
        evs = transfer_events(plan, tid)
        assert [k for _, k in evs] == [EventKind.OFFLOAD, EventKind.RELEASE, EventKind.PREFETCH, EventKind.WAIT]
        (s_off, _), (s_rel, _), (s_pre, _), (s_wait, _) = evs
        uses = [s.index for s in route.steps if tid in s.reads or tid in s.writes]
        last_fwd = max(k for k in uses if k < n_fwd)
        first_bwd = min(k for k in uses if k >= n_fwd)
        assert s_off == last_fwd <= s_rel < s_pre - 1 and s_pre <= s_wait == first_bwd


def test_candidates_prefer_long_idle_large_tensors():
    net = resnet20()
    route = net.route(training=True, optimizer_slots=tuple(opt().slots))
    cands = find_candidates(route, liveness_schedule(route, default_workspace(route)))
    assert cands and all(c.gap >= 2 for c in cands)
    assert [c.priority for c in cands] == sorted((c.priority for c in cands), reverse=True)
    assert cands[0].tensor in ("act:data", "act:conv1", "act:relu")
    assert {route.tensors[c.tensor].role for c in cands} <= {dl.Role.ACTIVATION, dl.Role.DATA}


def test_impossible_budget_fails_before_compute_naming_the_minimum():
    live, mid, floor = budgets("resnet20")
    with pytest.raises(dl.BudgetError) as e:
        Session(resnet20(), opt(), policy="offload", budget=floor - 512)
    assert e.value.min_budget_bytes == floor
    assert f"{floor:,} B" in str(e.value) and "offloaded" in str(e.value)
    planned(resnet20(), opt(), "offload", floor)  # exactly the minimum works


def test_simulator_hides_transfers_on_a_fast_link_and_exposes_them_on_a_slow_one():
    live, mid, floor = budgets("resnet20")
    fast = DeviceProfile("fast", 1 << 34, 65e9, 22e9, 11e9, 0.6)
    plan = plan_offload(resnet20().route(optimizer_slots=("momentum",)), mid, fast)
    sim = simulate(plan, fast)
    assert sim.transfer_time_s == pytest.approx((plan.offloaded_bytes + plan.prefetched_bytes) / fast.link_bw)
    assert sim.transfer_hidden_fraction > 0.9
    assert sim.est_step_time_s == pytest.approx(sim.compute_time_s + sim.exposed_transfer_s)
    slow = DeviceProfile("slow", 1 << 34, 65e9, 22e9, 1e7, 0.6)
    sim = simulate(plan, slow)
    assert sim.transfer_hidden_fraction < 0.5 and sim.est_step_time_s > sim.compute_time_s
    nothing = simulate(planned(resnet20(), opt(), "liveness"), fast)
    assert nothing.transfer_time_s == 0 and nothing.transfer_hidden_fraction == 1.0


def test_k40c_link_is_pcie3():
    from minidl.memory.simulate import get_profile

    assert get_profile("k40c").link_bw == pytest.approx(10e9)


# ---------------------------------------------------------------------------------------------------------
# Training through the tensor cache
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", list(NETS))
@pytest.mark.parametrize("which", ["mid", "floor"])
def test_the_host_store_moves_what_the_plan_says(key, which):
    live, mid, floor = budgets(key)
    budget = mid if which == "mid" else floor
    sess = train(key, "offload", budget)
    assert sess.plan.offloaded_bytes > 0
    s = sess.executor.host.stats()
    assert s.offloaded_bytes == 5 * sess.plan.offloaded_bytes
    assert s.prefetched_bytes == 5 * sess.plan.prefetched_bytes
    assert s.iterations == 5


def test_slow_copies_still_give_identical_results(monkeypatch, reference):
    """Every copy is delayed on the transfer thread: correct results prove the executor waits where it must
    (debug mode poisons freed blocks with NaN, so a release that did not wait would corrupt the host copy)."""
    def slow_copyto(dst, src, **kw):
        if threading.current_thread().name == "minidl-transfer":
            time.sleep(0.002)
        _real_copyto(dst, src, **kw)

    monkeypatch.setattr(np, "copyto", slow_copyto)
    live, mid, floor = budgets("resnet20")
    sess = train("resnet20", "offload", mid, debug=True)
    assert_same(reference("resnet20"), sess)
    assert sess.executor.host.stats().stall_time_s > 0


def test_disk_tier_through_a_session(tmp_path, reference):
    live, mid, floor = budgets("resnet20")
    sess = train("resnet20", "offload", floor, host_limit_bytes=0)
    assert_same(reference("resnet20"), sess)
    s = sess.executor.host.stats()
    assert s.ram_bytes == 0 and s.disk_bytes > 0 and s.spilled_bytes == s.moved_bytes


def test_transfer_errors_reach_the_executor(monkeypatch):
    def failing(dst, src, **kw):
        if threading.current_thread().name == "minidl-transfer":
            raise OSError("No space left on device")
        _real_copyto(dst, src, **kw)

    live, mid, floor = budgets("resnet20")
    net = resnet20()
    sess = Session(net, opt(), policy="offload", budget=mid)
    monkeypatch.setattr(np, "copyto", failing)
    with pytest.raises(TransferError, match="No space left on device"):
        sess.fit(data_for(net), 1)


def test_evaluate_with_offload_plan_restores_the_pool(reference):
    live, mid, floor = budgets("resnet20")
    net = resnet20()
    sess = Session(net, opt(), policy="offload", budget=mid, seed=3)
    before = sess.executor.pool.in_use
    loss, acc = sess.evaluate(data_for(net, 8))
    assert np.isfinite(loss) and sess.executor.pool.in_use == before
    assert sess.executor.host.in_flight == 0


def test_trace_has_a_transfer_track(tmp_path):
    from minidl.memory.report import write_trace

    live, mid, floor = budgets("resnet20")
    sess = train("resnet20", "offload", mid, steps=1, trace=True)
    path = write_trace(tmp_path / "t.json", sess.plan, sess.executor.trace)
    evs = json.loads(path.read_text())["traceEvents"]
    transfer = [e for e in evs if e.get("tid") == 2 and e["ph"] == "X"]
    compute = [e for e in evs if e.get("tid") == 1 and e["ph"] == "X"]
    assert transfer and compute
    assert {e["name"].split()[0] for e in transfer} == {"offload", "prefetch"}
    counters = [e for e in evs if e["ph"] == "C"]
    assert len(counters) == len(compute)  # the pool counter follows compute, not the copies
    plan_only = json.loads(write_trace(tmp_path / "p.json", sess.plan).read_text())["traceEvents"]
    assert any(e.get("tid") == 2 for e in plan_only)


def run_cli(capsys, *argv):
    from minidl.cli import main

    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_reports_transfers(capsys):
    live, mid, floor = budgets("resnet20")
    common = ("resnet", "--depth", "20", "--batch", "4", "--image-size", "32", "--num-classes", "10",
              "--policy", "offload", "--budget", str(mid), "--json")
    r = run_cli(capsys, "plan", *common, "--device", "k40c")
    assert r["offloaded_bytes"] > 0 and r["prefetched_bytes"] == r["offloaded_bytes"]
    assert 0.0 <= r["transfer_hidden_fraction"] <= 1.0 and r["copy_bandwidth_bytes_per_s"] == 10e9
    r = run_cli(capsys, "train", *common, "--steps", "2", "--host-limit", "0", "--optimizer", "sgd")
    assert r["offloaded_bytes"] > 0 and r["prefetched_bytes"] == r["offloaded_bytes"]
    assert 0.0 <= r["transfer_hidden_fraction"] <= 1.0 and r["copy_bandwidth_bytes_per_s"] > 0
    assert r["host_disk_bytes"] > 0 and r["host_ram_bytes"] == 0
    assert r["pool_peak_bytes"] == r["peak_bytes"]


@pytest.mark.slow
def test_vgg11_at_224_bit_identical():
    """The real VGG-11 (132 M parameters): its persistent state leaves little to move, but what moves must
    still come back bit for bit."""
    def make():
        return build_model("vgg11", batch=2, num_classes=10)

    live = planned(make(), opt(), "liveness").min_budget_bytes
    with pytest.raises(dl.BudgetError) as e:
        planned(make(), opt(), "offload", 1)
    budget = (live + e.value.min_budget_bytes) // 2
    sessions = []
    for policy, b in (("none", None), ("offload", budget)):
        net = make()
        sess = Session(net, opt(), policy=policy, budget=b, seed=3)
        sess.fit(data_for(net, 4), 5)
        sessions.append(sess)
    assert sessions[1].plan.offloaded_bytes > 0
    assert sessions[1].executor.pool.peak == sessions[1].plan.peak_bytes
    assert_same(sessions[0].executor.state_dict(), sessions[1])
