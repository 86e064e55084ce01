"""Every layer in bf16 and fp16 on the CPU backend: half storage, float32 compute, rounding on store.

Three checks per layer (`minidl.testing.run_layer(..., math=mode)`, which stores every array as
`minidl.backend.precision` says):
* against PyTorch's CPU autocast in the same dtype (the half inputs as half tensors, the float32 masters as
  leaves), within `ULPS` units in the last place of the half dtype at the reference's scale: both compute from
  the same stored values, and differ by their summation orders, by where PyTorch rounds intermediates to half
  and by the weight gradients PyTorch rounds to half (its autocast casts them back), never by more;
* bit for bit against the float32 kernels run on the same stored values (a backward reads its layer's output as
  stored), their outputs rounded once (the contract: one conversion point per kernel), so the CPU stores what a
  float32-compute GPU kernel stores up to the order of its sums;
* the staging the run takes (`Staging.high_water`) is the figure a plan gets from a dry run of the same calls
  (`layers.staging.step_staging`), and for a few layers the figure worked out by hand.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import ml_dtypes
import numpy as np
import pytest
import torch

from minidl import layers as L
from minidl.backend.cpu import norm as cpu_norm
from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.precision import HALF_DTYPES, check_half_kernels, precision
from minidl.core.errors import OptionError
from minidl.layers.base import LayerContext
from minidl.layers.staging import step_staging
from minidl.testing import run_layer
from minidl.testing.torch_twin import _node_fn

MODES = ("bf16", "fp16")
TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16}
EPS = {m: float(ml_dtypes.finfo(HALF_DTYPES[m]).eps) for m in MODES}  # the spacing of the half dtype at 1
ULPS = 2  # the default tolerance, in units of EPS at the reference's scale


@dataclass
class Case:
    """One layer configuration: a fresh layer each call, float32 inputs (integers: labels, indices) and masters."""

    id: str
    make: Callable
    inputs: Callable            # rng -> list of arrays
    params: Callable = lambda rng: {}
    training: bool = True
    ulps: float = ULPS          # where PyTorch rounds more than we do (see the case)
    kw: dict = field(default_factory=dict)
    torch_ok: bool = True       # False: no PyTorch twin of the same values (dropout's mask)


def _n(rng, *shape, scale=1.0, shift=0.0):
    return (rng.standard_normal(shape) * scale + shift).astype(np.float32)


def _conv_params(cout, cin, k, bias=True):
    def make(rng):
        p = {"weight": _n(rng, cout, cin, k, k, scale=0.3)}
        if bias:
            p["bias"] = _n(rng, cout)
        return p
    return make


def _bn_params(c, affine=True):
    def make(rng):
        p = {"running_mean": _n(rng, c), "running_var": rng.uniform(0.5, 2, c).astype(np.float32)}
        if affine:
            p |= {"weight": rng.uniform(0.5, 1.5, c).astype(np.float32), "bias": _n(rng, c)}
        return p
    return make


def _conv_cases():
    out = []
    for algo in L.Conv2d(5, 3, padding=1).algorithms((2, 4, 8, 8)):
        out.append(Case(f"conv3x3-{algo}", lambda: L.Conv2d(5, 3, padding=1), lambda rng: [_n(rng, 2, 4, 8, 8)],
                        _conv_params(5, 4, 3), kw=dict(algo_fwd=algo, algo_bwd=algo)))
    out.append(Case("conv1x1-s2-nobias", lambda: L.Conv2d(6, 1, stride=2, bias=False),
                    lambda rng: [_n(rng, 3, 5, 6, 6)], _conv_params(6, 5, 1, bias=False)))
    out.append(Case("conv-grouped", lambda: L.Conv2d(6, 3, padding=1, groups=2), lambda rng: [_n(rng, 2, 4, 7, 7)],
                    _conv_params(6, 2, 3)))
    return out


CASES = [
    *_conv_cases(),
    Case("batchnorm-train", lambda: L.BatchNorm2d(), lambda rng: [_n(rng, 4, 3, 5, 5, scale=2, shift=0.5)],
         _bn_params(3)),
    Case("batchnorm-eval", lambda: L.BatchNorm2d(), lambda rng: [_n(rng, 4, 3, 5, 5, scale=2, shift=0.5)],
         _bn_params(3), training=False),
    Case("batchnorm-noaffine", lambda: L.BatchNorm2d(affine=False), lambda rng: [_n(rng, 2, 16, 7, 9)],
         _bn_params(16, affine=False)),
    Case("relu", lambda: L.ReLU(), lambda rng: [_n(rng, 2, 3, 5, 7)]),
    Case("relu-large", lambda: L.ReLU(), lambda rng: [_n(rng, 3, 8, 80, 80)]),   # several elementwise chunks
    Case("gelu-tanh", lambda: L.GELU("tanh"), lambda rng: [_n(rng, 4, 33)]),
    Case("gelu-exact", lambda: L.GELU(), lambda rng: [_n(rng, 4, 33)]),
    Case("softmax", lambda: L.Softmax(), lambda rng: [_n(rng, 3, 5, 17, scale=2)]),
    Case("dropout", lambda: L.Dropout(0.3), lambda rng: [_n(rng, 3, 70000)], torch_ok=False),
    Case("maxpool", lambda: L.MaxPool2d(3, 2, 1), lambda rng: [_n(rng, 2, 3, 9, 9)]),
    Case("avgpool", lambda: L.AvgPool2d(3, 2, 1), lambda rng: [_n(rng, 2, 3, 9, 9)]),
    Case("gap", lambda: L.GlobalAvgPool(), lambda rng: [_n(rng, 2, 5, 6, 6)]),
    Case("lrn", lambda: L.LRN(5, 1e-2, 0.75, 2.0), lambda rng: [_n(rng, 2, 7, 5, 5)]),
    Case("linear", lambda: L.Linear(9), lambda rng: [_n(rng, 4, 3, 2, 2)],
         lambda rng: {"weight": _n(rng, 9, 12, scale=0.3), "bias": _n(rng, 9)}),
    Case("linear-tokens", lambda: L.Linear(10, flatten=False), lambda rng: [_n(rng, 2, 5, 8)],
         lambda rng: {"weight": _n(rng, 10, 8, scale=0.3), "bias": _n(rng, 10)}),
    Case("matmul-bt", lambda: L.MatMul(transpose_b=True), lambda rng: [_n(rng, 2, 3, 5, 4), _n(rng, 2, 3, 6, 4)]),
    Case("flatten", lambda: L.Flatten(), lambda rng: [_n(rng, 2, 3, 4, 4)]),
    Case("add", lambda: L.Add(), lambda rng: [_n(rng, 2, 3, 4, 4), _n(rng, 2, 3, 4, 4), _n(rng, 2, 3, 4, 4)]),
    Case("concat", lambda: L.Concat(), lambda rng: [_n(rng, 2, 3, 4, 4), _n(rng, 2, 5, 4, 4)]),
    Case("layernorm", lambda: L.LayerNorm(16), lambda rng: [_n(rng, 3, 7, 16, scale=2, shift=1)],
         lambda rng: {"weight": rng.uniform(0.5, 1.5, 16).astype(np.float32), "bias": _n(rng, 16)}),
    Case("attention-causal", lambda: L.CausalSelfAttention(2), lambda rng: [_n(rng, 2, 6, 24)]),
    Case("attention-causal-rebuilt", lambda: L.CausalSelfAttention(2, keep_scores=False),
         lambda rng: [_n(rng, 2, 6, 24)]),
    Case("attention-bidirectional", lambda: L.SelfAttention(3), lambda rng: [_n(rng, 2, 5, 18)]),
    Case("embedding", lambda: L.Embedding(11, 6), lambda rng: [rng.integers(0, 11, (3, 5))],
         lambda rng: {"weight": _n(rng, 11, 6)}),
    Case("pos-embedding", lambda: L.PositionEmbedding(9), lambda rng: [_n(rng, 2, 7, 6)],
         lambda rng: {"weight": _n(rng, 9, 6)}),
    Case("xent", lambda: L.SoftmaxCrossEntropy(), lambda rng: [_n(rng, 6, 10, scale=2), rng.integers(0, 10, 6)]),
    Case("xent-ignore", lambda: L.SoftmaxCrossEntropy(ignore_index=-100),
         lambda rng: [_n(rng, 2, 4, 10, scale=2), np.array([[1, -100, 3, 4], [-100, 9, 0, 2]])]),
]
IDS = [c.id for c in CASES]


def _setup(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    inputs = case.inputs(rng)
    params = case.params(rng)
    probe = run_layer(case.make(), inputs, copy.deepcopy(params), training=case.training, **case.kw)
    dout = np.float32(1.0) if case.make().is_loss else _n(rng, *probe.out.shape)
    return inputs, params, dout


def _half(a, mode):
    """a rounded to the half dtype by numpy's / ml_dtypes' own casts (not minidl's)."""
    return np.asarray(a, np.float32).astype(HALF_DTYPES[mode])


def _wide(a):
    return None if a is None else np.asarray(a).astype(np.float32)


def _close(got, ref, mode, ulps):
    ref = ref.detach().float().numpy() if torch.is_tensor(ref) else np.asarray(ref, np.float32)
    tol = ulps * EPS[mode]
    np.testing.assert_allclose(_wide(got), ref, rtol=tol, atol=tol * max(1.0, float(np.abs(ref).max())))


def _floating(a):
    return np.issubdtype(a.dtype, np.floating)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [c for c in CASES if c.torch_ok], ids=[c.id for c in CASES if c.torch_ok])
def test_against_torch_autocast(case, mode):
    inputs, params, dout = _setup(case)
    mine = copy.deepcopy(params)
    r = run_layer(case.make(), inputs, mine, dout=dout, training=case.training, math=mode, **case.kw)

    dt = TORCH[mode]
    xs = [torch.tensor(_half(x, mode).astype(np.float32)).to(dt).requires_grad_() if _floating(x)
          else torch.tensor(x) for x in inputs]
    layer = case.make()
    ps = {k: torch.tensor(v).requires_grad_(k not in ("running_mean", "running_var")) for k, v in params.items()}
    fn = _node_fn(SimpleNamespace(layer=layer))
    with torch.autocast("cpu", dtype=dt):
        y = fn(xs, ps, case.training) if layer.type_name == "batchnorm" else fn(xs, ps)
    y.backward(torch.tensor(_half(dout, mode).astype(np.float32)).to(y.dtype))

    _close(r.out, y, mode, case.ulps)
    for got, x in zip(r.dinputs, xs):
        if got is not None:
            _close(got, x.grad, mode, case.ulps)
    for name, g in r.grads.items():
        _close(g, ps[name].grad, mode, case.ulps)
    if "running_mean" in params and case.training:
        _close(mine["running_mean"], ps["running_mean"], mode, case.ulps)
        _close(mine["running_var"], ps["running_var"], mode, case.ulps)


@pytest.mark.bits
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float32_kernel_rounded_once(case, mode):
    """The half run stores exactly what the float32 kernels compute from the stored (half) values, rounded to
    nearest even; float32 roles (gradients, statistics, the loss) equal the float32 run's bit for bit."""
    inputs, params, dout = _setup(case)
    layer = case.make()
    half = run_layer(case.make(), inputs, copy.deepcopy(params), dout=dout, training=case.training, math=mode,
                     **case.kw)
    stored = [_wide(_half(x, mode)) if _floating(x) else x for x in inputs]
    wide_params = {k: _wide(_half(v, mode)) if k in layer.half_params else v.copy() for k, v in params.items()}
    ref = run_layer(case.make(), stored, wide_params, dout=_wide(_half(dout, mode)) if not layer.is_loss else dout,
                    training=case.training, **case.kw)
    if layer.type_name == "attention":  # its probabilities are rounded to half before use: its own test below
        return
    if layer.needs_output:  # backward reads the output as stored (rounded), not the float32 run's
        ref.dinputs[0] = np.empty_like(stored[0])
        layer.backward(CPUBackend(), stored, _wide(half.out), _wide(_half(dout, mode)), ref.dinputs, {}, {},
                       LayerContext())

    def same(got, want):
        want = want if got.dtype == np.float32 else _half(want, mode)
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8))

    same(half.out, ref.out)
    for got, want in zip(half.dinputs, ref.dinputs):
        if got is not None:
            same(got, want)
    for name in ref.grads:
        same(half.grads[name], ref.grads[name])
    for name in ref.aux:
        same(half.aux[name], ref.aux[name])


CONV_CASES = [c for c in CASES if c.id.startswith("conv")]


@pytest.mark.bits
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CONV_CASES, ids=[c.id for c in CONV_CASES])
def test_accumulating_backward_rounds_once(case, mode):
    """A fork's later convolution adds its input delta into the delta it is given: the stored delta read exactly,
    the float32 accumulating kernel's delta + dx, rounded once; the staging is the plain backward's."""
    inputs, params, dout = _setup(case)
    held = _n(np.random.default_rng(1), *inputs[0].shape)
    be = CPUBackend()
    half = run_layer(case.make(), inputs, copy.deepcopy(params), dout=dout, math=mode, accumulate={0: held},
                     backend=be, **case.kw)
    layer = case.make()
    stored = [_wide(_half(x, mode)) for x in inputs]
    wide_params = {k: _wide(_half(v, mode)) if k in layer.half_params else v.copy() for k, v in params.items()}
    ref = run_layer(case.make(), stored, wide_params, dout=_wide(_half(dout, mode)),
                    accumulate={0: _wide(_half(held, mode))}, **case.kw)
    np.testing.assert_array_equal(half.dinputs[0].view(np.uint16), _half(ref.dinputs[0], mode).view(np.uint16))
    for name in ref.grads:
        np.testing.assert_array_equal(half.grads[name], ref.grads[name])
    assert be.staging.high_water == max(step_staging(layer, CPUBackend(), precision(mode), phase,
                                                     [inputs[0].shape], [HALF_DTYPES[mode]], half.out.shape)
                                        for phase in ("fwd", "bwd"))


def test_only_a_layer_that_adds_into_a_delta_is_run_accumulating():
    with pytest.raises(OptionError, match=r"layer 'r' \(relu\): its backward does not add into a delta it is "
                                          r"given \(accumulate=\[0\]\)"):
        run_layer(L.ReLU(name="r"), [np.ones((2, 3), np.float32)], dout=np.ones((2, 3), np.float32),
                  accumulate={0: np.zeros((2, 3), np.float32)})


@pytest.mark.bits
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [True, False])
def test_attention_kept_or_rebuilt_same_bits(mode, causal):
    """Attention's probabilities are rounded to half before the product with v, so a plan that keeps them (stored
    in half) and one that rebuilds them in backward give the same bits."""
    rng = np.random.default_rng(3)
    x = _n(rng, 3, 7, 24)
    dout = _n(rng, 3, 7, 8)
    runs = [run_layer(L.SelfAttention(2, keep_scores=keep, causal=causal), [x], dout=dout, math=mode)
            for keep in (True, False)]
    for a, b in [(runs[0].out, runs[1].out), (runs[0].dinputs[0], runs[1].dinputs[0])]:
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    assert runs[0].aux["probs"].dtype == HALF_DTYPES[mode]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_traced_staging_is_what_the_run_takes(case, mode):
    """`layers.staging.step_staging` (a dry run of the step's calls, what a plan counts) gives the staging the
    run takes: `Staging.high_water` after forward and backward."""
    inputs, params, dout = _setup(case)
    be = CPUBackend()
    layer = case.make()
    r = run_layer(layer, inputs, copy.deepcopy(params), dout=dout, training=case.training, math=mode, backend=be,
                  **case.kw)
    stored = [_half(x, mode) if _floating(x) else x for x in inputs]
    traced = [step_staging(layer, CPUBackend(), precision(mode), phase, [x.shape for x in stored],
                           [x.dtype for x in stored], r.out.shape, training=case.training) for phase in ("fwd", "bwd")]
    assert be.staging.high_water == max(traced)


def test_staging_figures(monkeypatch):
    """The bytes a staged call takes, worked out by hand: 4 a value of each distinct half array, 64-byte aligned;
    elementwise kernels none (they convert CHUNK values at a time, outside the plan), nor batch norm's compiled
    kernels (they read and write half bits), which stage without numba."""
    prec, be = precision("bf16"), CPUBackend()
    conv = lambda: L.Conv2d(16, 3, padding=1)
    x, w, b, y = (8, 4, 10, 10), (16, 4, 3, 3), (16,), (8, 16, 10, 10)
    nbytes = lambda *shapes: sum(-(-4 * int(np.prod(s)) // 64) * 64 for s in shapes)
    bf16 = HALF_DTYPES["bf16"]
    assert step_staging(conv(), be, prec, "fwd", [x], [bf16], y) == nbytes(x, w, b, y) == 12800 + 2304 + 64 + 51200
    assert step_staging(conv(), be, prec, "bwd", [x], [bf16], y) == nbytes(x, w, y, x)   # x, w, dy, dx
    assert step_staging(L.ReLU(), be, prec, "fwd", [y], [bf16], y) == 0
    assert step_staging(L.BatchNorm2d(), be, prec, "bwd", [y], [bf16], y) == 0
    assert step_staging(L.BatchNorm2d(), be, prec, "fwd", [y], [bf16], y, fold_relu=True) == 0
    assert step_staging(L.Linear(10), be, prec, "fwd", [x], [bf16], (8, 10)) == nbytes(x, (10, 400), (10,), (8, 10))
    assert step_staging(conv(), be, precision("fp32"), "fwd", [x], [np.float32], y) == 0
    monkeypatch.setattr(cpu_norm, "jit_kernels", lambda: None)
    assert step_staging(L.BatchNorm2d(), be, prec, "bwd", [y], [bf16], y) == nbytes(y, y, y)  # x, dy, dx
    assert step_staging(L.BatchNorm2d(), be, prec, "fwd", [y], [bf16], y, fold_relu=True) == nbytes(y, y, y)  # x, y, r


def test_staging_bound_too_small_is_refused():
    be = CPUBackend()
    be.staging.bind(np.empty(1024, np.uint8))
    x = _half(np.ones((4, 64)), "bf16")
    with pytest.raises(ValueError, match=r"softmax_forward: its half operands need 2048 bytes .* has 1024"):
        be.softmax_forward(x, np.empty_like(x))


def test_float32_only_kernels_refuse_half():
    be = CPUBackend()
    p = _half(np.ones(8), "bf16")
    with pytest.raises(OptionError, match=r"sgd_update computes on float32 only \(its 'p' is bfloat16\)"):
        be.sgd_update(p, np.zeros(8, np.float32), None, 0.1, 0.0, 0.0, 0.0, False, True)


def test_a_layer_without_half_kernels_is_named():
    """A backend whose record lacks a layer's kernel in half: the check names the layer, the mode and the kernel."""
    class NoGelu:
        capabilities = dataclasses.replace(CPUBackend.capabilities, name="fake",
                                           half_kernels=CPUBackend.capabilities.half_kernels - {"gelu_backward"})

    check_half_kernels([L.ReLU(name="r"), L.GELU(name="act")], NoGelu(), "fp32")   # float32: nothing to check
    with pytest.raises(OptionError, match=r"--math bf16: layer 'act' \(gelu\) has no bf16 kernel on backend "
                                          r"'fake' \(gelu_backward\)"):
        check_half_kernels([L.ReLU(name="r"), L.GELU(name="act")], NoGelu(), "bf16")


class _Recorder:
    """The CPU backend, recording the names of the kernels a layer calls."""

    def __init__(self):
        self.be, self.called = CPUBackend(), set()

    def __getattr__(self, name):
        attr = getattr(self.be, name)
        if callable(attr):
            self.called.add(name)
        return attr


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_declared_kernels_are_those_called(case):
    """`Layer.kernels` (what the half check reads) lists every kernel the layer's forward and backward call."""
    inputs, params, dout = _setup(case)
    rec = _Recorder()
    run_layer(case.make(), inputs, copy.deepcopy(params), dout=dout, training=case.training, backend=rec,
              math="bf16", **case.kw)
    rec.called -= {"copy", "staging", "conv_workspace_options"}   # run_layer's own calls
    layer = case.make()
    assert rec.called <= set(layer.kernels()), rec.called - set(layer.kernels())
    assert set(layer.kernels()) <= CPUBackend.capabilities.half_kernels
