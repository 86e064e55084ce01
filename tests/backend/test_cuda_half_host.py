"""Host tests of the CUDA backend's half modes (`--math bf16|fp16`): storage (bf16 bits in uint16 device arrays),
copies that move the bits unchanged, the I/O check of a kernel's arrays, the mode switch and the capabilities.
No GPU: fakes of cupy stand in (the numerics run in gpu-marked tests)."""
from __future__ import annotations

import ctypes
import dataclasses
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from minidl.backend import get_backend
from minidl.backend.cuda import cudnn_specs, halves, launches, norm, views
from minidl.backend.cuda import kernel_specs as ks
from minidl.backend.cuda.backend import CUDABackend, CudnnGraphs, DeviceArena, GraphUnsupported
from minidl.backend.mathmode import apply_math, backend_math
from minidl.backend.precision import HALF_DTYPES, check_half_kernels
from minidl.core.errors import OptionError
from tests.backend.test_cuda_host import (
    _DEVICE_ARRAYS,
    TABLES,
    EmulatedNormKernels,
    FakeCudnn,
    _conv_arrays,
    _DeviceArray,
    _FakeCupyArrays,
    _host_backend,
    _op_of,
    _table_by_op,
    _timed_backend,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
#: float32 values whose bf16 / fp16 roundings are ties or overflow: 1 + 2^-8 ties to even (1.0), 1 + 3*2^-8 ties up,
#: 70000 overflows fp16 to inf, a NaN stays a NaN.
VALUES = np.array([1 + 2**-8, 1 + 3 * 2**-8, -2.5, 70000.0, np.nan, 3e-41], np.float32)


# -- storage

def test_storage_dtypes_and_kernel_variants():
    assert halves.storage_dtype(BF16) == np.uint16 and halves.storage_dtype(np.float16) == np.float16
    assert halves.storage_dtype(np.float32) == np.float32 and halves.storage_dtype(np.int64) == np.int64
    assert halves.host_dtype(np.uint16) == BF16 and halves.host_dtype(np.float16) == np.float16
    assert views.storage_dtype is halves.storage_dtype
    assert [halves.half_of(np.empty(1, d)) for d in (np.uint16, np.float16, np.float32, np.int64)] == \
        ["bf16", "fp16", None, None]
    assert [halves.variant("relu_forward", h) for h in (None, "bf16", "fp16")] == \
        ["relu_forward", "relu_forward_bf16", "relu_forward_f16"]


def test_device_arena_views_bf16_as_its_bits():
    arena = DeviceArena(_FakeCupyArrays(), 1 << 16)
    v = arena.view_at(1024, (4, 8), BF16)
    assert v.dtype == np.uint16 and v.shape == (4, 8) and v.offset == 1024
    assert arena.view_at(1024, (4, 8), np.float16).dtype == np.float16
    spec = views.view_spec(1024, (4, 8), BF16, 1 << 16)
    assert (spec.dtype, spec.nbytes, spec.strides) == (np.uint16, 64, (16, 2))
    with pytest.raises(ValueError, match="past the arena"):
        arena.view_at((1 << 16) - 512, (257,), BF16)


# -- copies: the bits cross unchanged

class _Flags:
    c_contiguous = True


class _Dev:
    """A fake cupy ndarray over a host array: `get` and `set` copy it, as cupy's do."""

    def __init__(self, a):
        self.a = a
        self.shape, self.dtype, self.flags = a.shape, a.dtype, _Flags()

    def get(self, stream=None):
        return self.a.copy()

    def set(self, host, stream=None):
        assert host.dtype == self.a.dtype and host.shape == self.a.shape
        self.a[...] = host


def _copy_backend(half=None):
    cp = SimpleNamespace(ndarray=_Dev, copyto=None)
    be = CUDABackend.from_parts(cupy=cp, cupyx=None, cudnn=None, cublas=None, compute=_NullSync(),
                                transfer=_NullSync(), graphs=None, side=None, limits=launches.DeviceLimits(1024, 80),
                                filters=cudnn_specs.EngineFilters(half=half))
    return be


class _NullSync:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class _PtrStream(_NullSync):
    ptr = 0xC0


@pytest.mark.parametrize("half", [BF16, np.dtype(np.float16)])
def test_copy_in_rounds_as_numpy_and_to_host_gives_the_half_back(half):
    be = _copy_backend()
    dev = _Dev(np.zeros(VALUES.shape, halves.storage_dtype(half)))
    be.copy_in(dev, VALUES)
    with np.errstate(over="ignore"):
        want = VALUES.astype(half)                  # round to nearest even, as the CPU's copy_in
    assert dev.a.tobytes() == want.tobytes()
    cpu = np.empty(VALUES.shape, half)
    get_backend("cpu").copy_in(cpu, VALUES)
    assert cpu.tobytes() == want.tobytes()
    back = be.to_host(dev)
    assert back.dtype == half and back.tobytes() == want.tobytes()
    be.copy_in(dev, want)                           # a half host array goes in bit for bit
    assert dev.a.tobytes() == want.tobytes()


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_copy_in_from_a_float32_device_array_rounds_it_by_the_half_kernel(mode):
    """A float32 device source is rounded by round_copy (cupy's copyto into bf16's uint16 bits would store the
    values cast to integers); a half source of the same storage moves its bits; another dtype is refused."""
    be = _half_backend(mode)
    dt = halves.storage_dtype(HALF_DTYPES[mode])
    dst, src = np.zeros((2, 3), dt), np.arange(6, dtype=np.float32)
    be.copy_in(dst, src)
    (launch,) = be.launches
    assert launch.name == halves.variant("round_copy", mode) and launch.args[0] is dst
    assert launch.args[1].base is src and launch.args[1].shape == (2, 3)
    bits = _as_device(VALUES, dt)
    into = np.zeros(VALUES.shape, dt)
    be.copy_in(into, bits)
    assert into.tobytes() == bits.tobytes() and len(be.launches) == 1
    with pytest.raises(TypeError, match="copy: float64 into"):
        be.copy_in(dst, np.zeros(6, np.float64))


def test_bf16_offload_and_prefetch_move_bits_and_pin_bf16_buffers():
    be = _timed_backend()
    bits = VALUES.astype(BF16).view(np.uint16)
    dev = _DeviceArray(bits.copy(), copy_ms=1.0)
    try:
        host = be.host_empty(bits.shape, dev.dtype)
        assert host.dtype == BF16
        be.transfer_sync(be.offload_async(dev, host))
        assert host.view(np.uint16).tobytes() == bits.tobytes()
        dev.a[...] = 0
        be.transfer_sync(be.prefetch_async(host, dev))
        assert dev.a.tobytes() == bits.tobytes()
        with pytest.raises(ValueError, match="dtypes must match"):
            be.offload_async(dev, np.empty(bits.shape, np.float16))
    finally:
        _DEVICE_ARRAYS.pop(dev.data.ptr, None)


# -- a kernel's I/O: float32, or the mode's half, one dtype for all

def test_check_io_returns_the_half_and_names_what_is_wrong():
    bf = _host_backend(FakeCudnn())
    bf.filters = cudnn_specs.EngineFilters(half="bf16")
    x, y = np.zeros((2, 3), np.uint16), np.zeros((2, 3), np.uint16)
    assert bf._check_io("relu_forward", x=x, y=y, dx=None) == "bf16"
    assert bf._check_io("relu_forward", x=np.zeros(3, np.float32), y=np.zeros(3, np.float32)) is None
    assert bf._check_io("relu_forward") is None
    with pytest.raises(TypeError, match=r"relu_forward: y is float32 but x is uint16: a kernel's arrays share one"):
        bf._check_io("relu_forward", x=x, y=np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match=r"relu_forward: y must be float32 or uint16 in --math bf16, got float16"):
        bf._check_io("relu_forward", x=x, y=np.zeros((2, 3), np.float16))
    with pytest.raises(TypeError, match=r"relu_forward: x must be a cupy array on the device, got list"):
        bf._check_io("relu_forward", x=[1.0])
    with pytest.raises(ValueError, match=r"relu_forward: x must be C-contiguous"):
        bf._check_io("relu_forward", x=np.zeros((3, 2), np.uint16).T)
    fp = _host_backend(FakeCudnn())
    fp.filters = cudnn_specs.EngineFilters(half="fp16")
    assert fp._check_io("conv", x=np.zeros(2, np.float16), w=np.zeros(2, np.float16)) == "fp16"
    with pytest.raises(TypeError, match=r"conv: x must be float32 or float16 in --math fp16, got uint16"):
        fp._check_io("conv", x=x)
    f32 = _host_backend(FakeCudnn())
    with pytest.raises(TypeError, match=r"conv: x must be float32 in --math fp32, got float16"):
        f32._check_io("conv", x=np.zeros(2, np.float16))


# -- the mode switch and the capabilities

@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_set_math_takes_the_half_modes(mode):
    be = _host_backend(FakeCudnn())
    calls = []
    be._cublas_math = calls.append
    assert apply_math(be, mode) == mode and backend_math(be) == mode == be.math
    assert be.filters == cudnn_specs.EngineFilters(allow_tf32=False, deterministic=True, half=mode)
    assert be.filters.numeric_notes() == ("DOWN_CONVERT_INPUTS", "NONDETERMINISTIC")  # tensor cores, no TF32
    assert calls == []                                                                   # cuBLAS stays default math
    be.set_math("tf32")
    assert be.math == "tf32" and be.filters.half is None and calls == [True]
    be.set_math(mode)
    assert be.math == mode and calls == [True, False]
    be.set_math("fp32")
    assert be.math == "fp32" and be.filters.numeric_notes() == ("TENSOR_CORE", "DOWN_CONVERT_INPUTS",
                                                                 "NONDETERMINISTIC")


def test_half_kernels_are_the_union_of_the_three_lists():
    assert CUDABackend.capabilities.half_kernels == (launches.HALF_KERNELS | cudnn_specs.HALF_KERNELS
                                                     | norm.HALF_KERNELS)
    assert all(isinstance(k, frozenset) for k in (launches.HALF_KERNELS, cudnn_specs.HALF_KERNELS, norm.HALF_KERNELS))


def test_every_batchnorm_kernel_has_the_fallbacks_half_forms():
    from minidl import layers as L

    assert norm.HALF_KERNELS == set(L.BatchNorm2d().kernels())


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
def test_prepare_graph_loads_the_modes_forms_of_the_graph_kernels(mode):
    """A captured step's dropout launches the mode's form: loaded before the capture, which may not load one."""
    be = _half_backend(mode)
    loaded = []
    be.cp = SimpleNamespace(RawModule=lambda code: SimpleNamespace(get_function=lambda n: loaded.append(n) or n))
    be._modules, be._kernels = {}, {}
    be.prepare_graph()
    suffix = {"fp32": "", "bf16": "_bf16", "fp16": "_f16"}[mode]
    halves_loaded = {f"dropout_forward_dev{suffix}", f"dropout_backward_dev{suffix}"} if suffix else set()
    assert set(loaded) == set(CUDABackend.GRAPH_KERNELS) | halves_loaded


class _RecordingCupy:
    """cupy's RawModule on the host: records each text it is asked to compile; a module's functions are names."""

    def __init__(self):
        self.texts: list[str] = []

    def RawModule(self, code):
        self.texts.append(code)
        return SimpleNamespace(get_function=lambda name: name)


def test_a_run_compiles_its_modes_texts_only():
    """fp32 compiles float32 texts (no half entry point); bf16 one text per file, its float32 kernels (the loss's
    mean, a float32 gradient's accumulate) from it too; a switch to fp16 compiles that mode's text when a kernel
    asks, and a kernel loaded before keeps its function; a file without half forms has one text in every mode."""
    be = _half_backend("fp32")
    cp = be.cp = _RecordingCupy()
    be._modules, be._kernels = {}, {}
    for name in ("relu_forward", "scale_copy", "sgd_update"):
        be._kernel(name)
    assert cp.texts == [ks.module_source("elementwise.cu"), ks.module_source("optim.cu")]
    assert "#define HALF" not in cp.texts[0]
    be.set_math("bf16")
    for name in ("relu_forward_bf16", "accumulate", "softmax_xent_forward_bf16", "softmax_xent_mean", "adam_update"):
        be._kernel(name)
    assert cp.texts[2:] == [ks.module_source("elementwise.cu", "bf16"), ks.module_source("loss.cu", "bf16")]
    be.set_math("fp16")
    for name in ("relu_forward_f16", "relu_forward_bf16", "relu_forward", "softmax_xent_ignore_mean"):
        be._kernel(name)
    assert cp.texts[4:] == [ks.module_source("elementwise.cu", "fp16"), ks.module_source("loss.cu", "fp16")]
    assert set(be._modules) == {("elementwise.cu", None), ("optim.cu", None), ("elementwise.cu", "bf16"),
                                ("loss.cu", "bf16"), ("elementwise.cu", "fp16"), ("loss.cu", "fp16")}
    assert len(set(cp.texts)) == len(cp.texts)   # cupy's disk cache is keyed by the text: each mode's apart


# -- cuDNN graphs with half I/O and float32 compute

HALVES = [("bf16", np.dtype(np.uint16), "data_type.BFLOAT16"), ("fp16", np.dtype(np.float16), "data_type.HALF")]
F = "data_type.FLOAT"


def _half_backend(mode, fake=None):
    be = _host_backend(fake or FakeCudnn(plans=_table_by_op(TABLES)))
    be.set_math(mode)
    return be


def _tensor_types(g):
    return {kw["name"]: kw["data_type"] for op, kw in g.calls if op == "tensor"}


def _graph_of(fake, fe_op):
    return next(g for g in fake.graphs if any(op == fe_op for op, _ in g.calls))


@pytest.mark.parametrize("mode,dt,cudnn_dt", HALVES)
def test_half_conv_graphs_take_half_and_compute_in_float32(mode, dt, cudnn_dt):
    fake = FakeCudnn()
    graphs = CudnnGraphs(fake, handle=1)
    spec = cudnn_specs.ConvSpec.from_shapes((2, 4, 9, 7), (6, 2, 3, 2), (2, 6, 5, 7), (2, 1), (1, 1), (1, 2), 2,
                                            HALF_DTYPES[mode])
    assert spec.dtype == dt.name and spec.half
    f = cudnn_specs.EngineFilters(half=mode)
    built = {op: graphs.get(spec.key(op, f)) for op in ("fprop_bias", "dgrad", "wgrad", "dgrad_add")}
    for g in fake.graphs:
        assert g.kw == {"io_data_type": cudnn_dt, "intermediate_data_type": F, "compute_data_type": F, "handle": 1}
        ((conv, kw),) = [(op, kw) for op, kw in g.calls if op.startswith("conv_")]
        assert kw["compute_data_type"] == F and kw["padding"] == [1, 1] and kw["stride"] == [2, 1]
    d = spec.descs()
    # forward: half x, w, b in; conv + b in float32 (a virtual FLOAT tensor), y stored half
    g = _graph_of(fake, "conv_fprop")
    assert _tensor_types(g) == {"x": cudnn_dt, "w": cudnn_dt, "b": cudnn_dt}
    t = built["fprop_bias"].tensors
    assert t["b"].kw["dim"] == [1, 6, 1, 1] and t["b"].kw["stride"] == [6, 1, 1, 1]
    ((add_kw,),) = [[kw for op, kw in g.calls if op == "add"]]
    assert add_kw["b"] is t["b"] and add_kw["compute_data_type"] == F
    inner = add_kw["a"]
    assert inner.origin == "conv_fprop::Y" and inner.output is False and inner.data_type == F
    assert t["y"].origin == "add::OUT_0" and t["y"].output and t["y"].data_type == cudnn_dt
    assert t["y"].dim == list(d["y"].dim) and t["y"].stride == list(d["y"].stride)
    # dgrad: half dy, w in, half dx out
    g = _graph_of(fake, "conv_dgrad")
    assert _tensor_types(g) == {"y": cudnn_dt, "w": cudnn_dt}
    assert built["dgrad"].tensors["x"].data_type == cudnn_dt
    # wgrad: half x, dy in, float32 dw out
    g = _graph_of(fake, "conv_wgrad")
    assert _tensor_types(g) == {"x": cudnn_dt, "y": cudnn_dt}
    dw = built["wgrad"].tensors["w"]
    assert dw.data_type == F and dw.output and dw.dim == [6, 2, 3, 2] and dw.stride == [12, 6, 2, 1]
    # dgrad_add: dx + x_acc in float32, stored half
    t = built["dgrad_add"].tensors
    assert t["x_acc"].kw["data_type"] == cudnn_dt and t["x"].data_type == cudnn_dt
    g = fake.graphs[-1]
    ((add_kw,),) = [[kw for op, kw in g.calls if op == "add"]]
    assert add_kw["a"].data_type == F and add_kw["b"] is t["x_acc"]


def test_graph_keys_tell_the_dtypes_apart():
    shapes = ((2, 4, 9, 7), (6, 2, 3, 2), (2, 6, 5, 7), (2, 1), (1, 1), (1, 2), 2)
    specs = [cudnn_specs.ConvSpec.from_shapes(*shapes, dt) for dt in (np.float32, np.float16, BF16, np.uint16)]
    assert [s.dtype for s in specs] == ["float32", "float16", "uint16", "uint16"]   # bf16 is keyed by its storage
    assert len({s.key("fprop", cudnn_specs.EngineFilters()) for s in specs}) == 3
    bn = [cudnn_specs.BNSpec.from_shape((2, 3, 4, 4), dt) for dt in (np.float32, np.float16, BF16)]
    assert len({s.key("bn_train", cudnn_specs.EngineFilters()) for s in bn}) == 3
    fake = FakeCudnn()
    graphs = CudnnGraphs(fake, handle=1)
    for f in (cudnn_specs.EngineFilters(half="bf16"), cudnn_specs.EngineFilters(half="fp16")):
        graphs.get(specs[2].key("wgrad", f))
    assert len(fake.graphs) == 2      # the engine filters of each mode are part of the key too
    assert cudnn_specs.cudnn_dtype_name(BF16) == cudnn_specs.cudnn_dtype_name(np.uint16) == "BFLOAT16"


@pytest.mark.parametrize("mode,dt,cudnn_dt", HALVES)
def test_half_bn_and_relu_graphs_keep_float32_parameters_and_statistics(mode, dt, cudnn_dt):
    fake = FakeCudnn()
    graphs = CudnnGraphs(fake, handle=1)
    f = cudnn_specs.EngineFilters(half=mode)
    bn = cudnn_specs.BNSpec.from_shape((4, 6, 5, 3), HALF_DTYPES[mode])
    expected = {
        ("bn_train", "batchnorm"): ({"x": cudnn_dt, "scale": F, "bias": F, "running_mean": F, "running_var": F,
                                     "epsilon": F, "momentum": F},
                                    {"y": cudnn_dt, "mean": F, "invstd": F, "next_running_mean": F,
                                     "next_running_var": F}),
        ("bn_infer", "batchnorm_inference"): ({"x": cudnn_dt, "mean": F, "invstd": F, "scale": F, "bias": F},
                                              {"y": cudnn_dt}),
        ("bn_backward", "batchnorm_backward"): ({"dy": cudnn_dt, "x": cudnn_dt, "scale": F, "mean": F, "invstd": F},
                                                {"dx": cudnn_dt, "dscale": F, "dbias": F}),
    }
    for (op, fe_op), (ins, outs) in expected.items():
        built = graphs.get(bn.key(op, f))
        g = fake.graphs[-1]
        assert g.kw["io_data_type"] == cudnn_dt and g.kw["compute_data_type"] == F
        assert _tensor_types(g) == ins
        ((kw,),) = [[kw for o, kw in g.calls if o == fe_op]]
        assert kw["compute_data_type"] == F
        assert {k: built.tensors[k].data_type for k in outs} == outs
        assert built.tensors[next(iter(outs))].dim == [4, 6, 5, 3]
    pw = cudnn_specs.PointwiseSpec.from_shape((8, 10), HALF_DTYPES[mode])
    for op, fe_op, ins, out in (("relu_fwd", "relu", {"x": cudnn_dt}, "y"),
                                ("relu_bwd", "relu_backward", {"y": cudnn_dt, "dy": cudnn_dt}, "dx")):
        built = graphs.get(pw.key(op, f))
        g = fake.graphs[-1]
        assert _tensor_types(g) == ins and built.tensors[out].data_type == cudnn_dt
        ((kw,),) = [[kw for o, kw in g.calls if o == fe_op]]
        assert kw["compute_data_type"] == F


# -- dispatch of half convolutions and batch norms

class _LoggedNormKernels(EmulatedNormKernels):
    """The emulated cupy kernels, recording which of batch norm's kernels that read x or dy ran."""

    def __init__(self, log):
        super().__init__()
        for base in ("sum", "sqdev", "affine", "dot", "dx", "scale"):
            for name in (base, f"{base}_bf16", f"{base}_f16"):
                kernel = getattr(self, name)
                setattr(self, name, lambda *a, _k=kernel, _n=name, **kw: log.append(_n) or _k(*a, **kw))


class _HalfNormKernels(EmulatedNormKernels):
    """The emulated cupy kernels, recording which channel sum ran."""

    def __init__(self, log):
        super().__init__()
        for name in ("sum_f32", "sum_f32_bf16", "sum_f32_f16"):
            kernel = getattr(self, name)
            setattr(self, name, lambda *a, _k=kernel, _n=name, **kw: log.append(_n) or _k(*a, **kw))


def _as_device(a, dt):
    """float32 values as a half device array of storage dtype `dt` (bf16: its bits)."""
    with np.errstate(over="ignore"):
        return a.astype(halves.host_dtype(dt)).view(dt)


@pytest.mark.parametrize("mode,dt,cudnn_dt", HALVES)
def test_half_conv_dispatch(mode, dt, cudnn_dt):
    fake = FakeCudnn(plans=_table_by_op({**TABLES, "conv_fprop": [(2048, "f0", True), (0, "f1", True)]}))
    be = _half_backend(mode, fake)
    log = []
    be._norm_kernels = lambda: _HalfNormKernels(log)
    x32, w32, y32, p = _conv_arrays()
    x, w, y = _as_device(x32, dt), _as_device(w32, dt), np.zeros(y32.shape, dt)
    b = _as_device(np.arange(6, dtype=np.float32), dt)
    # the planner names 2-byte data float16 in both modes: the options are the mode's half graph's
    opts = be.conv_workspace_options("fwd", x.shape, w.shape, y.shape, p["stride"], p["padding"], p["dilation"],
                                     p["groups"], np.dtype(np.float16))
    assert [o.algo for o in opts] == ["cudnn:f0", "cudnn:f1"]
    assert fake.graphs[-1].kw["io_data_type"] == cudnn_dt and _op_of(fake.graphs[-1]) == "conv_fprop"
    be.conv2d_forward(x, w, b, y, algo="cudnn:f1", workspace=None, **p)
    (ex,) = fake.executions
    spec = cudnn_specs.ConvSpec.from_shapes(x.shape, w.shape, y.shape, **p, dtype=dt)
    t = be.graphs.get(spec.key("fprop_bias", be.filters)).tensors
    assert ex.pack == {t["x"]: x.ctypes.data, t["w"]: w.ctypes.data, t["b"]: b.ctypes.data, t["y"]: y.ctypes.data}
    assert not y.any()                              # the bias is the graph's: nothing added after it
    be.conv2d_forward(x, w, None, y, algo="cudnn:f1", workspace=None, **p)
    zeros = be.side.bufs[f"zeros6_{dt.name}"]
    assert fake.executions[-1].pack[t["b"]] == zeros.ctypes.data and zeros.dtype == dt and not zeros.any()
    # backward: half dx, float32 dw and db (db summed from the half dy, read exactly)
    fake.executions.clear()
    dy = _as_device(np.random.default_rng(1).standard_normal(y.shape).astype(np.float32), dt)
    dx, dw, db = np.zeros(x.shape, dt), np.zeros(w.shape, np.float32), np.zeros(6, np.float32)
    be.conv2d_backward(x, w, dy, dx, dw, db, algo="cudnn:d0w1", workspace=np.zeros(512, np.uint8), **p)
    dgrad, wgrad = fake.executions
    tw = be.graphs.get(spec.key("wgrad", be.filters)).tensors
    assert wgrad.pack == {tw["x"]: x.ctypes.data, tw["y"]: dy.ctypes.data, tw["w"]: dw.ctypes.data}
    assert log == [halves.variant("sum_f32", mode)]
    widened = dy.view(halves.host_dtype(dt)).astype(np.float64).sum(axis=(0, 2, 3)).astype(np.float32)
    np.testing.assert_array_equal(db, widened)
    with pytest.raises(TypeError, match=r"conv2d_backward: dw must be float32, got"):
        be.conv2d_backward(x, w, dy, dx, np.zeros(w.shape, dt), None, algo="cudnn:d0w1",
                           workspace=np.zeros(512, np.uint8), **p)
    with pytest.raises(TypeError, match=r"conv2d_forward: w is float32 but x is"):
        be.conv2d_forward(x, w32, None, y, algo="cudnn:f1", workspace=None, **p)


@pytest.mark.parametrize("mode,dt,cudnn_dt", HALVES)
def test_half_batchnorm_dispatch_and_refusals(mode, dt, cudnn_dt):
    fake = FakeCudnn()
    be = _half_backend(mode, fake)
    rng = np.random.default_rng(0)
    x = _as_device(rng.standard_normal((4, 3, 5, 5)).astype(np.float32), dt)
    y = np.zeros(x.shape, dt)
    w, b = np.ones(3, np.float32), np.zeros(3, np.float32)
    rm, rv, mean, inv = (np.zeros(3, np.float32) for _ in range(4))
    be.batchnorm_forward_train(x, w, b, rm, rv, y, mean, inv, momentum=0.1, eps=1e-5)
    train, apply = fake.executions
    bn = cudnn_specs.BNSpec.from_shape(x.shape, x.dtype)
    t = be.graphs.get(bn.key("bn_train", be.filters)).tensors
    assert train.pack[t["x"]] == x.ctypes.data and train.pack[t["mean"]] == mean.ctypes.data
    assert fake.graphs[0].kw["io_data_type"] == cudnn_dt
    dx = np.zeros(x.shape, dt)
    dw, db = np.zeros(3, np.float32), np.zeros(3, np.float32)
    be.batchnorm_backward(x, w, y, mean, inv, dx, dw, db)
    with pytest.raises(TypeError, match=r"batchnorm_forward_train: mean must be float32"):
        be.batchnorm_forward_train(x, w, b, rm, rv, y, mean.astype(dt), inv, momentum=0.1, eps=1e-5)


def _refuses_bn(g):
    return _op_of(g).startswith("batchnorm")


def _wide(a):
    """A half device array's exact float32 values."""
    return a.view(halves.host_dtype(a.dtype)).astype(np.float32)


def _against_float32(be, dt, seed):
    """`be` logging its norm kernels (the log), the float32 fallback backend to compare it with, and the seeded rng
    after drawing x and dy, (4, 3, 5, 5) in half storage `dt`."""
    log = []
    be._norm_kernels = lambda: _LoggedNormKernels(log)
    rng = np.random.default_rng(seed)
    x = _as_device((rng.standard_normal((4, 3, 5, 5)) * 2 + 0.5).astype(np.float32), dt)
    dy = _as_device(rng.standard_normal((4, 3, 5, 5)).astype(np.float32), dt)
    return log, _host_backend(FakeCudnn(), use_cudnn_bn=False), rng, x, dy


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("cudnn", ["refuses", "off"])
@pytest.mark.parametrize("mode,dt,cudnn_dt", HALVES)
def test_half_batchnorm_without_cudnn_is_the_float32_fallback_on_the_exact_values(mode, dt, cudnn_dt, cudnn, affine):
    """Where cuDNN refuses a half BN graph (or `use_cudnn_bn` is off) the cupy kernels' half forms run: x and dy
    read exactly, statistics, running statistics and parameter gradients those of the float32 kernels on the
    widened values, y and dx their float32 results rounded once; C expressions evaluated with numpy."""
    be = _host_backend(FakeCudnn(unsupported=_refuses_bn) if cudnn == "refuses" else FakeCudnn(),
                       use_cudnn_bn=cudnn != "off")
    be.set_math(mode)
    log, f32, rng, x, dy = _against_float32(be, dt, seed=5)
    shape, c = x.shape, x.shape[1]
    w = rng.uniform(0.5, 1.5, c).astype(np.float32) if affine else None
    b = rng.standard_normal(c).astype(np.float32) if affine else None
    rm0, rv0 = rng.standard_normal(c).astype(np.float32), rng.uniform(0.5, 2, c).astype(np.float32)
    outs = {}
    for backend, xs, dys, d in ((be, x, dy, dt), (f32, _wide(x), _wide(dy), np.float32)):
        rm, rv, mean, inv = rm0.copy(), rv0.copy(), np.zeros(c, np.float32), np.zeros(c, np.float32)
        y, y2, y_eval = (np.zeros(shape, d) for _ in range(3))
        dx, dw, db = np.zeros(shape, d), np.zeros(c, np.float32), np.zeros(c, np.float32)
        dw_only, db_only = np.zeros(c, np.float32), np.zeros(c, np.float32)
        backend.batchnorm_forward_train(xs, w, b, rm, rv, y, mean, inv, momentum=0.1, eps=1e-5)
        backend.batchnorm_forward_apply(xs, w, b, mean, inv, y2)               # a recomputation's call
        backend.batchnorm_forward_eval(xs, w, b, rm, rv, y_eval, eps=1e-5)
        backend.batchnorm_backward(xs, w, dys, mean, inv, dx, dw if affine else None, db if affine else None)
        backend.batchnorm_backward(xs, w, dys, mean, inv, None, dw_only, db_only)   # no dx: sums only
        outs[backend is be] = dict(y=y, y2=y2, y_eval=y_eval, dx=dx, rm=rm, rv=rv, mean=mean, inv=inv, dw=dw, db=db,
                                   dw_only=dw_only, db_only=db_only)
    half, ref = outs[True], outs[False]
    for k in ("y", "y2", "y_eval", "dx"):
        assert half[k].view(halves.host_dtype(dt)).tobytes() == ref[k].astype(halves.host_dtype(dt)).tobytes(), k
    for k in ("rm", "rv", "mean", "inv", "dw", "db", "dw_only", "db_only"):
        np.testing.assert_array_equal(half[k], ref[k], err_msg=k)
    assert np.array_equal(half["y2"], half["y"]) and (half["dw_only"] != 0).all()
    assert log == [halves.variant(k, mode) for k in ("sum", "sqdev", "affine", "affine", "affine", "sum", "dot", "dx",
                                                     "sum", "dot")]
    if cudnn == "refuses":
        assert {"bn_train", "bn_infer", "bn_backward"} <= set(be.fallbacks)
        assert all("no engine" in be.fallbacks[op] for op in ("bn_train", "bn_infer", "bn_backward"))
        assert not be.graphs._cache                 # every BN graph was refused: none built
    else:
        assert not be.fallbacks and not be.graphs._cache     # cuDNN was never asked


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("mode,dt,cudnn_dt", HALVES)
def test_half_batchnorm_backward_eval_is_the_float32_kernels_on_the_exact_values(mode, dt, cudnn_dt, affine):
    """The backward with the running statistics (cupy kernels, no cuDNN op): half x and dy read exactly, the sums
    and dweight/dbias those of the float32 kernels on the widened values, dx their float32 dx rounded once; as the
    file's float32 fallback test, its C expressions evaluated with numpy."""
    be = _half_backend(mode, FakeCudnn())
    log, f32, rng, x, dy = _against_float32(be, dt, seed=4)
    shape, c = x.shape, x.shape[1]
    dy.reshape(-1)[:2] = _as_device(np.float32([6e4, -6e4]), dt)     # dx = dy * 10 overflows fp16
    w = rng.uniform(0.5, 1.5, c).astype(np.float32) if affine else None
    rm, rv = rng.standard_normal(c).astype(np.float32), np.float32([0.01, 0.7, 1.9])
    outs = {}
    for backend, xs, dys, d in ((be, x, dy, dt), (f32, _wide(x), _wide(dy), np.float32)):
        dx, dw, db = np.zeros(shape, d), np.zeros(c, np.float32), np.zeros(c, np.float32)
        with np.errstate(over="ignore"):
            backend.batchnorm_backward_eval(xs, w, dys, rm, rv, 1e-5, dx, dw if affine else None,
                                            db if affine else None)
        outs[backend is be] = dx, dw, db
    (dx, dw, db), (dx32, dw32, db32) = outs[True], outs[False]
    with np.errstate(over="ignore"):
        assert dx.view(halves.host_dtype(dt)).tobytes() == dx32.astype(halves.host_dtype(dt)).tobytes()
    assert np.isinf(_wide(dx)).any() == (mode == "fp16") and np.isfinite(dw).all() and np.isfinite(db).all()
    np.testing.assert_array_equal(dw, dw32)
    np.testing.assert_array_equal(db, db32)
    assert log == [halves.variant(k, mode) for k in ("sum", "dot", "scale")]
    assert not be.graphs._cache                     # cuDNN was never asked
    with pytest.raises(TypeError, match=r"batchnorm_backward_eval: dx is float32 but x is"):
        be.batchnorm_backward_eval(x, w, dy, rm, rv, 1e-5, np.zeros(shape, np.float32), None, None)


# -- products: cublasGemmEx on half storage, float32 accumulation

class FakeCublasLib:
    """cupy_backends' cuBLAS bindings as the half products call them: `gemmEx` (column-major, positional, as bound
    in cupy_backends/cuda/libs/cublas.pyx) computed by numpy over the host arrays its pointers address; each call
    recorded."""

    TYPES = {0: np.dtype(np.float32), 2: np.dtype(np.float16), 14: np.dtype(np.uint16)}

    def __init__(self):
        self.arrays, self.calls, self.modes, self.streams = {}, [], [], []
        self.capturing = False

    def register(self, *arrays):
        for a in arrays:
            self.arrays[a.ctypes.data] = a

    def setPointerMode(self, handle, mode):
        self.modes.append((handle, mode))

    def setStream(self, handle, stream):   # cupy refuses a capturing stream here, before any work is enqueued
        if self.capturing:
            raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")
        self.streams.append((handle, stream))

    def gemmEx(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
               computeType, algo):
        self.calls.append(dict(transa=transa, transb=transb, m=m, n=n, k=k, Atype=Atype, lda=lda, Btype=Btype,
                               ldb=ldb, Ctype=Ctype, ldc=ldc, computeType=computeType, algo=algo,
                               alpha=ctypes.c_float.from_address(alpha).value,
                               beta=ctypes.c_float.from_address(beta).value))

        def col_major(ptr, typ, rows, cols, ld):
            a = self.arrays[ptr]
            assert a.dtype == self.TYPES[typ] and a.size == rows * cols and ld == rows
            return a.reshape(-1).view(halves.host_dtype(a.dtype)).astype(np.float32).reshape(cols, rows).T

        a = col_major(A, Atype, *((m, k) if transa == 0 else (k, m)), lda)
        b = col_major(B, Btype, *((k, n) if transb == 0 else (n, k)), ldb)
        a, b = (a if transa == 0 else a.T), (b if transb == 0 else b.T)
        c = self.arrays[C]
        out = np.float32(self.calls[-1]["alpha"]) * (a @ b) + np.float32(self.calls[-1]["beta"]) * \
            col_major(C, Ctype, m, n, ldc)
        with np.errstate(over="ignore"):
            c.reshape(-1)[...] = out.T.reshape(-1).astype(halves.host_dtype(c.dtype)).view(c.dtype)

    def gemmStridedBatchedEx(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
                             strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
        """`batchCount` column-major products, each matrix read (and C written) at its host address; summed in
        float64, exact for the tests' few-term products of halves, so no BLAS kernel's summation order shows."""
        self.calls.append(dict(transa=transa, transb=transb, m=m, n=n, k=k, Atype=Atype, lda=lda, strideA=strideA,
                               Btype=Btype, ldb=ldb, strideB=strideB, Ctype=Ctype, ldc=ldc, strideC=strideC,
                               count=batchCount, computeType=computeType, algo=algo,
                               alpha=ctypes.c_float.from_address(alpha).value,
                               beta=ctypes.c_float.from_address(beta).value))

        def at(ptr, typ, rows, cols, ld, stride):
            """(the storage from `ptr` on, the element indices of each batch's column-major rows x cols)."""
            assert ld >= max(rows, 1)
            dt = self.TYPES[typ]
            idx = (stride * np.arange(batchCount)[:, None, None] + np.arange(rows)[None, :, None]
                   + ld * np.arange(cols)[None, None, :])
            raw = (ctypes.c_char * ((int(idx.max()) + 1) * dt.itemsize)).from_address(ptr)
            return np.frombuffer(raw, dt), idx

        def wide(ptr, typ, rows, cols, ld, stride, trans):
            mem, idx = at(ptr, typ, *((cols, rows) if trans else (rows, cols)), ld, stride)
            v = mem[idx].view(halves.host_dtype(mem.dtype)).astype(np.float64)
            return v.transpose(0, 2, 1) if trans else v

        a = wide(A, Atype, m, k, lda, strideA, transa)
        b = wide(B, Btype, k, n, ldb, strideB, transb)
        mem, idx = at(C, Ctype, m, n, ldc, strideC)
        with np.errstate(over="ignore"):
            mem[idx] = (a @ b).astype(np.float32).astype(halves.host_dtype(mem.dtype)).view(mem.dtype)


@pytest.mark.parametrize("mode,dt,cudnn_dt", HALVES)
def test_half_linear_runs_gemm_ex_with_float32_accumulation(mode, dt, cudnn_dt):
    be = _half_backend(mode)
    be.compute = _PtrStream()
    lib = FakeCublasLib()
    be._cublas_ex = (lib, 77)
    log = []
    be._norm_kernels = lambda: _HalfNormKernels(log)
    rng = np.random.default_rng(0)
    x32, w32, b32 = (rng.standard_normal(s).astype(np.float32) for s in ((5, 2, 3), (4, 6), (4,)))
    x, w, b = _as_device(x32, dt), _as_device(w32, dt), _as_device(b32, dt)
    y = np.zeros((5, 4), dt)
    lib.register(x, w, b, y)
    be.linear_forward(x, w, b, y)
    with np.errstate(over="ignore"):
        want = (_wide(x).reshape(5, 6) @ _wide(w).T + _wide(b)).astype(halves.host_dtype(dt))   # one rounding
    assert y.view(halves.host_dtype(dt)).tobytes() == want.tobytes()
    (call,) = lib.calls
    t = {np.dtype(np.uint16): 14, np.dtype(np.float16): 2}[dt]
    assert call == dict(transa=1, transb=0, m=4, n=5, k=6, Atype=t, lda=6, Btype=t, ldb=6, Ctype=t, ldc=4,
                        computeType=68, algo=-1, alpha=1.0, beta=1.0)
    assert lib.modes == [(77, 0)] and lib.streams == [(77, 0xC0)]     # the compute stream, host scalars
    be.linear_forward(x, w, None, y)
    assert lib.calls[-1]["beta"] == 0.0
    lib.calls.clear()
    dy = _as_device(rng.standard_normal((5, 4)).astype(np.float32), dt)
    dx, dw, db = np.zeros(x.shape, dt), np.zeros((4, 6), np.float32), np.zeros(4, np.float32)
    lib.register(dy, dx, dw)
    be.linear_backward(x, w, dy, dx, dw, db)
    dx_call, dw_call = lib.calls
    assert dx_call == dict(transa=0, transb=0, m=6, n=5, k=4, Atype=t, lda=6, Btype=t, ldb=4, Ctype=t, ldc=6,
                           computeType=68, algo=-1, alpha=1.0, beta=0.0)
    assert dw_call == dict(transa=0, transb=1, m=6, n=4, k=5, Atype=t, lda=6, Btype=t, ldb=4, Ctype=0, ldc=6,
                           computeType=68, algo=-1, alpha=1.0, beta=0.0)    # float32 C: the weight gradient
    with np.errstate(over="ignore"):
        assert dx.view(halves.host_dtype(dt)).tobytes() == \
            (_wide(dy) @ _wide(w)).astype(halves.host_dtype(dt)).reshape(x.shape).tobytes()
    np.testing.assert_array_equal(dw, _wide(dy).T @ _wide(x).reshape(5, 6))
    assert log == [halves.variant("sum_f32", mode)]
    np.testing.assert_array_equal(db, _wide(dy).astype(np.float64).sum(axis=0).astype(np.float32))
    with pytest.raises(TypeError, match=r"linear_backward: dw must be float32"):
        be.linear_backward(x, w, dy, dx, np.zeros((4, 6), dt), None)
    lib.capturing, y[...] = True, 0
    with pytest.raises(be.CaptureUnsupported):
        be.linear_forward(x, w, b, y)
    assert not y.any()            # refused before the bias was copied in: the call runs eagerly, once



@pytest.mark.parametrize("mode,dt,cudnn_dt", HALVES)
def test_half_matmul_runs_strided_batched_gemm_ex_on_the_half_storage(mode, dt, cudnn_dt):
    """matmul in half: cublasGemmStridedBatchedEx on the arena's half views (transposed and head-split views
    included), float32 accumulation, each value rounded once; no copy, so no byte outside the arena."""
    be = _half_backend(mode)
    be.compute = _PtrStream()
    lib = FakeCublasLib()
    be._cublas_ex = (lib, 77)
    rng = np.random.default_rng(0)
    dev = lambda *s: _as_device(rng.standard_normal(s).astype(np.float32), dt)   # noqa: E731
    wide = lambda a: a.view(halves.host_dtype(a.dtype)).astype(np.float64)       # noqa: E731
    rounded = lambda f: f.astype(np.float32).astype(halves.host_dtype(dt)).tobytes()   # noqa: E731
    a = dev(2, 5, 3, 4).transpose(0, 2, 1, 3)        # (2, 3, 5, 4): heads split out of (batch, time, head, d)
    b = dev(2, 3, 6, 4).swapaxes(-1, -2)             # (2, 3, 4, 6): a transposed view
    y = np.zeros((2, 3, 5, 6), dt)
    be.matmul_forward(a, b, y)
    assert y.view(halves.host_dtype(dt)).tobytes() == rounded(wide(a) @ wide(b))
    t = {np.dtype(np.uint16): 14, np.dtype(np.float16): 2}[dt]
    assert len(lib.calls) == 2 and all(c["count"] == 3 and c["Atype"] == c["Btype"] == c["Ctype"] == t
                                       and c["computeType"] == 68 for c in lib.calls)
    assert (lib.calls[0]["transa"], lib.calls[0]["transb"]) == (1, 0)     # b^T a^T: b's rows are contiguous
    lib.calls.clear()
    dy, da, db = dev(2, 3, 5, 6), np.zeros((2, 3, 5, 4), dt), np.zeros((2, 3, 6, 4), dt).swapaxes(-1, -2)
    be.matmul_backward(a, b, dy, da, db)
    assert da.view(halves.host_dtype(dt)).tobytes() == rounded(wide(dy) @ wide(b).swapaxes(-1, -2))
    assert np.ascontiguousarray(db).view(halves.host_dtype(dt)).tobytes() == \
        rounded(np.ascontiguousarray(wide(a).swapaxes(-1, -2) @ wide(dy)))
    assert be.side.nbytes == 0 and not be.launches
    with pytest.raises(ValueError, match=r"matmul: a \(2, 3, 4\) .* neither rows nor columns contiguous"):
        be.matmul_forward(dev(2, 3, 8)[:, :, ::2], dev(2, 4, 6), np.zeros((2, 3, 6), dt))


# -- what is wired

def test_the_cudnn_half_kernels_are_layer_kernels_the_backend_runs():
    from minidl import layers as L

    layer_kernels = {k for layer in (L.Conv2d(4, 3), L.Linear(4), L.MatMul(), L.BatchNorm2d())
                     for k in layer.kernels()}
    assert cudnn_specs.HALF_KERNELS <= layer_kernels
    assert all(callable(getattr(CUDABackend, k)) for k in cudnn_specs.HALF_KERNELS)
    assert cudnn_specs.HALF_KERNELS == {"conv2d_forward", "conv2d_backward", "linear_forward", "linear_backward",
                                        "matmul_forward", "matmul_backward", "batchnorm_forward_train",
                                        "batchnorm_forward_apply", "batchnorm_forward_eval", "batchnorm_backward"}
    check_half_kernels([L.Linear(4, name="fc")], CUDABackend, "bf16")     # a linear layer runs in half on CUDA


#: Every zoo network, small: its layers' kernels are what a half mode asks of a backend.
ZOO = {
    "resnet50": lambda m: m.resnet(50, batch=2, image_size=64, num_classes=10, variant="imagenet"),
    "resnet20_cifar": lambda m: m.resnet(20, batch=2, image_size=32, num_classes=10, variant="cifar"),
    "densenet_tiny": lambda m: m.densenet(batch=2, image_size=32, num_classes=10, variant="tiny"),
    "inception_v4": lambda m: m.inception_v4(batch=1, num_classes=10),
    "vgg16": lambda m: m.vgg(16, batch=1, image_size=224, num_classes=10),
    "vgg11_bn": lambda m: m.vgg(11, batch=1, image_size=224, num_classes=10, batch_norm=True),
    "alexnet": lambda m: m.alexnet(batch=2, num_classes=10),
    "alexnet_lrn": lambda m: m.alexnet(batch=2, num_classes=10, variant="lrn"),
    "lenet": lambda m: m.lenet(batch=2),
    "gpt2": lambda m: m.gpt2(layers=1, heads=2, width=16, seq=8, batch=2, vocab=32, positions=8),
    "bert": lambda m: m.bert(layers=1, heads=2, width=16, seq=8, batch=2, vocab=32, positions=8),
}


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_zoo_network_has_its_half_kernels_on_cuda(name, mode):
    from minidl import models

    net = ZOO[name](models)
    check_half_kernels([n.layer for n in net.layer_nodes], CUDABackend, mode)


def test_a_fusion_the_backend_does_not_run_is_not_asked_of_its_half_kernels():
    """`Add.kernels()` names add_relu_backward, a fusion CUDA does not run (its runner calls ReLU's and add's own
    backward): an add is not refused for it on CUDA, and is on a backend that fuses it without a half form."""
    from types import SimpleNamespace

    from minidl import layers as L
    from minidl.backend.base import FUSES_ADD_RELU_BACKWARD

    add = L.Add(name="sum")
    assert "add_relu_backward" in add.kernels() and FUSES_ADD_RELU_BACKWARD not in CUDABackend.capabilities.fuses
    check_half_kernels([add], CUDABackend, "bf16")
    fusing = SimpleNamespace(capabilities=dataclasses.replace(
        CUDABackend.capabilities, fuses=frozenset({FUSES_ADD_RELU_BACKWARD})))
    with pytest.raises(OptionError, match=r"layer 'sum' \(add\) has no bf16 kernel .*\(add_relu_backward\)"):
        check_half_kernels([add], fusing, "bf16")


@pytest.mark.parametrize("mode,dt,cudnn_dt", HALVES)
def test_a_half_accumulating_backward_has_only_the_fused_add(mode, dt, cudnn_dt):
    be = _half_backend(mode, FakeCudnn(plans=_table_by_op(TABLES), unsupported=lambda g: _op_of(g) == "conv_dgrad"
                                       and any(op == "add" for op, _ in g.calls)))
    x32, w32, y32, p = _conv_arrays()
    conf = (p["stride"], p["padding"], p["dilation"], p["groups"])
    with pytest.raises(GraphUnsupported, match=r"dgrad_add on .* data has no kernel but cuDNN's"):
        be.conv_workspace_options("bwd", x32.shape, w32.shape, y32.shape, *conf, np.float16, accumulate=True)
    f32 = _host_backend(FakeCudnn(plans=_table_by_op(TABLES), unsupported=lambda g: _op_of(g) == "conv_dgrad"
                                  and any(op == "add" for op, _ in g.calls)))
    opts = f32.conv_workspace_options("bwd", x32.shape, w32.shape, y32.shape, *conf, accumulate=True)
    assert all(o.algo.endswith("+add") for o in opts)                    # float32 adds after instead
    x, w, dy = _as_device(x32, dt), _as_device(w32, dt), np.zeros(y32.shape, dt)
    with pytest.raises(ValueError, match=r"conv2d bwd: 'cudnn:d0w0\+add' adds dx after the data gradient"):
        be.conv2d_backward(x, w, dy, np.zeros(x.shape, dt), None, None, *conf, "cudnn:d0w0+add",
                           np.zeros(4096, np.uint8), accumulate=True)
