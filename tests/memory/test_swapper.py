"""The virtual-memory baseline Harmony is compared with: bytes each micro-batch swaps (weights in twice, gradients
out, the stash out and back), how many micro-batches it needs, its timeline, and GPipe's stage crossings."""
from dataclasses import replace

import pytest

from minidl.core.errors import BudgetError, OptionError
from minidl.core.tensors import Role
from minidl.graph.route import Phase
from minidl.memory.schedulers.packs import step_floor
from minidl.memory.simulate import get_profile
from minidl.memory.swapper import SwapTask, micro_batch_sizes, simulate_swapper, swap_tasks, timeline

from .test_packs import plain_net

SLOTS = ("momentum",)


def _bytes(route, role):
    return sum(t.nbytes for t in route.tensors.values() if t.role is role)


def _stash(route):
    """Activations and aux a backward step reads (what the swapper sends home after forward)."""
    read = {tid for s in route.steps if s.phase is Phase.BACKWARD for tid in s.reads}
    return sum(t.nbytes for t in route.tensors.values() if t.role in (Role.ACTIVATION, Role.AUX) and t.id in read)


def test_each_micro_batch_swaps_weights_twice_gradients_out_and_the_stash_out_and_in():
    route = plain_net(4).route(optimizer_slots=SLOTS, fused_update=True)
    tasks = swap_tasks(route, get_profile("gtx1080ti"))
    w, g, stash = _bytes(route, Role.PARAMETER), _bytes(route, Role.GRADIENT), _stash(route)
    assert stash > 0
    fwd = [t for t in tasks if t.phase is Phase.FORWARD]
    bwd = [t for t in tasks if t.phase is Phase.BACKWARD]
    assert sum(t.in_bytes["weights"] for t in fwd) == w == sum(t.in_bytes["weights"] for t in bwd)
    assert sum(t.out_bytes["gradients"] for t in bwd) == g == w
    assert sum(t.out_bytes["activations"] for t in fwd) == stash == sum(t.in_bytes["activations"] for t in bwd)
    assert all(t.swap_in == t.swap_out == 0 for t in tasks if t.phase is Phase.UPDATE)   # host update


def test_data_parallel_re_swaps_per_micro_batch_on_every_replica():
    """Forced to micro-batches of 2 by the device's size, 2 replicas at batch 8 run 2 micro-batches each: the
    weights cross the link 2 x 2 x 2 times (in for forward and for backward), the gradients 2 x 2 times."""
    build = plain_net
    two = build(2).route(optimizer_slots=SLOTS, fused_update=True)
    four = build(4).route(optimizer_slots=SLOTS, fused_update=True)
    size = 2 * step_floor(two)
    assert 2 * step_floor(four) > size
    prof = get_profile(f"gtx1080ti:{size}B")
    r = simulate_swapper(build, 8, 2, prof, "dp", SLOTS)
    assert (r.micro_batch, r.micro_batches, r.devices) == (2, 2, 2)
    w = _bytes(two, Role.PARAMETER)
    assert r.host_by_role["weights"] == 2 * 2 * 2 * w
    assert r.host_by_role["gradients"] == 2 * 2 * w
    assert r.host_by_role["activations"] == 2 * 2 * 2 * _stash(two)
    assert r.host_bytes == sum(r.host_by_role.values()) and r.p2p_bytes == 0
    assert r.step_time_s >= r.compute_time_s > 0
    # a device that holds batch 4's working set runs one micro-batch per replica: half the weight traffic
    big = simulate_swapper(build, 8, 2, "gtx1080ti", "dp", SLOTS)
    assert big.micro_batches == 1 and big.host_by_role["weights"] == r.host_by_role["weights"] // 2


def test_micro_batch_sizes_fit_and_refuse_below_one_sample():
    sizes = micro_batch_sizes(plain_net, 8, get_profile("gtx1080ti"))
    assert [u for u, _, _ in sizes] == [8, 4, 2, 1]
    assert all(need <= get_profile("gtx1080ti").usable_bytes for _, _, need in sizes)
    tiny = get_profile("gtx1080ti:1KB")
    with pytest.raises(BudgetError, match="one sample's busiest step"):
        micro_batch_sizes(plain_net, 8, tiny)
    with pytest.raises(OptionError, match="mode"):
        simulate_swapper(plain_net, 8, 2, "gtx1080ti", "zero")
    with pytest.raises(OptionError, match="must divide the batch"):
        simulate_swapper(plain_net, 6, 4, "gtx1080ti", "dp")


def test_timeline_overlaps_copies_with_compute_and_waits_for_inputs():
    prof = replace(get_profile("gtx1080ti"), link_bw=1.0, duplex=True)
    assert timeline([SwapTask(0, Phase.FORWARD, "a", 2.0), SwapTask(1, Phase.FORWARD, "b", 3.0)], prof) == 5.0
    # step b's 4 bytes come in while a computes (2 s): b starts at 4 s, not 6
    tasks = [SwapTask(0, Phase.FORWARD, "a", 2.0, {"weights": 1}),
             SwapTask(1, Phase.FORWARD, "b", 1.0, {"weights": 4})]
    assert timeline(tasks, prof) == 1.0 + 4.0 + 1.0
    # outputs go out after the step, on their own stream when duplex, on the one stream otherwise
    out = [SwapTask(0, Phase.FORWARD, "a", 1.0, {}, {"activations": 3}),
           SwapTask(1, Phase.FORWARD, "b", 1.0, {"weights": 2})]
    assert timeline(out, prof) == 4.0                                    # a: 0-1, out 1-4; b in 0-2, runs 2-3
    assert timeline(out, replace(prof, duplex=False)) == 7.0        # b's copy in queues behind a's out (1-4)


def test_gpipe_crosses_stages_device_to_device_and_fills_its_pipeline():
    r1 = simulate_swapper(plain_net, 8, 1, "gtx1080ti", "pp", SLOTS)
    r2 = simulate_swapper(plain_net, 8, 2, "gtx1080ti", "pp", SLOTS)
    assert r1.p2p_bytes == 0 and r2.p2p_bytes > 0 and r2.devices == 2
    assert r1.host_bytes == r2.host_bytes or r1.micro_batches != r2.micro_batches
    assert r2.step_time_s > 0 and r2.compute_time_s <= r1.compute_time_s
