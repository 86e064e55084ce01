"""Data-parallel planning and the reducer in one process (no MPI): buckets, their events, their memory, and a
1-rank data-parallel run bit-identical to a plain one, compiled and interpreted, with a gathered reduction (a ring
under every policy: tests/runtime/test_policy_matrix.py, runner `dp`)."""
import json

import numpy as np
import pytest

from minidl.core.errors import BudgetError, DistError
from minidl.core.tensors import Role
from minidl.dist.checkpoint import check_resume
from minidl.dist.comm import Communicator
from minidl.graph.route import Phase
from minidl.memory.decisions.allreduce import DataParallel, assign_buckets
from minidl.memory.plan import EventKind
from minidl.memory.report import explain, write_trace
from minidl.models import build_model
from minidl.optim import SGD
from tests import sessions
from tests.planning import planned


def lenet(batch=8):
    return build_model("lenet", batch=batch, image_size=8, in_channels=1, num_classes=10)


def grad_order(route):
    return [t for s in route.steps if s.phase is Phase.BACKWARD for t in s.writes
            if route.tensors[t].role is Role.GRADIENT]


@pytest.mark.parametrize("cap", [1, 4096, 16 << 10, 1 << 30])
def test_buckets_take_gradients_in_backward_order_up_to_the_cap(cap):
    route = lenet().route(training=True, optimizer_slots=("momentum",))
    buckets = assign_buckets(route, cap)
    assert [g for b in buckets for g in b.grads] == grad_order(route)  # each gradient once, in backward order
    for b in buckets:
        nbytes = sum(route.tensors[g].nbytes for g in b.grads)
        assert nbytes <= cap or len(b.grads) == 1
        assert b.elements * 4 == nbytes
        last = max(k for k, s in enumerate(route.steps) if set(b.grads) & set(s.writes))
        assert b.ready_step == last
    if cap == 1:
        assert len(buckets) == len(grad_order(route))
    if cap == 1 << 30:
        assert len(buckets) == 1


@pytest.mark.parametrize("reduction", ["ring", "gather"])
def test_buckets_are_planned_tensors_with_events(reduction):
    net = lenet()
    plan = planned(net, SGD(0.1, momentum=0.9), "liveness", data_parallel=DataParallel(3, 16 << 10, reduction))
    route = plan.route
    assert len(plan.buckets) > 1
    update = next(k for k, s in enumerate(route.steps) if s.phase is Phase.UPDATE)
    reduced = [ev.tensor for ev in plan.steps[update].before if ev.kind is EventKind.REDUCED]
    assert reduced == list(plan.buckets)
    started = [ev.tensor for sp in plan.steps for ev in sp.after if ev.kind is EventKind.ALLREDUCE]
    assert started == reduced   # in one order on every rank: MPI matches nonblocking collectives by it
    assert max(sum(ev.kind is EventKind.ALLREDUCE for ev in sp.after) for sp in plan.steps) > 1   # two at a step
    for bid, grads in plan.buckets.items():
        spec = route.tensors[bid]
        assert spec.role is Role.BUCKET
        elems = sum(route.tensors[g].nbytes for g in grads) // 4
        # ring: own row + the received chunks, padded to 3 equal chunks; gather: one row per rank
        assert spec.shape == ((2, -(-elems // 3) * 3) if reduction == "ring" else (3, elems))
        ready = [i for i, sp in enumerate(plan.steps) for ev in sp.after
                 if ev.kind is EventKind.ALLREDUCE and ev.tensor == bid]
        assert len(ready) == 1 and bid in route.steps[ready[0]].writes
        alloc = [i for i, sp in enumerate(plan.steps) for ev in sp.before
                 if ev.kind is EventKind.ALLOC and ev.tensor == bid]
        assert alloc == ready  # allocated just before the step it is packed after
    assert "allreduce" in explain(plan) and "reduced" in explain(plan)
    plain = planned(net, SGD(0.1, momentum=0.9), "liveness")
    assert plan.peak_bytes > plain.peak_bytes


def test_budget_counts_the_buckets():
    net = lenet()
    opt = SGD(0.1, momentum=0.9)
    dp = DataParallel(2)
    plain = planned(net, opt, "liveness")
    dist = planned(net, opt, "liveness", data_parallel=dp)
    assert dist.min_budget_bytes > plain.min_budget_bytes
    planned(net, opt, "liveness", budget=plain.min_budget_bytes)
    with pytest.raises(BudgetError, match=f"{dist.min_budget_bytes:,} B"):
        planned(net, opt, "liveness", budget=plain.min_budget_bytes, data_parallel=dp)


def train(policy, comm, steps=3, budget=None, bucket=4096, **kw):
    net = build_model("resnet", depth=8, batch=4, image_size=8, num_classes=10)
    sess = sessions.train(net, policy, budget, steps, n=64, seed=3, data_seed=1, optimizer=SGD(0.05, momentum=0.9),
                          comm=comm, bucket_bytes=bucket, **kw)
    return sess, sess.last_fit


def test_one_rank_data_parallel_is_bit_identical_to_a_plain_run():
    policy, budget, reduction = "liveness", None, "gather"
    plain, r0 = train(policy, None, budget=budget)
    dist, r1 = train(policy, Communicator(), budget=budget, reduction=reduction)
    interpreted, r2 = train(policy, Communicator(), budget=budget, compiled=False, reduction=reduction)
    assert dist.plan.buckets and not plain.plan.buckets
    assert dist.executor.program is not None, dist.executor.program_fallback  # the compiled step lowers them
    assert dist.executor.program.kinds["allreduce"] == dist.executor.program.kinds["reduced"] == len(dist.plan.buckets)
    assert r0.losses == r1.losses == r2.losses
    a, b, c = plain.executor.state_dict(), dist.executor.state_dict(), interpreted.executor.state_dict()
    for k in a:
        assert np.array_equal(a[k], b[k]) and np.array_equal(a[k], c[k]), k
    assert dist.executor.pool.peak == dist.plan.peak_bytes  # the simulator's peak, buckets included
    assert dist.executor.reducer.stats.buckets == 3 * len(dist.plan.buckets)


def test_trace_has_an_allreduce_track(tmp_path):
    sess, _ = train("liveness", Communicator(), steps=1, trace=True)
    names = [e.name for e in sess.executor.trace if e.track == "allreduce"]
    assert names == [f"allreduce {b}" for b in sess.plan.buckets]
    for events in (sess.executor.trace, None):
        path = write_trace(tmp_path / "t.json", sess.plan, events)
        tr = json.loads(path.read_text())["traceEvents"]
        assert sum(1 for e in tr if e.get("tid") == 3 and e["ph"] == "X") == len(sess.plan.buckets)


def test_bad_configuration_is_named():
    with pytest.raises(DistError, match="world size"):
        DataParallel(0)
    with pytest.raises(DistError, match="bucket-size"):
        DataParallel(2, 0)
    with pytest.raises(DistError, match="--batch 16"):
        check_resume({"global_batch": 32, "ranks": 2}, 8, 2, "ck.npz")
    check_resume({"global_batch": 32, "ranks": 2}, 16, 2, "ck.npz")
    check_resume({"global_batch": 32, "ranks": 1}, 8, 1, "ck.npz")  # one process keeps its freedom


def test_cli_plans_one_rank_of_a_data_parallel_job(capsys):
    from minidl.cli import main

    assert main(["plan", "lenet", "--image-size", "8", "--in-channels", "1", "--batch", "16", "--ranks", "2",
                 "--bucket-size", "32KiB", "--explain", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["by_role"]["bucket"] > 0 and sum(out["by_role"].values()) == out["peak_bytes"]
    assert "* allreduce bucket:0" in out["explain"] and "+ reduced   bucket:0" in out["explain"]


def test_dist_report_says_ranks_throughput_and_hiding():
    from minidl.dist.report import dist_json, dist_line

    sess, res = train("liveness", Communicator(), steps=2)
    out = dist_json(sess, res)
    assert out["ranks"] == 1 and out["allreduce_buckets_per_step"] == len(sess.plan.buckets)
    assert out["allreduce_bytes_per_step"] == sum(sess.plan.sizes[b] for b in sess.plan.buckets)
    line = dist_line(out)
    assert line.startswith("1 rank(s) (local), global batch 4: ") and f"in {len(sess.plan.buckets)} buckets" in line


def test_simulated_allreduce_hides_all_but_the_last_buckets():
    from minidl.memory.decisions.allreduce import Interconnect, allreduce_timeline

    net = lenet()
    link = Interconnect(1e9, 1e-5)
    one = planned(net, SGD(0.1, momentum=0.9), "liveness", data_parallel=DataParallel(4, 1 << 30, "gather"))
    t = allreduce_timeline(one, "cpu", link)
    (bid,) = one.buckets
    assert t.total_s == pytest.approx(3 * (1e-5 + one.sizes[bid] / 4 / 1e9))  # all-gather of 4 rows, each a grad
    ring = planned(net, SGD(0.1, momentum=0.9), "liveness", data_parallel=DataParallel(4, 1 << 30, "ring"))
    r = allreduce_timeline(ring, "cpu", link)
    assert r.total_s == pytest.approx(2 * 3 * (1e-5 + ring.sizes[bid] / 2 / 4 / 1e9))  # 2 phases of 3 chunks
    bytes_only = Interconnect(1e9, 0.0)  # ring moves half the bytes at 4 ranks (latencies: twice as many)
    ring_s = allreduce_timeline(ring, "cpu", bytes_only).total_s
    assert ring_s < allreduce_timeline(one, "cpu", bytes_only).total_s / 1.9
    assert ring.sizes[bid] < one.sizes[bid]  # 2 rows instead of 4
    assert t.exposed_s == pytest.approx(t.total_s) and t.hidden_fraction == pytest.approx(0.0)  # ready last
    many = planned(net, SGD(0.1, momentum=0.9), "liveness", data_parallel=DataParallel(4, 4096))
    t = allreduce_timeline(many, "cpu", link)
    assert 0 < t.exposed_s < t.total_s and 0 < t.hidden_fraction < 1
    assert allreduce_timeline(many, "cpu", Interconnect(1e15, 0.0)).exposed_s < 1e-9  # an instant link
    with pytest.raises(DistError, match="no interconnect known"):
        from minidl.memory.simulate import DeviceProfile

        allreduce_timeline(many, DeviceProfile("mystery", 1, 1e9, 1e9, 1e9))


def collective_misses(plan) -> list[str]:
    """Walking the plan's events in order: each ALLREDUCE must find its bucket and gradients landed, nothing may
    move the bucket while its all-reduce is in flight, and REDUCED must find them landed again."""
    landed: set[str] = set()
    flying: set[str] = set()
    misses = []
    for k, sp in enumerate(plan.steps):
        for ev in (*sp.before, *sp.after):
            if ev.kind in (EventKind.ALLREDUCE, EventKind.REDUCED):
                misses += [f"{ev.kind.value} {ev.tensor} at step {k}: {t} not landed"
                           for t in (ev.tensor, *plan.buckets[ev.tensor]) if t not in landed]
                (flying.add if ev.kind is EventKind.ALLREDUCE else flying.discard)(ev.tensor)
                continue
            if ev.tensor in flying:
                misses.append(f"{ev.kind.value} {ev.tensor} at step {k} while its all-reduce is in flight")
            if ev.kind in (EventKind.ALLOC, EventKind.WAIT):
                landed.add(ev.tensor)
            elif ev.kind in (EventKind.PREFETCH, EventKind.RELEASE, EventKind.FREE):
                landed.discard(ev.tensor)
    return misses


@pytest.mark.parametrize("level", ["mid", "floor"])
def test_window_keeps_what_a_collective_touches_landed(level):
    """`window` under data parallel: the gradients a bucket packs stay resident through its ALLREDUCE (they are the
    ready step's reads), the bucket is never swapped while in flight, REDUCED comes after every gradient's swap-in."""
    from tests.memory.nets import resnet8

    dp = DataParallel(1, 4096, "ring")
    live = planned(resnet8(), SGD(0.1, momentum=0.9), "liveness", data_parallel=dp).min_budget_bytes
    with pytest.raises(BudgetError) as e:
        planned(resnet8(), SGD(0.1, momentum=0.9), "window", 1, data_parallel=dp)
    floor = e.value.min_budget_bytes
    plan = planned(resnet8(), SGD(0.1, momentum=0.9), "window", floor if level == "floor" else (live + floor) // 2,
                   data_parallel=dp)
    assert any(ev.kind is EventKind.OFFLOAD for sp in plan.steps for ev in sp.after)   # it does swap
    assert collective_misses(plan) == []


@pytest.mark.parametrize("asked", [dict(policy="packs"), dict(policy="liveness", micro_batches=2)])
def test_micro_batches_under_data_parallel_are_refused_naming_them(asked):
    """A rank all-reduces whole-batch gradients once: `packs` (which picks micro-batches) is refused at build."""
    from minidl.memory.request import PlanRequest

    with pytest.raises(DistError, match="data parallel: --(policy packs|micro-batches) cannot be combined"):
        PlanRequest.from_options(asked.pop("policy"), 1 << 20, data_parallel=DataParallel(2), **asked)
