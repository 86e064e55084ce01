"""Harmony across devices (simulator): per-device plans are single-device plans, a pipeline of one device is the
single-device pack plan, exact bytes passed device to device, the budget checked per device, the replicas
baseline, and `minidl plan --devices N`."""
import json

import pytest

import minidl as dl
from minidl.cli import main
from minidl.core.errors import BudgetError
from minidl.core.tensors import Role
from minidl.graph.packs import even_packs
from minidl.layers import Conv2d, Linear, MaxPool2d, ReLU, SoftmaxCrossEntropy
from minidl.memory.decisions.weights import moved_by_role, plan_weights
from minidl.memory.planner import make_plan
from minidl.memory.schedulers.pipeline import (
    CUTS,
    compute_packs,
    min_max_cut,
    pipeline_time,
    plan_pipeline,
    plan_pipeline_fixed,
    plan_replicas,
    search_pipeline,
    sub_routes,
    transfers,
)
from minidl.memory.simulate import get_profile, simulate
from minidl.memory.workspace import workspace_choices

from .test_packs import plain_net

SLOTS = ("momentum",)
BIG = 10**9


def _events(plan):
    return [[(e.kind, e.tensor, e.offset, e.nbytes) for e in sp.before + sp.after] for sp in plan.steps]


def fc_net(batch=8):
    """Weights bigger than its activations: under a low enough budget every layer's weights must leave."""
    net = dl.Network("fcnet")
    h = net.input((batch, 3, 8, 8), name="data")
    y = net.input((batch,), dtype="int64", name="label")
    h = MaxPool2d(2, name="pool0")(ReLU(name="relu0")(Conv2d(4, 3, padding=1, name="conv0")(h)))
    for i in range(3):
        h = ReLU(name=f"r{i}")(Linear(96, name=f"fc{i}")(h))
    net.set_loss(SoftmaxCrossEntropy(name="loss")(Linear(5, name="fc")(h), y))
    return net


def test_one_device_is_the_single_device_pack_plan():
    net = fc_net()
    route = net.route(optimizer_slots=SLOTS, micro_batches=2, packs=even_packs(net, 4))
    ws = workspace_choices(route)
    resident = plan_weights(route, BIG, "k40c", workspace=ws, layers=[])
    # with room, weights stay resident: the plan is the resident one, nothing moves
    roomy = plan_pipeline_fixed(net, 1, 2, 4, BIG, "k40c", SLOTS).device_plans[0]
    assert roomy.homed_layers == 0 and _events(roomy.plan) == _events(resident) and roomy.host_bytes == 0
    # a budget at which every layer's weights must be homed (policy packs' minimum, then lower until homing
    # fewer layers no longer fits): there the pipeline's one device is policy `packs`' plan exactly
    with pytest.raises(BudgetError) as e:
        plan_weights(route, 1, "k40c", workspace=ws, policy="packs")
    budget = e.value.min_budget_bytes
    for _ in range(64):
        dev = plan_pipeline_fixed(net, 1, 2, 4, budget, "k40c", SLOTS).device_plans[0]
        if dev.homed_layers == dev.candidate_layers:
            break
        budget -= 512
    assert dev.homed_layers == dev.candidate_layers == 5
    single = plan_weights(route, budget, "k40c", workspace=ws, policy="packs")
    pipe = plan_pipeline_fixed(net, 1, 2, 4, budget, "k40c", SLOTS)
    (dev,) = pipe.device_plans
    assert dev.plan.peak_bytes == single.peak_bytes
    assert dev.plan.min_budget_bytes == single.min_budget_bytes
    assert _events(dev.plan) == _events(single)
    assert dev.host_bytes == sum(moved_by_role(single).values()) > 0
    assert pipe.p2p_bytes == 0
    assert pipe.step_time_s == pytest.approx(simulate(single, "k40c").est_step_time_s, rel=1e-12)


def test_fewest_layers_homed_first():
    """Between all resident and all homed: the largest layers' weights go first, and only as many as needed."""
    net = fc_net()
    route = net.route(optimizer_slots=SLOTS, micro_batches=2, packs=even_packs(net, 4))
    resident = plan_weights(route, BIG, "k40c", workspace=workspace_choices(route), layers=[])
    found = {}
    budget = resident.min_budget_bytes
    while budget > 0:
        budget -= 4096
        try:
            dev = plan_pipeline_fixed(net, 1, 2, 4, budget, "k40c", SLOTS).device_plans[0]
        except BudgetError:
            break
        found.setdefault(dev.homed_layers, dev)
    for n, dev in found.items():
        homed = {dev.plan.route.tensors[t].owner for sp in dev.plan.steps for e in sp.before
                 if e.kind.value == "prefetch" and dev.plan.role_of(e.tensor) is Role.PARAMETER
                 for t in [e.tensor]}
        assert len(homed) == n
        sizes = {o: sum(s.nbytes for s in route.tensors.values() if s.owner == o and s.role is Role.PARAMETER)
                 for o in ("conv0", "fc0", "fc1", "fc2", "fc")}
        assert all(sizes[h] >= sizes[o] for h in homed for o in set(sizes) - homed)
    assert 0 in found and set(found) & {1, 2, 3, 4}


def test_two_devices_exact_bytes():
    net = plain_net(batch=8)
    pipe = plan_pipeline_fixed(net, 2, 2, 2, BIG, "k40c", SLOTS)
    assert pipe.packs == [["conv0", "relu0", "pool0", "conv1", "relu1", "pool1", "fc0", "r"], ["fc", "loss"]]
    # the boundary is r's output, (4, 16) float32 per micro-batch: forward it goes 0 -> 1, its delta 1 -> 0
    route = net.route(optimizer_slots=SLOTS, micro_batches=2, packs=pipe.packs)
    parts, step_dev = sub_routes(route, 2)
    assert [(t[2], t[3], t[4]) for t in transfers(route, step_dev)] == [
        (1, "act:r@0", 256), (1, "act:r@1", 256), (0, "delta:r@0", 256), (0, "delta:r@1", 256)]
    assert pipe.p2p_bytes == 1024
    assert pipe.host_bytes == 0
    assert [d.peak_bytes for d in pipe.device_plans] == [46080, 5632]  # device 0 peaks in conv1's backward
    # each device's plan is an ordinary single-device plan of its sub-route: liveness on it gives the same peak
    for sub, d in zip(parts, pipe.device_plans):
        assert d.peak_bytes == make_plan(sub, "liveness", None, workspace=workspace_choices(sub)).peak_bytes
    # every step runs on exactly one device; each device holds only its own packs' weights
    assert sum(len(p.steps) for p in parts) == len(route.steps)
    params = {t for t, s in route.tensors.items() if s.role is Role.PARAMETER}
    on = [{t for t in p.tensors if t in params} for p in parts]
    assert on[0] | on[1] == params and not on[0] & on[1]
    assert on[1] == {"param:fc.weight", "param:fc.bias"}


def test_budget_checked_per_device():
    net = plain_net(batch=8)
    pipe = plan_pipeline_fixed(net, 2, 2, 2, BIG, "k40c", SLOTS)
    need0 = pipe.device_plans[0].plan.min_budget_bytes
    with pytest.raises(BudgetError, match="device 0 of the pipeline"):
        plan_pipeline_fixed(net, 2, 2, 2, 4096, "k40c", SLOTS)
    # device 1's plan does not depend on device 0's budget trouble: planned alone, it is the same
    small = pipe.device_plans[1].plan.min_budget_bytes
    assert small < need0


def test_pipeline_time_waits_for_the_other_device():
    net = plain_net(batch=8)
    pipe = plan_pipeline_fixed(net, 2, 2, 2, BIG, "k40c", SLOTS)
    route = net.route(optimizer_slots=SLOTS, micro_batches=2, packs=pipe.packs)
    _, step_dev = sub_routes(route, 2)
    prof = get_profile("k40c")
    solo = [simulate(d.plan, prof).est_step_time_s for d in pipe.device_plans]
    t = pipeline_time(route, step_dev, [d.plan for d in pipe.device_plans], prof)
    assert t == pytest.approx(pipe.step_time_s)
    # never faster than the busier device alone, never slower than both devices one after the other plus copies
    assert max(solo) * (1 - 1e-12) <= t <= sum(solo) + 1024 / prof.peer_bw


def test_search_and_replicas():
    net = plain_net(batch=8)
    pipe = plan_pipeline(net, 2, BIG, "k40c", SLOTS)
    assert pipe.devices == 2 and 8 % pipe.micro_batches == 0 and len(pipe.packs) >= 2
    assert compute_packs(net, 2)[-1][-1] == "loss"
    base = plan_replicas(plain_net(batch=4), 2, BIG, "k40c", SLOTS)
    grads = sum(s.nbytes for s in net.route().tensors.values() if s.role is Role.PARAMETER)
    assert base.allreduce_bytes == 2 * (2 * (2 - 1) * grads // 2)
    assert base.host_bytes == 0 and base.plan.policy == "auto"
    # under a budget below its training state, each replica homes weights on the host: N x one replica's bytes
    tight = plan_replicas(plain_net(batch=4), 2, base.plan.min_budget_bytes // 2, "k40c", SLOTS)
    assert tight.host_bytes == 2 * sum(moved_by_role(tight.plan).values()) > 0


def test_cli_plan_devices(capsys):
    main(["plan", "lenet", "--batch", "4", "--micro-batches", "2", "--devices", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["devices"] == 2 and len(out["per_device"]) == 2
    assert out["pipeline"]["device_bytes"] > 0 and out["replicas"]["device_bytes"] > 0
    assert out["pipeline"]["peak_bytes"] == max(d["peak_bytes"] for d in out["per_device"])
    lean, fast = out["least_swap"]["pipeline"], out["pipeline"]
    assert (lean["host_bytes"], lean["device_bytes"]) <= (fast["host_bytes"], fast["device_bytes"])
    main(["plan", "lenet", "--batch", "4", "--micro-batches", "2", "--devices", "2", "--device", "k40c"])
    text = capsys.readouterr().out
    assert "pipeline over 2 x k40c" in text and "data-parallel replicas" in text
    main(["plan", "lenet", "--batch", "4", "--micro-batches", "2", "--devices", "2"])
    assert "pipeline over 2 x cpu" in capsys.readouterr().out   # no --device: where train runs, as for a plan
    assert main(["plan", "lenet", "--batch", "3", "--devices", "2"]) == 2
    assert "--devices 2: the batch of 3" in capsys.readouterr().err


def test_min_max_cut():
    # the smallest largest run: [5] [1 1 1 1 1] [5] -> 5 each; greedy by running totals would not find it
    assert min_max_cut([5, 1, 1, 1, 1, 1, 5], 3) == [0, 1, 6]
    assert min_max_cut([1, 1, 1, 1], 2) == [0, 2]
    assert min_max_cut([3, 0, 0, 1], 4)[0] == 0
    assert min_max_cut([1.0], 3) == [0]


def test_cuts_cover_every_layer_in_order():
    net = plain_net(batch=8)
    names = [n.name for n in net.layer_nodes]
    for cut in CUTS.values():
        for n in (1, 2, 3, 20):
            packs = cut(net, n)
            assert [x for p in packs for x in p] == names and all(packs) and len(packs) <= max(1, min(n, len(names)))
    # the convolutions hold most of plain_net's FLOPs, the fully connected layers most of its weights
    assert compute_packs(net, 2)[0][0] == "conv0" and "conv1" not in compute_packs(net, 2)[0]


def test_objectives_pick_from_the_same_candidates():
    net = plain_net(batch=8)
    found = search_pipeline(net, 2, BIG, "k40c", SLOTS)
    fast = plan_pipeline(net, 2, BIG, "k40c", SLOTS, objective="time")
    lean = plan_pipeline(net, 2, BIG, "k40c", SLOTS, objective="swap")
    assert fast.step_time_s == min(r.step_time_s for r in found)
    assert (lean.host_bytes, lean.p2p_bytes) == min((r.host_bytes, r.p2p_bytes) for r in found)
    assert lean.step_time_s >= fast.step_time_s and lean.p2p_bytes <= fast.p2p_bytes


def test_weights_on_the_host_swap_each_packs_weights_once_per_block_whatever_fits():
    """`weights="host"` is Harmony's runtime: every layer's weights live on the host and visit their device per
    pack block, the gradient going out once, even where the device could hold them (the default keeps them
    resident then, moving nothing)."""
    net = plain_net(8)
    params = sum(t.nbytes for t in net.route().tensors.values() if t.role is Role.PARAMETER)
    fit = plan_pipeline_fixed(net, 2, 2, 4, BIG, "gtx1080ti", SLOTS, cut="compute")
    host = plan_pipeline_fixed(net, 2, 2, 4, BIG, "gtx1080ti", SLOTS, cut="compute", weights="host")
    assert fit.host_bytes == 0 and all(d.homed_layers == 0 for d in fit.device_plans)
    assert all(d.homed_layers == d.candidate_layers > 0 for d in host.device_plans)
    moved = {k: sum(d.host_by_role[k] for d in host.device_plans) for k in ("weights", "gradients")}
    # in for the forward block and again for the backward block, unless a device's two blocks touch (one visit)
    assert params <= moved["weights"] <= 2 * params and moved["gradients"] == params
    assert host.host_bytes == moved["weights"] + moved["gradients"]
    with pytest.raises(dl.OptionError, match="weights must be"):
        plan_pipeline_fixed(net, 2, 2, 4, BIG, "gtx1080ti", SLOTS, weights="resident")
