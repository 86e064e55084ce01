"""The per-policy invariants, once, over every exact policy of the registry (a new policy joins by its row): trained a
few steps, its parameters, optimizer state and losses are `none`'s on the same micro-batches, bit for bit, and the
executor's pool peak is the plan's and the simulator's, byte for byte. Each policy's own behaviour (what it moves,
drops or picks) is tested beside it, in tests/memory/.

The matrix is three slices sharing one check, not a full product (each slice varies one axis against all policies):
- networks: every net (forks, concats, BN with dropout, a chain, LeNet, a transformer block, a tied GPT-2) without a
  budget and at the policy's floor, interpreted in debug mode (freed blocks poisoned, residency checked);
- runners: the ways a plan runs (compiled, captured as CUDA graphs on the host's emulation, micro-batches, a fused
  update, a paged arena, one data-parallel rank, Adam's two slots), each on the nets its mechanism needs, at `mid`
  (the paged arena at its floor);
- math: bf16 and fp16 (half activations and deltas, fp32 master weights), compiled, at `mid`.
Budget levels: `free` (none), `live` (liveness's minimum: a portfolio policy then picks among its rivals), `mid`
(half-way from liveness's minimum down to the policy's lower bound) and `floor` (the smallest budget it accepts)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from minidl.core.errors import BudgetError, DistError, OptionError
from minidl.dist.comm import Communicator
from minidl.memory.decisions.allreduce import DataParallel
from minidl.memory.plan import EventKind
from minidl.memory.policy_table import POLICY_TABLE, exact_policies
from minidl.memory.simulate import simulate
from minidl.optim import Adam
from tests.backend.test_capture import GraphCPU
from tests.memory import nets
from tests.planning import planned
from tests.sessions import opt, same_state, train

NETS = {"resnet20": nets.NETS["resnet20"], "densenet": nets.NETS["densenet_tiny"], "dropnet": nets.dropnet,
        "vgg": nets.vgg11_narrow, "lenet": nets.lenet, "block": nets.block_net, "gpt2": nets.tiny_gpt2,
        "resnet8": nets.resnet8}
CUBLAS = ("linear_forward", "linear_backward")   # the calls cupy cannot capture: run eagerly between graphs
UNBUDGETED = ("none", "liveness")   # they plan the same at any budget they accept: only `free`


@dataclass(frozen=True)
class Runner:
    """One way to run a plan: Session keywords (made fresh per run), the plan options a budget is found with, the
    step runner that must run, and the nets its mechanism is checked on."""

    nets: tuple[str, ...]
    session: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    runs: str = "compiled"
    level: str = "mid"

    def kw(self) -> dict:
        kw = dict(self.session)
        if kw.get("backend") == "graph":
            kw["backend"] = GraphCPU()
        elif kw.get("backend") == "graph-cublas":
            kw["backend"] = GraphCPU(uncapturable=CUBLAS)
        if kw.pop("comm", False):
            kw["comm"] = Communicator()
        if kw.pop("adam", False):
            kw["optimizer"] = Adam(lr=1e-3)
        return kw


RUNNERS = {
    "interpreted": Runner(tuple(k for k in NETS if k != "resnet8"), dict(debug=True), runs="interpreted"),
    "compiled": Runner(("resnet8", "dropnet")),
    "capture": Runner(("resnet8",), dict(backend="graph"), runs="cuda graph"),
    "capture-cublas": Runner(("resnet8",), dict(backend="graph-cublas"), runs="cuda graph"),
    "micro-batches": Runner(("resnet8",), dict(micro_batches=2, debug=True), dict(micro_batches=2),
                            runs="interpreted"),
    "fused": Runner(("resnet8", "densenet", "vgg"), dict(fused_update=True), dict(fused_update=True)),
    "paged": Runner(("resnet8", "dropnet"), dict(paged=4096), dict(paged=4096), level="floor"),
    "dp": Runner(("resnet8",), dict(comm=True, bucket_bytes=4096, reduction="ring"),
                 dict(data_parallel=DataParallel(1, 4096, "ring"))),
    "adam": Runner(("resnet8", "densenet", "dropnet"), dict(adam=True)),
}


def levels(policy: str) -> tuple[str, ...]:
    """The nets slice's levels: `mid` is every other slice's budget."""
    if policy in UNBUDGETED:
        return ("free",)
    return ("free", *(("live",) if POLICY_TABLE[policy].portfolio else ()), "floor")


def acting_level(policy: str, runner: str) -> str:
    return "free" if policy in UNBUDGETED else RUNNERS[runner].level


# Cases known not to run, each with its reason (xfail strict: a case that starts to pass must leave here).
KNOWN = {
    ("dp", "packs"): pytest.mark.xfail(strict=True, raises=DistError, reason="packs choose micro-batches, and a "
                                       "data-parallel rank all-reduces whole-batch gradients once: refused at build"),
}


def case(net, policy, level, runner, math="fp32"):
    marks = KNOWN.get((runner, policy), ())
    if math == "fp16" and POLICY_TABLE[policy].packs_batch:
        marks = pytest.mark.xfail(strict=True, raises=OptionError,
                                  reason="fp16 skips a step whose gradients overflow: it needs every gradient "
                                         "before the first update, which packs' micro-batches update during")
    return pytest.param(net, policy, level, runner, math, marks=marks, id=f"{net}-{policy}-{level}-{runner}-{math}")


CASES = [case(net, p, lv, "interpreted") for net in RUNNERS["interpreted"].nets for p in exact_policies()
         for lv in levels(p)]
CASES += [case(net, p, acting_level(p, r), r) for r, run in RUNNERS.items() if r != "interpreted"
          for net in run.nets for p in exact_policies()]
CASES += [case(net, p, acting_level(p, "compiled"), "compiled", math) for math in ("bf16", "fp16")
          for net in ("resnet8", "dropnet") for p in exact_policies()]


_FLOORS: dict = {}


def floor_of(net: str, policy: str, optimizer, options: dict, verified: bool = True) -> int:
    """The smallest budget `policy` accepts on `net` (its BudgetError's), found once per plan options; unverified, a
    lower bound found without planning at it (exact for most policies, and ten times faster)."""
    key = net, policy, tuple(optimizer.slots), repr(sorted(options.items())), verified
    if key not in _FLOORS:
        with pytest.raises(BudgetError) as e:
            planned(NETS[net](), optimizer, policy, 1, verify_minimum=verified, **options)
        _FLOORS[key] = e.value.min_budget_bytes
    return _FLOORS[key]


def budget_at(net: str, policy: str, level: str, optimizer, options: dict) -> int | None:
    """The budget of `level` for `policy` on `net` under the plan `options`."""
    if level == "free":
        return None
    live = floor_of(net, "liveness", optimizer, options)
    if level == "live":
        return live
    floor = floor_of(net, policy, optimizer, options, verified=level == "floor")
    if floor >= live:
        pytest.skip(f"{policy} plans nothing below liveness's minimum ({live:,} B) on {net}")
    return floor if level == "floor" else (live + floor) // 2


@pytest.fixture(scope="module")
def none_of():
    """The `none` run a case is compared with: same net, optimizer, math and micro-batches, trained once."""
    cache = {}

    def get(net, adam, math, micro_batches):
        key = net, adam, math, micro_batches
        if key not in cache:
            cache[key] = train(NETS[net](), "none", optimizer=Adam(lr=1e-3) if adam else None, math=math,
                               micro_batches=micro_batches if micro_batches > 1 else None)
        return cache[key]
    return get


@pytest.mark.bits
@pytest.mark.parametrize("net, policy, level, runner, math", CASES)
def test_every_exact_policy_trains_the_bits_of_none(net, policy, level, runner, math, none_of):
    run = RUNNERS[runner]
    kw = run.kw()
    optimizer = kw.pop("optimizer", None) or opt()
    budget = budget_at(net, policy, level, optimizer, dict(run.options, math=math))
    sess = train(NETS[net](), policy, budget, optimizer=optimizer, math=math, **kw)
    plan, ex = sess.plan, sess.executor
    ref = none_of(net, "adam" in runner, math, plan.route.micro_batches)
    # a plan a graph cannot replay (host update, chunk mappings) runs compiled, saying why
    assert ex.step_runner == run.runs or (runner.startswith("capture") and ex.step_runner == "compiled"
                                          and ex.graph_fallback), (ex.step_runner, ex.program_fallback,
                                                                   ex.graph_fallback)
    assert sess.last_fit.losses == ref.last_fit.losses
    same_state(sess, ref)
    assert ex.pool.peak == plan.peak_bytes == simulate(plan, "cpu").peak_bytes
    assert ex.pool.in_use <= plan.arena_bytes
    if budget is not None:
        assert plan.min_budget_bytes <= budget
    if policy != "none":
        assert plan.peak_bytes < ref.plan.peak_bytes
    if level == "floor" and runner == "interpreted":   # below liveness's minimum it must act
        moved = {ev.kind for sp in plan.steps for ev in sp.before + sp.after} - {EventKind.ALLOC, EventKind.FREE}
        assert moved or plan.route.fused_update or any(sp.refused for sp in plan.steps), plan.decision
    if runner == "micro-batches":
        assert plan.route.micro_batches == 2
        assert plan.route.packing.schedule == ("packs" if POLICY_TABLE[policy].packs_batch else "accumulate")
    if runner == "fused":
        assert plan.route.fused_update
    if runner == "paged":
        assert plan.paged is not None and plan.paged.chunk_bytes == 4096
    if runner == "dp":
        assert plan.buckets and ex.program.kinds["allreduce"] == ex.program.kinds["reduced"] == len(plan.buckets)
    if runner.startswith("capture") and ex.graph_step is not None:
        assert ex.graph_step.eager_calls == (len(CUBLAS) if runner == "capture-cublas" else 0)


@pytest.mark.parametrize("net", sorted({n for run in RUNNERS.values() for n in run.nets} & {"resnet20", "resnet8"}))
def test_the_resnets_run_winograd(net):
    """Their 3x3 stages run Winograd beside im2col and the row-shift pair: every policy's bits above hold with the
    layer's two variants summed in one order whatever the budget."""
    assert {"winograd", "im2col"} <= {sp.algo for sp in planned(NETS[net](), opt(), "liveness").steps}
