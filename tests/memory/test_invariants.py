"""Invariants pinned exactly, so a planted bug cannot hide behind a plan compared with itself:

- every tensor's live interval equals a brute-force definition written from the layers' *declared* backward
  needs (not from the route's read lists that liveness itself reads): freeing a tensor one step late, or early,
  fails here;
- the simulator's peak, replayed on its own shape-only pool (memory/replay.py), follows the plan's events, not
  its recorded figure (that it equals the executor's measured peak under every policy and runner:
  tests/runtime/test_policy_matrix.py).
"""
from __future__ import annotations

import pytest

from minidl.core.errors import BudgetError
from minidl.core.tensors import Role, act_id, aux_id, delta_id, grad_id
from minidl.data import synthetic
from minidl.graph.route import Phase, Route
from minidl.memory.liveness import analyze
from minidl.memory.replay import replay_peak
from minidl.memory.simulate import simulate
from minidl.optim import SGD, Adam
from minidl.runtime.session import RunConfig, Session
from tests.planning import planned

from .nets import NETS


def brute_force_intervals(route: Route) -> dict[str, tuple[int, int]]:
    """[first, last] step of every activation, delta, aux and gradient, from the definitions in DESIGN.md: an
    activation lives from its forward (the data from step 0) to the last forward that reads it or the last
    backward that *declares* it needs it (an input in `needs_inputs`, its own output if `needs_output`); a delta
    from the first backward that writes it to its layer's backward; aux from forward to backward; a gradient from
    its backward to the update that applies it."""
    net = route.network
    fwd = {st.node: st.index for st in route.steps if st.phase is Phase.FORWARD}
    bwd = {st.node: st.index for st in route.steps if st.phase is Phase.BACKWARD}
    upd = {}
    for st in route.steps:
        if st.phase is Phase.UPDATE:
            for n in (net.layer_nodes if st.node is None else [net.nodes[st.node]]):
                upd[n.index] = st.index
    consumers: dict[int, list] = {n.index: [] for n in net.nodes}
    for c in net.layer_nodes:
        for k, i in enumerate(c.inputs):
            consumers[i].append((c, k))
    out: dict[str, tuple[int, int]] = {}
    for n in net.nodes:
        uses = [0 if n.layer is None else fwd[n.index]]
        for c, k in consumers[n.index]:
            uses.append(fwd[c.index])
            if c.index in bwd and k in c.layer.needs_inputs:
                uses.append(bwd[c.index])
        if n.layer is not None and n.index in bwd and n.layer.needs_output:
            uses.append(bwd[n.index])
        out[act_id(n.name)] = (min(uses), max(uses))
        if n.index in bwd:
            writers = [bwd[c.index] for c, k in consumers[n.index]
                       if c.index in bwd and k not in c.layer.nondiff_inputs]
            first = min(writers) if writers else bwd[n.index]  # the loss seeds its own delta
            out[delta_id(n.name)] = (first, bwd[n.index])
        elif n.layer is None and any(c.index in bwd and k not in c.layer.nondiff_inputs and
                                     route.requires_grad[n.index] for c, k in consumers[n.index]):
            pass  # the data needs no delta (requires_grad is False for inputs)
        if n.layer is not None:
            for a in n.layer.aux_specs([net.nodes[i].shape for i in n.inputs], True):
                if aux_id(n.name, a) in route.tensors:
                    out[aux_id(n.name, a)] = (fwd[n.index], bwd.get(n.index, fwd[n.index]))
            for p, spec in n.params.items():
                if spec.trainable and n.index in bwd:
                    out[grad_id(n.name, p)] = (bwd[n.index], upd[n.index])
    return out


@pytest.mark.parametrize("key", sorted(NETS))
@pytest.mark.parametrize("fused", [False, True])
def test_liveness_intervals_match_the_declared_needs_exactly(key, fused):
    plan = planned(NETS[key](), SGD(0.1, momentum=0.9), "liveness", fused_update=fused)
    route = plan.route
    got = analyze(route)
    want = brute_force_intervals(route)
    checked = 0
    for tid, iv in got.items():
        role = route.tensors[tid].role
        if role in (Role.WORKSPACE, Role.BUCKET) or tid not in want:
            assert role in (Role.WORKSPACE, Role.BUCKET, Role.DELTA), f"{tid} ({role}) has no brute-force interval"
            continue  # workspaces live within their step; partial deltas within the step that accumulates them
        assert (iv.first, iv.last) == want[tid], f"{tid}: liveness {(iv.first, iv.last)}, declared {want[tid]}"
        checked += 1
    assert checked >= len(want) - 1  # (every defined tensor is planned; the label may have no delta)
    for tid, iv in got.items():
        if route.tensors[tid].role is Role.WORKSPACE:
            assert iv.first == iv.last


def test_a_plan_that_frees_late_is_seen_by_the_replay():
    """The replay follows the events, not the plan's own figure: with the FREEs moved to the end of the step,
    the replay finds tensors placed over ones still alive (the executor's pool would refuse the same), where
    reading plan.peak_bytes would have said all is well."""
    plan = planned(NETS["resnet20"](), SGD(0.1), "liveness")
    assert simulate(plan, "cpu").peak_bytes == plan.peak_bytes
    moved = 0
    for sp in plan.steps[:-1]:
        frees = [e for e in sp.after if e.kind.value == "free"]
        for e in frees:
            sp.after.remove(e)
            plan.steps[-1].after.append(e)
            moved += 1
    assert moved
    with pytest.raises(ValueError, match="overlap"):  # later tensors were placed where the late ones still live
        replay_peak(plan)


def test_interval_records_are_consistent():
    """Each interval names its tensor, its uses are strictly increasing step indices, and first/last are the ends
    (a use recorded at a wrong step, or a None, would reach the offload decisions, which read the gaps)."""
    route = planned(NETS["resnet20"](), SGD(0.1), "liveness").route  # adds and forks: accumulations
    n = len(route.steps)
    for tid, iv in analyze(route).items():
        assert iv.tensor == tid
        assert all(isinstance(u, int) and 0 <= u < n for u in iv.uses), (tid, iv.uses)
        assert list(iv.uses) == sorted(set(iv.uses)) and (iv.first, iv.last) == (iv.uses[0], iv.uses[-1])
    forks = [acc.into for st in route.steps for acc in st.accumulate]
    assert forks and all(st.index in analyze(route)[acc.into].uses for st in route.steps for acc in st.accumulate)


def test_paged_plans_replay_on_a_paged_pool():
    chunk = 64 * 1024
    sess = Session(NETS["resnet20"](), Adam(), policy="liveness", config=RunConfig(paged=chunk))
    sess.fit(synthetic(16, (3, 16, 16), 10, seed=0), 1)
    assert sess.plan.paged is not None
    assert simulate(sess.plan, "cpu").peak_bytes == sess.plan.peak_bytes == sess.executor.pool.peak


def test_replay_refuses_inconsistent_events():
    from dataclasses import dataclass

    from minidl.memory.plan import Event, EventKind

    plan = planned(NETS["dropnet"](), SGD(0.1), "liveness")
    sp = next(sp for sp in plan.steps if any(e.kind is EventKind.ALLOC for e in sp.before))
    i, first = next((i, e) for i, e in enumerate(sp.before) if e.kind is EventKind.ALLOC)
    sp.before.insert(i + 1, Event(EventKind.ALLOC, first.tensor, first.offset, first.nbytes))
    with pytest.raises(ValueError, match=f"replay: alloc of '{first.tensor}', which is already resident"):
        replay_peak(plan)
    plan = planned(NETS["dropnet"](), SGD(0.1), "liveness")
    plan.steps[-1].after.append(Event(EventKind.FREE, "act:nowhere"))
    with pytest.raises(ValueError, match="replay: free of 'act:nowhere', which is not resident"):
        replay_peak(plan)

    @dataclass(frozen=True)
    class Bogus:
        value: str = "bogus"

    plan = planned(NETS["dropnet"](), SGD(0.1), "liveness")
    plan.steps[0].before.append(Event(Bogus(), "act:x"))
    with pytest.raises(ValueError, match="replay: event kind 'bogus' has no memory effect declared"):
        replay_peak(plan)


def test_event_kinds_declare_their_memory_effect():
    """Whether a kind allocates or frees is said once, by `EventKind`; the planner, the replay, the timeline and
    --explain all read it there. Every kind does at most one of the two."""
    from minidl.memory.plan import EventKind

    takes = {EventKind.ALLOC, EventKind.PREFETCH, EventKind.RECOMPUTE, EventKind.COMPRESS, EventKind.DECOMPRESS}
    gives = {EventKind.FREE, EventKind.RELEASE}
    for kind in EventKind:
        assert kind.allocates == (kind in takes) and kind.frees == (kind in gives), kind
        assert not (kind.allocates and kind.frees), kind


def test_tensor_id_helpers_and_owners():
    """Tensor ids are made and read by `core.tensors` alone: the owner of every planned tensor is in its spec
    (what recomputation, the simulator and the executor look a layer up by), and a compressed block names the
    tensor it stores."""
    from minidl.core.tensors import compressed_id, compressed_source, id_name

    assert id_name("act:conv1") == "conv1" and id_name("param:fc.weight") == "fc.weight" and id_name("fc") == "fc"
    assert compressed_source(compressed_id("act:conv1")) == "act:conv1" and compressed_source("act:conv1") is None
    net = NETS["dropnet"]()
    plan = planned(net, SGD(0.1), "recompute", budget=None)
    names = {n.name for n in net.nodes}
    assert all(spec.owner in names for spec in plan.route.tensors.values())


def test_sizes_zero_is_a_size_and_negative_is_not():
    """`--host-limit 0` (every offload to disk) needs 0 to parse; a mutant refusing it survived the pool tests."""
    from minidl.memory.pool import parse_size

    assert parse_size(0) == 0 and parse_size("0") == 0 and parse_size("1KiB") == 1024
    with pytest.raises(ValueError, match="cannot be negative, got -1"):
        parse_size(-1)
    with pytest.raises(ValueError, match="memory size 'lots'"):
        parse_size("lots")


def test_out_of_memory_says_fragmented_when_exactly_the_request_is_free_in_pieces():
    from minidl.memory.pool import PoolOutOfMemory, TensorPool

    pool = TensorPool(4 * 512)
    a, _, c, _ = (pool.alloc(512, tag=t) for t in "abcd")
    pool.free(a)
    pool.free(c)  # 1024 bytes free in total, in two 512-byte holes
    with pytest.raises(PoolOutOfMemory) as e:
        pool.alloc(1024, tag="big")
    assert e.value.free_bytes == 1024 and e.value.requested == 1024
    assert "fragmented" in str(e.value) and "not enough free memory in total" not in str(e.value)


def _peak_from_events(plan) -> int:
    """The most bytes live at once, summed from the plan's events alone (blocks rounded as the pool rounds):
    a second derivation beside memory/replay.py, with no pool and no offsets."""
    from minidl.memory.plan import EventKind
    from minidl.memory.pool import align_up

    takes = {EventKind.ALLOC, EventKind.PREFETCH, EventKind.RECOMPUTE, EventKind.COMPRESS, EventKind.DECOMPRESS}
    gives = {EventKind.FREE, EventKind.RELEASE}
    live: dict[str, int] = {}
    now = peak = 0
    for ev in [*plan.setup] + [ev for sp in plan.steps for ev in sp.before + sp.after]:
        if ev.kind in takes:
            live[ev.tensor] = align_up(ev.nbytes)
            now += live[ev.tensor]
            peak = max(peak, now)
        elif ev.kind in gives:
            now -= live.pop(ev.tensor)
    return peak


@pytest.mark.parametrize("policy, share", [("liveness", None), ("recompute", None), ("offload", 0.7),
                                           ("window", 0.7), ("compress", None)])
def test_the_simulated_peak_is_replayed_not_read_from_the_plan(policy, share):
    """The simulator's peak follows the plan's events, never its recorded figure: a copy of the plan whose
    `peak_bytes` says something else (more, less, zero) simulates to the same peak, which equals the peak summed
    from the events by hand."""
    import dataclasses

    net = NETS["resnet20"]()
    budget = None
    if share:
        budget = int(planned(NETS["resnet20"](), SGD(0.1), "liveness").min_budget_bytes * share)
        try:
            planned(NETS["resnet20"](), SGD(0.1), policy, budget)
        except BudgetError as e:
            budget = e.min_budget_bytes
    plan = planned(net, SGD(0.1), policy, budget)
    assert plan.offloaded_bytes > 0 or not share
    want = _peak_from_events(plan)
    assert want == plan.peak_bytes == simulate(plan, "cpu").peak_bytes
    for lie in (0, plan.peak_bytes - 512, plan.peak_bytes + 4096, 2 * plan.peak_bytes):
        assert simulate(dataclasses.replace(plan, peak_bytes=lie), "cpu").peak_bytes == want, lie


def test_plans_are_placed_and_finalized_by_the_planner_alone():
    """`planner.place` and `planner.finalize` are the one way to a plan: no scheduler reaches into the planner's
    private placement, and every policy's plan carries the same finishing (lower bound, arena = the budget,
    transfer bytes counted from its events)."""
    import re
    from pathlib import Path

    import minidl.memory as memory
    from minidl.memory.planner import transfer_bytes

    root = Path(memory.__file__).parent
    private = [str(p.relative_to(root)) for p in root.rglob("*.py")
               if re.search(r"planner import[^\n]*\b_place\b|\bdef _finish\(", p.read_text())]
    assert not private, private
    net = NETS["dropnet"]()
    for policy in ("none", "liveness", "offload", "window", "auto"):
        plan = planned(net, SGD(0.1), policy)
        budget = plan.min_budget_bytes + 4096
        plan = planned(net, SGD(0.1), policy, budget=budget)
        assert plan.arena_bytes == budget and plan.policy == policy, policy
        assert plan.lower_bound_bytes > 0 and (plan.offloaded_bytes, plan.prefetched_bytes) == transfer_bytes(plan)


def test_policy_none_is_a_schedule_the_one_placement_pass_places():
    """`none` is `planner.none_schedule` placed like any schedule: the placement pass never branches on a
    policy's name (placing it under any name gives the same events), and nothing is freed in a step."""
    import inspect

    from minidl.memory import planner
    from minidl.memory.planner import default_workspace, none_schedule, place

    assert "policy ==" not in inspect.getsource(planner)
    ref = planned(NETS["dropnet"](), SGD(0.1), "none")
    route = ref.route
    ws = default_workspace(route)
    got = place(route, ws, none_schedule(route, ws), policy="anything")
    assert got.setup == ref.setup and got.steps == ref.steps and got.min_budget_bytes == ref.min_budget_bytes
    assert not [ev for sp in got.steps for ev in sp.before + sp.after if ev.kind.frees]
    assert all(sp.in_use == got.peak_bytes for sp in got.steps)
