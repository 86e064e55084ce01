"""The compress decision: which tensors it picks, how the plan reserves their streams, and that the executor keeps
to the plan (pool peak = plan peak, byte for byte) whether streams fit their blocks or spill; lossy but
deterministic, and close to the exact gradients."""
from __future__ import annotations

import math

import numpy as np
import pytest

from minidl.codec.sz import HEADER_BYTES
from minidl.core.errors import BudgetError
from minidl.core.tensors import act_id
from minidl.memory.decisions import compress as zc
from minidl.memory.errorbound import ErrorBoundRule, Reader, ReaderKind
from minidl.memory.planner import default_workspace, liveness_schedule
from minidl.memory.policies import available_policies
from minidl.optim import SGD
from minidl.runtime.executor import Executor
from tests.planning import planned

from .nets import NETS


def _batch(net, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(net.input_nodes[0].shape).astype(np.float32)
    y = rng.integers(0, 5, net.input_nodes[1].shape)
    return x, y


def _train(net, plan, steps=2, seed=0):
    opt = SGD(lr=0.05, momentum=0.9)
    ex = Executor(net, plan, opt, seed=seed, debug=True)
    x, y = _batch(net)
    losses = [ex.train_step(x, y) for _ in range(steps)]
    return ex, losses


def _plan(net, policy="compress", **kw):
    opt = SGD(lr=0.05, momentum=0.9)
    if kw:
        route = net.route(training=True, optimizer_slots=tuple(opt.slots))
        return zc.plan_compress(route, None, **kw)
    return planned(net, opt, policy)


def test_policy_is_in_the_table():
    assert "compress" in available_policies()


def test_candidates_follow_the_readers():
    """ReLU outputs read by a max-pool's backward stay exact; conv/BN/ReLU/linear readers allow compression."""
    net = NETS["dropnet"]()
    readers = zc.backward_readers(net.route(training=True))
    assert readers[act_id("relu0")] is None                      # read by pool0's backward: argmax must not move
    assert {r.kind for r in readers[act_id("conv0")]} == {ReaderKind.NORMALIZE}
    assert {r.kind for r in readers[act_id("fc_relu")]} == {ReaderKind.SIGN}
    route = net.route(training=True)
    chosen = {c.tensor for c in zc.find_candidates(route, liveness_schedule(route, default_workspace(route)))}
    assert act_id("relu0") not in chosen and act_id("label") not in chosen
    assert {act_id("conv0"), act_id("conv1"), act_id("data")} <= chosen


def test_reserve_is_capped_at_raw_plus_header():
    assert zc.reserve_bytes(1000, None) == math.ceil(1000 / zc.DEFAULT_RATIO * zc.MARGIN) + HEADER_BYTES
    assert zc.reserve_bytes(1000, 4.0) == math.ceil(1000 / 4.0 * zc.MARGIN) + HEADER_BYTES
    assert zc.reserve_bytes(1000, 0.5) == 1000 + HEADER_BYTES
    assert zc.reserve_bytes(1000, float("nan")) == zc.reserve_bytes(1000, None)


@pytest.mark.parametrize("name", ["resnet20", "dropnet"])
def test_pool_peak_equals_plan_peak_and_runs_are_deterministic(name):
    net = NETS[name]()
    plan = _plan(net)
    assert zc.compressed_tensors(plan)
    ex, losses = _train(net, plan)
    assert ex.pool.peak == plan.peak_bytes
    ex2, losses2 = _train(net, _plan(net))
    assert losses == losses2
    for k, v in ex.state_dict().items():
        assert np.array_equal(v, ex2.state_dict()[k]), f"{k}: not deterministic run to run"


def test_lossy_but_close_to_none():
    net = NETS["resnet20"]()
    _, exact = _train(net, _plan(net, "none"), steps=3)
    ex, lossy = _train(net, _plan(net), steps=3)
    assert lossy[0] == exact[0]                      # forward of the first step is untouched
    assert lossy != exact                            # lossy: not bit-identical
    assert np.allclose(lossy, exact, rtol=0.05)


def test_streams_that_do_not_fit_spill_to_the_host_and_change_nothing():
    """Reserving for an absurd ratio makes every stream spill: no crash, the pool still holds only what the plan
    placed, and the result is bit-identical to the run whose streams fit (same streams, other place)."""
    net = NETS["resnet20"]()
    route_plan = _plan(net)
    tight = _plan(net, ratios={t: 1e6 for t in zc.compressed_tensors(route_plan)})
    assert tight.peak_bytes < route_plan.peak_bytes
    ex_fit, _ = _train(net, route_plan)
    ex_spill, _ = _train(net, tight)
    assert ex_spill.compressed.spill_count > 0 and not ex_spill.compressed.spilled
    assert ex_spill.pool.peak == tight.peak_bytes
    for k, v in ex_fit.state_dict().items():
        assert np.array_equal(v, ex_spill.state_dict()[k])


def test_measured_ratios_replan_without_spills():
    net = NETS["resnet20"]()
    ex, _ = _train(net, _plan(net), steps=1)
    ratios = ex.compressed.ratios()
    assert ratios and all(r > 1 for r in ratios.values())
    replanned = _plan(net, ratios=ratios)
    ex2, _ = _train(net, replanned, steps=2)
    assert ex2.compressed.spill_count == 0 and ex2.pool.peak == replanned.peak_bytes


def test_budget_below_the_plan_fails_early_naming_it():
    net = NETS["resnet20"]()
    plan = _plan(net)
    route = plan.route
    with pytest.raises(BudgetError, match="compress"):
        zc.plan_compress(route, plan.min_budget_bytes - 4096)
    assert zc.plan_compress(route, plan.min_budget_bytes).arena_bytes == plan.min_budget_bytes


def test_rule_b_gives_the_target_relative_gradient_error():
    """The derivation in errorbound.py, checked on a linear layer: with eb from rule B, compressing the input
    changes G = d^T a by about rho* (relative, Frobenius), not by orders of magnitude more or less."""
    from minidl.codec import sz

    rng = np.random.default_rng(0)
    a = np.maximum(rng.standard_normal((256, 512)), 0).astype(np.float32)
    d = (rng.standard_normal((256, 64)) * 0.01).astype(np.float32)
    g = d.T.astype(np.float64) @ a
    rule = ErrorBoundRule(target=0.01)
    rule.observe("fc", g, d)
    eb = rule.bound(a, [Reader("fc", ReaderKind.BILINEAR)])
    a2 = sz.decompress(sz.compress(a, eb), a.shape)
    rel = np.linalg.norm(d.T.astype(np.float64) @ a2 - g) / np.linalg.norm(g)
    assert 0.003 < rel < 0.02, rel
    assert rule.bound(a, [Reader("relu", ReaderKind.SIGN)]) == float(a.max())


def test_only_compression_policies_are_marked_lossy():
    from minidl.memory.policies import exact_policies

    assert set(available_policies()) - set(exact_policies()) == {"compress", "auto-lossy"}


def test_auto_lossy_weighs_compression_by_cost_and_is_opt_in():
    """Without a budget auto-lossy is auto (liveness, nothing compressed). Under a budget the compress plans are
    trials ranked with the codec's time added to the simulator's estimate, and the chosen plan fits. The CLI
    reaches it only with --policy auto --lossy."""
    from minidl.cli import main
    from minidl.memory.schedulers.lossy import codec_s_per_byte, compress_trials, plan_auto_lossy
    from minidl.memory.simulate import simulate

    net = NETS["resnet20"]()
    comp = _plan(net)
    route = comp.route
    assert not zc.compressed_tensors(plan_auto_lossy(route, None))
    budget = comp.min_budget_bytes
    trial = compress_trials(route, budget, "cpu")[0]
    raw = sum(trial.plan.sizes[t] for t in zc.compressed_tensors(trial.plan))
    assert trial.fits and trial.est_step_time_s == simulate(trial.plan, "cpu").est_step_time_s + raw * \
        codec_s_per_byte("cpu")
    plan = plan_auto_lossy(route, budget)
    assert plan.policy == "auto-lossy" and plan.min_budget_bytes <= budget
    with pytest.raises(BudgetError, match="auto-lossy"):
        plan_auto_lossy(route, 4096)
    assert main(["plan", "resnet", "--depth", "20", "--policy", "liveness", "--lossy"]) == 2   # refused, naming it


def test_rule_b_is_the_formula_on_a_known_case():
    """eb = rho* sqrt(3 / F) ||G||_F / ||d||_F, F = the fan-in of one output filter (C * KH * KW), on norms
    known by hand: G all 2 over (4, 3, 3, 3) (F = 27, ||G|| = 2 sqrt(108)), d all 0.5 over 200 entries."""
    rule = ErrorBoundRule(target=0.01)
    rule.observe("conv", np.full((4, 3, 3, 3), 2.0, np.float32), np.full((2, 4, 5, 5), 0.5, np.float32))
    x = np.full((2, 3, 7, 7), 100.0, np.float32)              # max|x| far above the bound: no cap
    want = 0.01 * math.sqrt(3 / 27) * (2 * math.sqrt(108)) / (0.5 * math.sqrt(200))
    assert rule.bound(x, [Reader("conv", ReaderKind.BILINEAR)]) == pytest.approx(want, rel=1e-12)
    # rule B0 (nothing measured) and rule N on known cases too: sqrt(3) rho* rms(a); sqrt(3) rho* / sqrt(mean 1/var)
    assert rule.bound(x, [Reader("other", ReaderKind.BILINEAR)]) == pytest.approx(math.sqrt(3) * 0.01 * 100.0)
    bn = np.stack([np.tile([1.0, -1.0], 8), np.tile([3.0, -3.0], 8)])[None].astype(np.float64)  # var 1 and 9
    assert rule.bound(bn, [Reader("bn", ReaderKind.NORMALIZE)]) == pytest.approx(
        math.sqrt(3) * 0.01 / math.sqrt((1 / (1 + 1e-5) + 1 / (9 + 1e-5)) / 2), rel=1e-12)


def test_rule_b_hits_its_target_under_the_noise_it_assumes():
    """The derivation's own model: errors uniform on [-eb, eb], independent of d. Then the relative error of
    G = d^T a is rho* up to sampling noise (64 x 512 gradient entries: a fraction of a percent), so a band of
    +-5 % around the target holds on any machine, and a bound off by a constant factor (sqrt(1/F) instead of
    sqrt(3/F) gives 0.58 rho*) falls far outside it."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 512))
    d = rng.standard_normal((256, 64)) * 0.01
    g = d.T @ a
    rule = ErrorBoundRule(target=0.01)
    rule.observe("fc", g, d)
    eb = rule.bound(a, [Reader("fc", ReaderKind.BILINEAR)])
    e = rng.uniform(-eb, eb, a.shape)
    rel = np.linalg.norm(d.T @ e) / np.linalg.norm(g)
    assert 0.0095 < rel < 0.0105, rel


def test_each_tensor_is_stored_at_the_bound_the_rule_gives(monkeypatch):
    """What the store encodes with is exactly `rule.bound(x, readers)` at that moment: the bound handed to the
    codec, the one recorded in the figures and the error of the stored stream (decoded back) are checked per
    compression against the rule's own answer, in a training run (rule B adapts from step 2 on)."""
    from minidl.codec import sz
    from minidl.memory.compressed import CompressedStore

    given, encoded = [], []
    real_bound, real_compress = ErrorBoundRule.bound, sz.compress

    def bound(self, x, readers):
        eb = real_bound(self, x, readers)
        given.append(eb)
        return eb

    def compress(x, eb, entropy="none"):
        stream = real_compress(x, eb, entropy)
        encoded.append((eb, float(np.max(np.abs(sz.decompress(stream, x.shape) - x)))))
        return stream

    monkeypatch.setattr(ErrorBoundRule, "bound", bound)
    monkeypatch.setattr(sz, "compress", compress)
    net = NETS["dropnet"]()
    plan = _plan(net)
    ex, _ = _train(net, plan, steps=3)
    store: CompressedStore = ex.compressed
    order = zc.compressed_tensors(plan)      # the order the store compresses them in, every step
    assert order and len(given) == len(encoded) == 3 * len(order)
    for want, (eb, err) in zip(given, encoded):
        assert eb == want and err <= want
    for tid, want in zip(order, given[-len(order):]):
        assert store.figures[tid].eb == want, tid


def test_a_channel_with_no_finite_value_constrains_nothing_and_warns_nothing():
    """A diverging step's activations can be non-finite in whole channels: rule N's variance skips them (numpy's
    nanvar / nanmean warned 'Degrees of freedom <= 0' and 'Mean of empty slice' on them)."""
    import warnings

    rule = ErrorBoundRule()
    bn = [Reader("bn", ReaderKind.NORMALIZE)]
    x = np.random.default_rng(0).standard_normal((4, 3, 5, 5)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = rule.bound_for(x[:, :2], bn[0])
        x[:, 2] = np.nan
        x[0, 2, 0, 0] = np.inf
        assert rule.bound_for(x, bn[0]) == want  # the finite channels alone, as before
        assert rule.bound_for(np.full_like(x, np.inf), bn[0]) == math.inf
        assert rule.bound(np.full_like(x, np.nan), bn) == 1.0  # nothing finite: any bound keeps NaN exactly


def test_a_diverging_compressed_run_stops_with_the_guards_error_alone():
    """lr 1e30 makes step 1's activations non-finite: the compressed store encodes them without a numpy warning,
    and the run stops with the divergence guard's error naming the layer."""
    import warnings

    import minidl as dl
    from minidl.core.errors import DivergenceError
    from minidl.data import synthetic
    from minidl.models import build_model

    net = build_model("resnet", depth=8, batch=8, image_size=8, in_channels=1, num_classes=10)
    sess = dl.Session(net, SGD(1e30, momentum=0.9), policy="compress")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DivergenceError) as e:
            sess.fit(synthetic(64, (1, 8, 8), 10, seed=0), 5)
    assert e.value.layer and e.value.layer in str(e.value)


def chain_net(batch=8):
    """Convolutions and ReLUs only: nothing to recompute (a ReLU's output is as large as the convolution's it
    would save), so under a tight budget an exact plan must move the activations themselves."""
    import minidl as dl
    from minidl.layers import Conv2d, Linear, MaxPool2d, ReLU, SoftmaxCrossEntropy

    net = dl.Network("chain")
    h = net.input((batch, 3, 32, 32), name="data")
    y = net.input((batch,), dtype="int64", name="label")
    for i in range(4):
        h = ReLU(name=f"relu{i}")(Conv2d(8, 3, padding=1, name=f"conv{i}")(h))
    net.set_loss(SoftmaxCrossEntropy(name="loss")(Linear(5, name="fc")(MaxPool2d(2, name="pool")(h)), y))
    return net


def test_auto_lossy_compresses_and_offloads_where_that_beats_every_exact_plan():
    """On a V100's profile the codec streams at device-memory speed while the host link is 75x slower, so under a
    budget that compression alone misses, offloading the compressed streams (half the bytes of the tensors) beats
    every exact plan, which must move the tensors themselves (the batch kept whole: cut into micro-batches, it
    needs no copy at all). The plan runs on the CPU: its pool peaks exactly where the plan says, and two runs give
    the same bits."""
    from minidl.core.tensors import compressed_source
    from minidl.memory.decisions.weights import moved_by_role
    from minidl.memory.plan import EventKind
    from minidl.memory.schedulers.auto import auto_search
    from minidl.memory.schedulers.lossy import compress_trials

    opt = SGD(lr=0.05, momentum=0.9)
    budget = int(planned(chain_net(), opt, "liveness").min_budget_bytes * 0.45)
    route = chain_net().route(optimizer_slots=tuple(opt.slots), fused_update=True)
    exact = auto_search(route, budget, "v100", frugal=False).chosen
    lossy = {t.name: t for t in compress_trials(route, budget, "v100")}
    assert not lossy["liveness + compress"].fits      # compression alone does not fit ...
    both = lossy["liveness + compress + offload"]     # ... compressed and offloaded does, faster than exact
    assert both.fits and both.est_step_time_s < exact.est_step_time_s

    net = chain_net()
    plan = planned(net, opt, "auto-lossy", budget, device="v100", max_micro_batches=1)
    assert plan.min_budget_bytes <= budget and "compress + offload" in plan.decision
    streams = {ev.tensor for sp in plan.steps for ev in sp.after + sp.before
               if ev.kind is EventKind.OFFLOAD and compressed_source(ev.tensor) is not None}
    moved = moved_by_role(plan)
    assert streams and moved["compressed_activations"] > 0
    assert moved["compressed_activations"] < sum(2 * plan.sizes[compressed_source(z)] for z in streams)
    runs = [_train(net, plan, steps=3) for _ in range(2)]
    for ex, _ in runs:
        assert ex.pool.peak == plan.peak_bytes and ex.compressed.spill_count == 0
    assert runs[0][1] == runs[1][1]
    for k, v in runs[0][0].state_dict().items():
        assert np.array_equal(v, runs[1][0].state_dict()[k]), k
