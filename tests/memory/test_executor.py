"""The planned executor: infeasible budgets fail before any compute, residency is enforced, the budget is real
memory, and the lanes do not change the bits (every policy's bits and peaks against `none`:
tests/runtime/test_policy_matrix.py)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import minidl as dl
from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.cpu.menu import CPUMenu
from minidl.data import synthetic
from minidl.memory.plan import EventKind
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import RunConfig, Session
from tests import sessions
from tests.planning import planned

NETS = {
    "lenet": dict(name="lenet", batch=8, image_size=28, num_classes=10, in_channels=1),
    "resnet20": dict(name="resnet", depth=20, batch=4, image_size=32, num_classes=10),
    "densenet_tiny": dict(name="densenet", variant="tiny", batch=4, image_size=16, num_classes=10),
}


def make(key):
    kw = dict(NETS[key])
    return build_model(kw.pop("name"), **kw)


def data_for(net, n=64, seed=0):
    return synthetic(n, net.input_nodes[0].shape[1:], net.logits_node.shape[1], seed=seed)


def train(key, policy, steps=5, budget=None, **kw):
    return sessions.train(make(key), policy, budget, steps, n=64, seed=0, **kw)


def test_liveness_saves_memory():
    none = planned(make("resnet20"), SGD(lr=0.1, momentum=0.9), "none")
    live = planned(make("resnet20"), SGD(lr=0.1, momentum=0.9), "liveness")
    assert live.peak_bytes < none.peak_bytes / 2
    assert live.min_budget_bytes >= live.peak_bytes


def test_budget_too_small_fails_before_compute_and_names_minimum():
    net = make("resnet20")
    opt = SGD(lr=0.1, momentum=0.9)
    plan = planned(net, opt, "liveness")
    with pytest.raises(dl.BudgetError) as e:
        Session(net, opt, policy="liveness", budget=plan.min_budget_bytes - 512)
    assert e.value.min_budget_bytes == plan.min_budget_bytes
    assert f"{plan.min_budget_bytes:,} B" in str(e.value)
    assert e.value.binding in str(e.value)
    # Exactly the minimum works.
    Session(net, opt, policy="liveness", budget=plan.min_budget_bytes).fit(data_for(net), 1)


def test_plan_offsets_never_overlap():
    plan = planned(make("densenet_tiny"), SGD(lr=0.1), "liveness")
    live: dict[str, tuple[int, int]] = {}
    for ev in plan.setup:
        live[ev.tensor] = (ev.offset, ev.offset + ev.nbytes)
    for sp in plan.steps:
        for ev in sp.before + sp.after:
            if ev.kind is EventKind.ALLOC:
                lo, hi = ev.offset, ev.offset + max(ev.nbytes, 1)
                for t, (a, b) in live.items():
                    assert hi <= a or b <= lo, (ev.tensor, t)
                live[ev.tensor] = (lo, hi)
            elif ev.kind is EventKind.FREE:
                del live[ev.tensor]


def test_residency_is_enforced():
    """Free an activation one step too early: the executor refuses to hand it to the layer that needs it."""
    net = make("lenet")
    sess = Session(net, SGD(lr=0.1), policy="liveness", config=RunConfig(debug=True))
    steps = sess.plan.steps
    # find a FREE after a forward step of a tensor that a later step reads, and move it earlier
    victim = None
    for k, sp in enumerate(steps):
        for ev in sp.before:
            if ev.kind is EventKind.ALLOC and ev.tensor.startswith("act:") and k + 1 < len(steps):
                victim = (k, ev)
                break
        if victim:
            break
    k, ev = victim
    steps[k].after.insert(0, type(ev)(EventKind.FREE, ev.tensor, ev.offset, ev.nbytes))
    for sp in steps[k + 1:]:
        sp.after = [e for e in sp.after if not (e.kind is EventKind.FREE and e.tensor == ev.tensor)]
    with pytest.raises(dl.ResidencyError, match=ev.tensor):
        sess.fit(data_for(net), 1)


def test_evaluate_leaves_pool_as_it_was():
    net = make("resnet20")
    sess = Session(net, SGD(lr=0.1), policy="liveness")
    d = data_for(net)
    before = sess.executor.pool.in_use
    loss, acc = sess.evaluate(d)
    assert np.isfinite(loss) and 0 <= acc <= 1
    assert sess.executor.pool.in_use == before


def test_checkpoint_resume_is_exact(tmp_path):
    def fresh():
        net = make("resnet20")
        return Session(net, SGD(lr=0.05, momentum=0.9), policy="liveness", seed=7), data_for(net)

    a, d = fresh()
    a.fit(d, 3)
    path = a.save(tmp_path / "ck.npz")
    a.fit(d, 3)
    b, d2 = fresh()
    b.load(path)
    b.fit(d2, 3)
    for k, v in a.executor.state_dict().items():
        assert np.array_equal(v, b.executor.state_dict()[k]), k
    assert not list(tmp_path.glob("*.tmp"))


RSS_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    from minidl.data import synthetic
    from minidl.models import build_model
    from minidl.optim import SGD
    from minidl.runtime.session import RunConfig, Session
    net = build_model("resnet", depth=20, batch=32, image_size=32, num_classes=10)
    sess = Session(net, SGD(lr=0.05, momentum=0.9), policy="liveness", seed=0)
    data = synthetic(128, (3, 32, 32), 10, seed=0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sess.fit(data, 3)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"growth": after - before, "pool_peak": sess.executor.pool.peak, "before": before}))
""")


def test_budget_is_real_not_bookkeeping():
    """Peak resident memory grows during training by no more than the pool's peak + 10% + 64 MiB.

    Run in a fresh process (no torch imported) so an earlier peak cannot hide the growth. `before` is taken
    after the arena is reserved but before any step touches it, so the growth counts the arena pages the plan
    really uses plus anything a kernel allocated outside the pool.
    """
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    import json

    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["growth"] <= r["pool_peak"] * 1.1 + 64 * 2**20, r


@pytest.mark.bits
@pytest.mark.parametrize("policy", ["none", "recompute", "offload"])
def test_lanes_do_not_change_the_bits(policy):
    """The convolution lanes (`cpu.lanes`), the compiled kernels' workers and the product blocks: the parameters
    after training are the same bits with one, two or three threads, under every policy (ResNet-20's layers run
    Winograd, the row-shift pair, im2col and a dense product; with the BLAS's threads left at 2, as a machine
    may have them: the step pins them at any lane count)."""
    kw = {}
    if policy == "offload":
        kw["budget"] = int(planned(make("resnet20"), SGD(lr=0.05, momentum=0.9, weight_decay=1e-4),
                                        "liveness").peak_bytes * 0.8)
    states = []
    with threadpool_limits(2, user_api="blas"):
        for threads in (1, 2, 3):
            be = CPUBackend(CPUMenu(threads=threads))
            states.append(train("resnet20", policy, steps=2, backend=be, **kw).executor.state_dict())
    for other in states[1:]:
        for name in states[0]:
            assert np.array_equal(states[0][name], other[name]), name
