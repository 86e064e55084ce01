"""The half forms of minidl's own CUDA kernels (kernels/*.cu `<name>_bf16`, `<name>_f16`) and the ops that launch them.

Host tests (no GPU): every half form's launch packing and grid, as tests/backend/test_cuda_host.py checks the float32
ones, derived from its cases; the launchers' refusals; which entry point each backend op launches for float32,
bf16 and fp16 arrays; `launches.HALF_KERNELS` holds exactly the layer kernels whose ops launch only half forms on
half storage; batch norm's fallback kernels (emulated) against the CPU's half. gpu-marked: each op on the device in
bf16 and fp16 against the CPU backend's half kernels, bits equal where both compute the same float32 elementwise,
within two units of the half's last place elsewhere, and batch norm's fallback (benchmarks/gpu_check.py's
correctness part runs them).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.cuda import cudnn_specs, halves, launches, norm
from minidl.backend.cuda import kernel_specs as ks
from minidl.backend.cuda.backend import CUDABackend, CudnnGraphs
from tests.backend.test_cuda_half_host import FakeCublasLib, _PtrStream, _refuses_bn
from tests.backend.test_cuda_host import (
    LAUNCH_CASES,
    LIMITS,
    EmulatedNormKernels,
    FakeCudnn,
    HostEmulatedCUDA,
    _HostSide,
    _NullStream,
    refuses_sdpa,
)

HALVES = ("bf16", "fp16")
#: The device storage of each half (bf16 as its bits).
STORAGE = {None: np.dtype(np.float32), "bf16": halves.BF16_BITS, "fp16": halves.F16}
HOST = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16)}
F32 = np.dtype(np.float32)


# ---------------------------------------------------------------------------------------------------------
# Launch packing of every half form
# ---------------------------------------------------------------------------------------------------------

def _half_case(name: str, half: str):
    """`LAUNCH_CASES[name]` with the arrays that the half form stores in half given in that storage: (launcher
    arguments, keywords, expected kernel arguments, work)."""
    args, expected, work = LAUNCH_CASES[name]
    spec = ks.KERNELS[halves.variant(name, half)]
    want = expected(args)
    stored = {id(v) for a, v in zip(spec.args, want) if a.is_pointer and a.ctype.endswith(("bf16*", "f16*"))}
    swap = {id(a): np.zeros(a.shape, STORAGE[half]) for a in args if isinstance(a, np.ndarray) and id(a) in stored}
    hargs = tuple(swap.get(id(a), a) if isinstance(a, np.ndarray) else a for a in args)
    kw, extra = {}, ()
    if name == "softmax_xent_backward":
        kw = {"dloss": np.ones(1, np.float32)}
        extra = (kw["dloss"],)
    hwork = np.prod(args[0].shape) if spec.work != ks.KERNELS[name].work else work  # max-pool's gather
    return hargs, kw, (*expected(hargs), *extra), hwork


HALF_FORMS = sorted(n for n, s in ks.KERNELS.items() if s.half and s.base not in ("round_copy", "widen_copy"))


@pytest.mark.parametrize("name", HALF_FORMS)
def test_half_launch_packing(name):
    spec = ks.KERNELS[name]
    args, kw, expected, work = _half_case(spec.base, spec.half)
    launch = launches.LAUNCHERS[spec.base](*args, limits=LIMITS, **kw)
    assert launch.name == name and len(launch.args) == spec.nargs
    assert (launch.grid, launch.block) == ks.launch_config(name, work, LIMITS.max_threads_per_block,
                                                           LIMITS.sm_count)
    for a, got, want in zip(spec.args, launch.args, expected):
        if a.is_pointer:
            assert got is want, f"{name}: pointer {a.name} is not the array passed"
            assert got is None or got.dtype == launches.pointer_dtype(a.ctype), (name, a.name)
        else:
            assert type(got) is ks.scalar_type(a.ctype) and got == type(got)(want), (name, a.name)


def test_every_half_form_has_a_case_and_the_conversions_go_either_way():
    assert {ks.KERNELS[n].base for n in HALF_FORMS} <= set(LAUNCH_CASES)
    for half in HALVES:
        h, f = np.zeros((3, 4), STORAGE[half]), np.zeros((3, 4), np.float32)
        for launch, args in ((launches.round_copy(h, f, limits=LIMITS), (h, f)),
                             (launches.widen_copy(f, h, limits=LIMITS), (f, h))):
            assert launch.name.endswith(ks.HALF_SUFFIX[half]) and launch.args[:2] == args
            assert launch.args[2] == 12 and (launch.grid, launch.block) == ((1, 1, 1), (256, 1, 1))
    with pytest.raises(TypeError, match="no kernel round_copy"):
        launches.round_copy(np.zeros(4, np.float32), np.zeros(4, np.float32))


def test_launchers_refuse_mixed_or_wrong_storage():
    bf, f16, f32 = np.zeros(4, np.uint16), np.zeros(4, np.float16), np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="mix storages"):
        launches.relu_forward(bf, f32)
    with pytest.raises(TypeError, match="mix storages"):
        launches.add_forward(bf, bf, f16)
    with pytest.raises(TypeError, match="'w' .* must be a float32 array, got uint16"):
        launches.embedding_forward(np.zeros((2, 4), np.uint16), np.zeros((5, 4), np.uint16), np.zeros(2, np.int64))
    with pytest.raises(TypeError, match="'param' .* must be a float32 array, got float16"):
        launches.sgd_update(f16, f16, None, 0.1, 0.0, 0.0, 0.0, False, True)
    with pytest.raises(TypeError, match="SZ codec encodes float32"):
        launches.sz_quantize(np.zeros(4, np.int64), np.zeros(4, np.uint8), bf, 1e-3)
    logits, lab = np.zeros((2, 3), np.uint16), np.zeros(2, np.int64)
    with pytest.raises(ValueError, match="half forms take dloss"):
        launches.softmax_xent_backward(logits, logits, lab, 0.5)
    with pytest.raises(ValueError, match="half forms take dloss"):
        launches.softmax_xent_backward(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32), lab, 0.5,
                                       dloss=np.ones(1, np.float32))
    with pytest.raises(TypeError, match="'loss' .* must be a float32 array"):
        launches.softmax_xent_forward(np.zeros(2, np.uint16), logits, lab)


def test_launcher_forms_match_halves_variant():
    for s in ks.KERNELS.values():
        if s.half:
            assert s.name == halves.variant(s.base, s.half)


# ---------------------------------------------------------------------------------------------------------
# Dispatch: the entry points each op launches in float32, bf16 and fp16
# ---------------------------------------------------------------------------------------------------------

class _StrictCupy:
    """The slice of cupy the ops use on the host, refusing cupy arithmetic on half storage (cupy has no bfloat16:
    it would add bf16 bits as integers) and copies between dtypes."""

    ndarray = np.ndarray

    @staticmethod
    def _refuse_halves(*arrays):
        for a in arrays:
            if isinstance(a, np.ndarray) and halves.half_of(a) is not None:
                raise AssertionError(f"cupy arithmetic on half storage ({a.dtype})")

    def add(self, a, b, out=None):
        self._refuse_halves(a, b, out)
        return np.add(a, b, out=out)

    def multiply(self, a, b, out=None):
        self._refuse_halves(a, b, out)
        return np.multiply(a, b, out=out)

    def matmul(self, a, b, out=None):
        self._refuse_halves(a, b, out)
        return np.matmul(a, b, out=out)

    @staticmethod
    def copyto(dst, src):
        assert dst.dtype == src.dtype, f"copyto from {src.dtype} into {dst.dtype}"
        np.copyto(dst, src)

    broadcast_to = staticmethod(np.broadcast_to)     # a view: no arithmetic
    lib = np.lib                                     # as_strided: a view


def _backend(half: str | None) -> HostEmulatedCUDA:
    """Half attention with unkept scores runs these kernels where cuDNN refuses SDPA, as this fake does."""
    fake = FakeCudnn(unsupported=refuses_sdpa)
    be = HostEmulatedCUDA.from_parts(cupy=_StrictCupy(), cupyx=None, cudnn=fake, cublas=None, compute=_NullStream(),
                                     transfer=_NullStream(), graphs=CudnnGraphs(fake, handle=5), side=_HostSide(),
                                     limits=LIMITS, filters=cudnn_specs.EngineFilters())
    be.set_math(half or "fp32")
    be.launches = []
    be.compute, be._cublas_ex = _PtrStream(), (FakeCublasLib(), 77)
    return be


def _f(*shape):
    return np.zeros(shape, np.float32)


def _lab(n, k=5):
    return np.arange(n, dtype=np.int64) % k


#: layer kernel -> a call of its CUDA op on arrays made by `a(*shape)` (activations and deltas, in the storage
#: under test) and float32 ones (weights, statistics, gradients, the loss).
OPS = {
    "relu_forward": lambda be, a: be.relu_forward(a(2, 3), a(2, 3)),
    "relu_backward": lambda be, a: be.relu_backward(a(6), a(6), a(6)),
    "gelu_forward": lambda be, a: be.gelu_forward(a(6), a(6), "tanh"),
    "gelu_backward": lambda be, a: be.gelu_backward(a(6), a(6), a(6), "none"),
    "softmax_forward": lambda be, a: be.softmax_forward(a(3, 4), a(3, 4)),
    "softmax_backward": lambda be, a: be.softmax_backward(a(3, 4), a(3, 4), a(3, 4)),
    "dropout_forward": lambda be, a: be.dropout_forward(a(8), a(8), 0.5, 3),
    "dropout_backward": lambda be, a: be.dropout_backward(a(8), a(8), 0.5, 3),
    "add_forward": lambda be, a: be.add_forward([a(4), a(4)], a(4)),
    "accumulate": lambda be, a: be.accumulate(a(4), a(4)),
    "copy": lambda be, a: (be.copy(a(4), a(4)), be.copy(a(4), _f(4))),   # a copy; a weight copy's refresh
    "concat_forward": lambda be, a: be.concat_forward([a(2, 1, 3), a(2, 2, 3)], a(2, 3, 3)),
    "concat_backward": lambda be, a: be.concat_backward(a(2, 3, 3), [a(2, 1, 3), None, a(2, 2, 3)], [1, 0, 2]),
    "lrn_forward": lambda be, a: be.lrn_forward(a(2, 6, 3, 1), a(2, 6, 3, 1), 5, 1e-4, 0.75, 2.0),
    "lrn_backward": lambda be, a: be.lrn_backward(a(2, 6, 3), a(2, 6, 3), a(2, 6, 3), a(2, 6, 3), 3, 1e-3, 0.5, 1.0),
    "maxpool2d_forward": lambda be, a: be.maxpool2d_forward(a(2, 3, 8, 8), a(2, 3, 4, 4), (3, 3), (2, 2), (1, 1),
                                                            (1, 1)),
    "maxpool2d_backward": lambda be, a: be.maxpool2d_backward(a(2, 3, 8, 8), a(2, 3, 4, 4), a(2, 3, 8, 8), (3, 3),
                                                              (2, 2), (1, 1), (1, 1)),
    "avgpool2d_forward": lambda be, a: be.avgpool2d_forward(a(2, 3, 8, 8), a(2, 3, 4, 4), (2, 2), (2, 2), (0, 0),
                                                            False),
    "avgpool2d_backward": lambda be, a: be.avgpool2d_backward(a(2, 3, 4, 4), a(2, 3, 8, 8), (2, 2), (2, 2), (0, 0),
                                                              False),
    "global_avgpool_forward": lambda be, a: be.global_avgpool_forward(a(2, 3, 4, 4), a(2, 3)),
    "global_avgpool_backward": lambda be, a: be.global_avgpool_backward(a(2, 3), a(2, 3, 4, 4)),
    "layernorm_forward": lambda be, a: be.layernorm_forward(a(4, 8), _f(8), _f(8), a(4, 8), _f(4), _f(4), 1e-5),
    "layernorm_forward_apply": lambda be, a: be.layernorm_forward_apply(a(4, 8), _f(8), None, _f(4), _f(4), a(4, 8)),
    "layernorm_backward": lambda be, a: be.layernorm_backward(a(4, 8), _f(8), a(4, 8), _f(4), _f(4), a(4, 8), _f(8),
                                                              _f(8)),
    "embedding_forward": lambda be, a: be.embedding_forward(_lab(6, 10), _f(10, 4), a(6, 4)),
    "embedding_backward": lambda be, a: be.embedding_backward(_lab(6, 10), a(6, 4), _f(10, 4)),
    "position_embedding_forward": lambda be, a: be.position_embedding_forward(a(2, 3, 4), _f(5, 4), a(2, 3, 4)),
    "position_embedding_backward": lambda be, a: be.position_embedding_backward(a(2, 3, 4), a(2, 3, 4), _f(5, 4)),
    "softmax_xent_forward": lambda be, a: be.softmax_xent_forward(a(6, 5), _lab(6), _f()),
    "softmax_xent_backward": lambda be, a: be.softmax_xent_backward(a(6, 5), _lab(6), _f(), a(6, 5)),
    "softmax_xent_ignore_forward": lambda be, a: be.softmax_xent_ignore_forward(a(6, 5), _lab(6), _f(), 2),
    "softmax_xent_ignore_backward": lambda be, a: be.softmax_xent_ignore_backward(a(6, 5), _lab(6), _f(), a(6, 5), 2),
    "attention_forward": lambda be, a: be.attention_forward(a(2, 2, 3, 4), a(2, 2, 3, 4), a(2, 2, 3, 4),
                                                            a(2, 2, 3, 3), a(2, 2, 3, 4), 0.5, True),
    "attention_backward": lambda be, a: be.attention_backward(*(a(2, 2, 3, 4) for _ in range(3)), None,
                                                              *(a(2, 2, 3, 4) for _ in range(4)), 0.5, False),
}
#: Ops whose half path computes in float32 where the float32 route does (scores and their softmax, dS) and rounds
#: into the half (round_copy), with float32 copies of half tensors (widen_copy) where cuBLAS needs like types.
STAGED = {"attention_forward", "attention_backward"}


def _launches(kernel: str, half: str | None) -> list:
    be = _backend(half)
    OPS[kernel](be, lambda *shape: np.zeros(shape, STORAGE[half]))
    return be.launches


def _launched(kernel: str, half: str | None) -> list[str]:
    return [launch.name for launch in _launches(kernel, half)]


def _half_wired(kernel: str, half: str) -> bool:
    """In `half`, the op launches that half's forms, and exactly the launches that read or write half storage are
    half forms (float32 kernels on float32 arrays, such as the loss's mean or layer norm's weight gradients, fit)."""
    runs = _launches(kernel, half)
    return any(ks.KERNELS[r.name].half for r in runs) and all(
        ks.KERNELS[r.name].half in ("", half)
        and bool(ks.KERNELS[r.name].half) == any(isinstance(a, np.ndarray) and halves.half_of(a) for a in r.args)
        for r in runs)


#: The float32 kernels each op launches (ReLU runs cuDNN's graph in float32; copy and its refresh are cupy's copy
#: in float32 and round_copy's only form is a half's).
FLOAT32_LAUNCHES = {"relu_forward": [], "relu_backward": [], "copy": []}


@pytest.mark.parametrize("kernel", sorted(OPS))
def test_each_op_launches_the_form_of_its_storage(kernel):
    f32 = _launched(kernel, None)
    assert all(not ks.KERNELS[n].half for n in f32), f32
    for half in HALVES:
        names = _launched(kernel, half)
        assert _half_wired(kernel, half), names
        bases = [ks.KERNELS[n].base for n in names]
        if kernel in STAGED:
            assert "round_copy" in bases and set(bases) <= {"widen_copy", "round_copy", *f32}, (f32, bases)
        else:
            assert f32 == FLOAT32_LAUNCHES.get(kernel, bases), (f32, bases)


def test_a_half_add_of_three_sums_in_float32_and_rounds_once():
    """As the CPU: ((x0 + x1) + x2) in float32, rounded once into y (two half adds would round twice): one add_many
    launch up to ADD_ARITY inputs, with no byte outside the arena; past it, a float32 sum in side buffers."""
    for half in HALVES:
        be = _backend(half)
        xs, y = [np.zeros(4, STORAGE[half]) for _ in range(3)], np.zeros(4, STORAGE[half])
        be.add_forward(xs, y)
        (launch,) = be.launches
        assert launch.name == halves.variant("add_many", half) and launch.args[:4] == (y, *xs)
        assert launch.args[-2:] == (3, 4) and not be.side.bufs
        be.launches.clear()
        xs = [np.zeros(4, STORAGE[half]) for _ in range(launches.ADD_ARITY + 1)]
        be.add_forward(xs, y)
        w, a = halves.variant("widen_copy", half), "add_forward"
        assert [r.name for r in be.launches] == [w] + [w, a] * launches.ADD_ARITY + [halves.variant("round_copy",
                                                                                                     half)]
        acc, part = be.side.bufs["add_sum"], be.side.bufs["add_part"]
        assert acc.dtype == part.dtype == np.float32
        assert be.launches[0].args[:2] == (acc, xs[0]) and be.launches[-1].args[:2] == (y, acc)


def test_half_attention_keeps_only_float32_scores_and_the_copies_cublas_needs_outside_the_arena():
    """Its products of half tensors run on the half storage: forward takes one sample's float32 scores beside the
    arena (as the float32 route with unkept probabilities), backward also dS and float32 copies of k and q for dq
    and dk, and dq's float32 product."""
    for half in HALVES:
        be = _backend(half)
        a = lambda *shape, _h=half: np.zeros(shape, STORAGE[_h])   # noqa: E731
        be.attention_forward(a(2, 2, 3, 4), a(2, 2, 3, 4), a(2, 2, 3, 4), a(2, 2, 3, 3), a(2, 2, 3, 4), 0.5, True)
        assert {n: b.shape for n, b in be.side.bufs.items()} == {"attn_probs": (2, 3, 3)}
        be.attention_backward(*(a(2, 2, 3, 4) for _ in range(3)), a(2, 2, 3, 3), *(a(2, 2, 3, 4) for _ in range(4)),
                              0.5, True)
        assert {n: b.shape for n, b in be.side.bufs.items()} == {
            "attn_probs": (2, 3, 3), "attn_dscores": (2, 3, 3), "attn_k": (2, 3, 4), "attn_q": (2, 3, 4),
            "attn_out": (2, 3, 4)}
    be._cublas_ex[0].capturing, be.launches = True, []       # cuBLAS refuses a capture before any launch
    calls = (("attention_forward", (*(a(2, 2, 3, 4) for _ in range(3)), None, a(2, 2, 3, 4), 0.5)),
             ("attention_backward", (*(a(2, 2, 3, 4) for _ in range(3)), a(2, 2, 3, 3),
                                     *(a(2, 2, 3, 4) for _ in range(4)), 0.5, True)),
             ("matmul_forward", (a(2, 3, 4), a(2, 4, 5), a(2, 3, 5))))
    for op, args in calls:
        with pytest.raises(be.CaptureUnsupported):
            getattr(be, op)(*args)
        assert be.launches == [], op


def test_the_loss_multiplies_by_dloss_before_rounding_in_half():
    for half, multiplied in ((None, True), ("bf16", False)):
        be = _backend(half)
        be.cp.multiply = lambda *a, **k: pytest.fail("the half loss's delta is multiplied on the host side")
        if half is None:
            be.cp = _StrictCupy()
        dloss = np.array(2.0, np.float32)
        dlogits = np.ones((6, 5), STORAGE[half])
        be.softmax_xent_backward(np.zeros((6, 5), STORAGE[half]), _lab(6), dloss, dlogits)
        (launch,) = be.launches
        assert (launch.args[-1] is dloss) is not multiplied
        if multiplied:
            np.testing.assert_array_equal(dlogits, 2.0)


def test_half_kernels_are_exactly_the_ops_that_launch_only_half_forms():
    """CUDA lists a layer kernel as half only when its op, run on each half's storage, launches half forms of the
    registry for every launch on half storage (`_half_wired`) and no cupy arithmetic on it (`_StrictCupy`)."""
    listed = CUDABackend.capabilities.half_kernels - cudnn_specs.HALF_KERNELS - norm.HALF_KERNELS
    assert launches.HALF_KERNELS <= set(OPS), sorted(launches.HALF_KERNELS - set(OPS))
    wired = set()
    for kernel in OPS:
        try:
            ok = all(_half_wired(kernel, h) for h in HALVES)
        except (TypeError, AssertionError):
            ok = False
        if ok:
            wired.add(kernel)
    assert listed == launches.HALF_KERNELS == wired


def test_ops_refuse_half_storage_in_float32_and_the_other_half():
    be = _backend(None)
    with pytest.raises(TypeError, match="relu_forward: x must be float32 in --math fp32, got uint16"):
        be.relu_forward(np.zeros(4, np.uint16), np.zeros(4, np.uint16))
    be = _backend("bf16")
    with pytest.raises(TypeError, match="float16"):
        be.gelu_forward(np.zeros(4, np.float16), np.zeros(4, np.float16), "tanh")
    with pytest.raises(TypeError, match="float32"):   # the table is a float32 master
        be.embedding_forward(_lab(2), np.zeros((5, 4), np.uint16), np.zeros((2, 4), np.uint16))
    with pytest.raises(TypeError, match="copy: float16 into uint16"):
        be.copy(np.zeros(4, np.uint16), np.zeros(4, np.float16))


def test_fill_writes_bf16_bits():
    be = _backend("bf16")
    a = np.zeros(3, np.uint16)
    be.fill(a, 1.5)
    assert a.view(ml_dtypes.bfloat16).tolist() == [1.5] * 3
    b = np.zeros(3, np.float32)
    be.fill(b, 1.5)
    assert b.tolist() == [1.5] * 3


# ---------------------------------------------------------------------------------------------------------
# The staged products and attention, emulated (numpy twins of the kernels) against the CPU's half
# ---------------------------------------------------------------------------------------------------------

class _EmulatedHalf(CUDABackend):
    """The CUDA backend on numpy arrays, each launch run by its kernel's numpy twin (tests/backend/
    test_cuda_sequence.py's), the conversions by ml_dtypes' casts (to nearest even), cuBLAS by `FakeCublasLib`."""

    @staticmethod
    def _ptr(a):
        return a.ctypes.data

    def _launch(self, launch):
        from tests.backend.test_cuda_sequence import KERNEL_TWINS, _unpack

        spec = ks.KERNELS[launch.name]
        out, x = launch.args[:2]
        if spec.base == "widen_copy":
            out[...] = x.view(HOST[spec.half]).astype(np.float32)
        elif spec.base == "round_copy":
            out[...] = x.astype(HOST[spec.half]).view(out.dtype)
        else:
            assert not spec.half, launch.name
            KERNEL_TWINS[launch.name](*_unpack(launch))


def _emulated(half, unsupported=refuses_sdpa):
    from types import SimpleNamespace

    fake = FakeCudnn(unsupported=unsupported)   # refuses_sdpa: unkept scores run the kernels, not SDPA
    cp = SimpleNamespace(ndarray=np.ndarray, copyto=np.copyto, matmul=np.matmul, broadcast_to=np.broadcast_to)
    be = _EmulatedHalf.from_parts(cupy=cp, cupyx=None, cudnn=fake, cublas=None, compute=_PtrStream(),
                                  transfer=_NullStream(), graphs=CudnnGraphs(fake, handle=5), side=_HostSide(),
                                  limits=LIMITS, filters=cudnn_specs.EngineFilters())
    be._cublas_ex = (FakeCublasLib(), 77)
    be.set_math(half)
    return be


def _both_halves(half, op, make, outputs):
    """`op` on the CPU backend's half arrays and on the emulated CUDA backend's storage: the outputs close."""
    cpu, dev = make(), make()
    getattr(CPUBackend(), op)(*cpu)
    as_storage = [a.view(STORAGE[half]) if isinstance(a, np.ndarray) and a.dtype == HOST[half] else a for a in dev]
    getattr(_emulated(half), op)(*as_storage)
    for k in outputs:
        _same(dev[k], cpu[k], False, half)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("keep, causal", [(True, True), (False, False)])
def test_staged_attention_matches_the_cpu_half(half, keep, causal):
    def h(*shape, seed=0):
        return _data(half, *shape, seed=seed)

    def fwd():
        return [h(2, 3, 5, 4), h(2, 3, 5, 4, seed=1), h(2, 3, 5, 4, seed=2),
                h(2, 3, 5, 5, seed=3) if keep else None, h(2, 3, 5, 4, seed=4), 0.5, causal]
    _both_halves(half, "attention_forward", fwd, (4, 3) if keep else (4,))

    probs = np.empty((2, 3, 5, 5), HOST[half])
    CPUBackend().attention_forward(*fwd()[:3], probs, h(2, 3, 5, 4), 0.5, causal)

    def bwd():
        return [h(2, 3, 5, 4), h(2, 3, 5, 4, seed=1), h(2, 3, 5, 4, seed=2), probs.copy() if keep else None,
                h(2, 3, 5, 4, seed=5), *(h(2, 3, 5, 4, seed=6 + i) for i in range(3)), 0.5, causal]
    _both_halves(half, "attention_backward", bwd, (5, 6, 7))


@pytest.mark.parametrize("half", HALVES)
def test_matmul_matches_the_cpu_half(half):
    def h(*shape, seed=0):
        return _data(half, *shape, seed=seed)

    _both_halves(half, "matmul_forward", lambda: [h(2, 3, 4), h(2, 5, 4, seed=1).swapaxes(-1, -2),
                                                  h(2, 3, 5, seed=2)], (2,))
    _both_halves(half, "matmul_backward", lambda: [h(2, 3, 4), h(2, 4, 5, seed=1), h(2, 3, 5, seed=2),
                                                   h(2, 3, 4, seed=3), h(2, 5, 4, seed=4).swapaxes(-1, -2)], (3, 4))


def _bn_steps(be, half, store=lambda a: a, affine=True):
    """Batch norm's training forward, recomputed apply, eval forward and backward on `be` with `half` data made
    here (seeded), each half array passed as `store(a)`: the outputs by name, as float32."""
    rng = np.random.default_rng(5)
    shape, c = (8, 3, 7, 5), 3
    x, dy = _data(half, *shape, seed=1, scale=2.0), _data(half, *shape, seed=2)
    w = rng.uniform(0.5, 1.5, c).astype(F32) if affine else None
    b = rng.standard_normal(c).astype(F32) if affine else None
    rm, rv = rng.standard_normal(c).astype(F32), rng.uniform(0.5, 2, c).astype(F32)
    mean, inv, dw, db = (np.zeros(c, F32) for _ in range(4))
    y, y2, y_eval, dx = (np.zeros(shape, HOST[half]) for _ in range(4))
    be.batchnorm_forward_train(store(x), w, b, rm, rv, store(y), mean, inv, 0.1, 1e-5)
    be.batchnorm_forward_apply(store(x), w, b, mean, inv, store(y2))
    be.batchnorm_forward_eval(store(x), w, b, rm, rv, store(y_eval), 1e-5)
    be.batchnorm_backward(store(x), w, store(dy), mean, inv, store(dx), dw, db)
    return {k: np.asarray(v, F32) for k, v in dict(y=y, y2=y2, y_eval=y_eval, dx=dx, mean=mean, invstd=inv,
                                                     running_mean=rm, running_var=rv, dweight=dw, dbias=db).items()}


def _same_bn(got, cpu, half):
    """A half batch norm against the CPU's half: dbias bit-equal (both sum exactly in float64), the float32
    statistics and dweight within a few float32 units (the fallback subtracts the mean in float32, the CPU in
    float64), y and dx within two units of the half's last place (a float32 unit apart before rounding)."""
    np.testing.assert_array_equal(got["dbias"], cpu["dbias"])
    np.testing.assert_array_equal(got["y2"], got["y"])
    for k in ("mean", "invstd", "running_mean", "running_var", "dweight"):
        np.testing.assert_allclose(got[k], cpu[k], rtol=1e-6, err_msg=k)
    for k in ("y", "y_eval", "dx"):
        _same(got[k], cpu[k], False, half)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm_fallback_matches_the_cpu_half(half, affine):
    """cuDNN refuses every BN graph: the emulated cupy kernels' half forms against the CPU backend's half batch
    norm."""
    be = _emulated(half, unsupported=_refuses_bn)
    be._norm_kernels = lambda: EmulatedNormKernels()
    got = _bn_steps(be, half, lambda a: a.view(STORAGE[half]), affine)
    assert {"bn_train", "bn_infer", "bn_backward"} <= set(be.fallbacks)
    _same_bn(got, _bn_steps(CPUBackend(), half, affine=affine), half)


# ---------------------------------------------------------------------------------------------------------
# On a GPU: each half form against the CPU backend's half kernels
# ---------------------------------------------------------------------------------------------------------

#: Two units in the last place of each half (its 8 / 11 significant bits), relative; values near zero also get
#: the absolute slack of a float32 sum of a few dozen terms rounded to the half.
ULPS2 = {"bf16": 2 * 2.0**-8, "fp16": 2 * 2.0**-11}
ATOL = {"bf16": 1e-3, "fp16": 1e-4}


class _OnDevice:
    """A device backend called on host arrays (half ones as ml_dtypes bfloat16 / numpy float16): copied in, called,
    written arrays copied back."""

    def __init__(self, be):
        self.be = be

    def __getattr__(self, name):
        fn = getattr(self.be, name)

        def call(*args, **kwargs):
            pairs = []

            def dev(a):
                if isinstance(a, list):
                    return [dev(v) for v in a]
                if not isinstance(a, np.ndarray):
                    return a
                d = self.be.cp.empty(a.shape, halves.storage_dtype(a.dtype))
                self.be.copy_in(d, a)
                pairs.append((a, d))
                return d
            out = fn(*[dev(a) for a in args], **{k: dev(v) for k, v in kwargs.items()})
            for host, d in pairs:
                host[...] = self.be.to_host(d)
            self.be.synchronize()
            return out
        return call


@pytest.fixture(scope="module", params=HALVES)
def device_half(request):
    from .cuda_device import cuda_backend

    return request.param, _OnDevice(cuda_backend(request.param))


def _data(half, *shape, seed=0, scale=1.0):
    v = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * np.float32(scale)
    return v.astype(HOST[half])


def _same(a, b, exact, half):
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if exact:
        np.testing.assert_array_equal(a32, b32)
    else:
        np.testing.assert_allclose(a32, b32, rtol=ULPS2[half], atol=ATOL[half])


#: layer kernel -> (its CPU/CUDA call on arrays made by `h(*shape, seed)` (half) and `f(*shape, seed)` (float32),
#: the outputs compared by position, whether bits must be equal).
GPU_CASES = {
    "relu_forward": (lambda h, f: ("relu_forward", h(4, 37), h(4, 37, seed=9)), (1,), True),
    "relu_backward": (lambda h, f: ("relu_backward", h(300), h(300, seed=1), h(300, seed=2)), (2,), True),
    "dropout_forward": (lambda h, f: ("dropout_forward", h(1000), h(1000, seed=1), 0.3, 12345), (1,), True),
    "dropout_backward": (lambda h, f: ("dropout_backward", h(1000), h(1000, seed=1), 0.3, 12345), (1,), True),
    "add_forward": (lambda h, f: ("add_forward", [h(257), h(257, seed=1), h(257, seed=2)], h(257, seed=3)), (1,),
                    True),
    "accumulate": (lambda h, f: ("accumulate", h(257), h(257, seed=1)), (0,), True),
    "copy": (lambda h, f: ("copy", h(300), f(300, seed=4)), (0,), True),
    "concat_forward": (lambda h, f: ("concat_forward", [h(2, 3, 5), h(2, 4, 5, seed=1)], h(2, 7, 5, seed=2)), (1,),
                       True),
    "maxpool2d_forward": (lambda h, f: ("maxpool2d_forward", h(2, 3, 9, 9), h(2, 3, 5, 5, seed=1), (3, 3), (2, 2),
                                        (1, 1), (1, 1)), (1,), True),
    "maxpool2d_backward": (lambda h, f: ("maxpool2d_backward", h(2, 3, 8, 8), h(2, 3, 4, 4, seed=1),
                                         h(2, 3, 8, 8, seed=2), (2, 2), (2, 2), (0, 0), (1, 1)), (2,), True),
    "avgpool2d_forward": (lambda h, f: ("avgpool2d_forward", h(2, 3, 8, 8), h(2, 3, 4, 4, seed=1), (2, 2), (2, 2),
                                        (0, 0), False), (1,), False),
    "global_avgpool_forward": (lambda h, f: ("global_avgpool_forward", h(2, 3, 7, 7), h(2, 3, seed=1)), (1,), False),
    "lrn_forward": (lambda h, f: ("lrn_forward", h(2, 6, 3, 3), h(2, 6, 3, 3, seed=1), 5, 1e-4, 0.75, 2.0), (1,),
                    False),
    "gelu_forward": (lambda h, f: ("gelu_forward", h(500), h(500, seed=1), "none"), (1,), False),
    "gelu_backward": (lambda h, f: ("gelu_backward", h(500), h(500, seed=1), h(500, seed=2), "tanh"), (2,), False),
    "softmax_forward": (lambda h, f: ("softmax_forward", h(6, 50), h(6, 50, seed=1)), (1,), False),
    "softmax_backward": (lambda h, f: ("softmax_backward", h(6, 50), h(6, 50, seed=1), h(6, 50, seed=2)), (2,),
                         False),
    "layernorm_forward": (lambda h, f: ("layernorm_forward", h(6, 64), f(64), f(64, seed=1), h(6, 64, seed=2),
                                        f(6, seed=3), f(6, seed=4), 1e-5), (3, 4, 5), False),
    "embedding_forward": (lambda h, f: ("embedding_forward", _lab(9, 7), f(7, 16), h(9, 16, seed=1)), (2,), True),
    "position_embedding_forward": (lambda h, f: ("position_embedding_forward", h(3, 5, 8), f(9, 8, seed=1),
                                                 h(3, 5, 8, seed=2)), (2,), True),
    "softmax_xent_forward": (lambda h, f: ("softmax_xent_forward", h(8, 11), _lab(8, 11), f()), (2,), False),
    "softmax_xent_backward": (lambda h, f: ("softmax_xent_backward", h(8, 11), _lab(8, 11), np.array(1.5, F32),
                                            h(8, 11, seed=1)), (3,), False),
    "matmul_forward": (lambda h, f: ("matmul_forward", h(2, 7, 16), h(2, 16, 9, seed=1), h(2, 7, 9, seed=2)), (2,),
                       False),
    "attention_forward": (lambda h, f: ("attention_forward", h(2, 2, 8, 16), h(2, 2, 8, 16, seed=1),
                                        h(2, 2, 8, 16, seed=2), h(2, 2, 8, 8, seed=3), h(2, 2, 8, 16, seed=4), 0.25,
                                        True), (3, 4), False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", sorted(GPU_CASES))
def test_half_kernel_matches_the_cpu_half_kernel(device_half, kernel):
    half, cuda = device_half
    make, outputs, exact = GPU_CASES[kernel]

    def h(*shape, seed=0):
        return _data(half, *shape, seed=seed)

    def f(*shape, seed=0):
        return _data("bf16", *shape, seed=seed).astype(np.float32) if shape else np.zeros((), np.float32)

    op, *cpu_args = make(h, f)
    op2, *gpu_args = make(h, f)
    getattr(CPUBackend(), op)(*cpu_args)
    getattr(cuda, op)(*gpu_args)
    for k in outputs:
        a, b = cpu_args[k], gpu_args[k]
        for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            assert np.dtype(y.dtype) == np.dtype(x.dtype), (kernel, k)
            _same(y, x, exact, half)


@pytest.mark.gpu
@pytest.mark.parametrize("affine", [True, False])
def test_half_batchnorm_fallback_matches_the_cpu_half(device_half, affine):
    """The cupy kernels' half forms (`use_cudnn_bn` off, as where cuDNN refuses a half BN graph) on the device."""
    half, cuda = device_half
    cuda.be.use_cudnn_bn = False
    try:
        got = _bn_steps(cuda, half, affine=affine)
    finally:
        cuda.be.use_cudnn_bn = True
    _same_bn(got, _bn_steps(CPUBackend(), half, affine=affine), half)
