"""Host-only tests of the CUDA backend: everything it computes without a device.

No GPU, cupy or cuDNN is needed (nor used, even where installed):
  * importing minidl and the CUDA backend's module works with cupy/cudnn unimportable, and constructing the backend then
    fails with a clear CUDAUnavailable;
  * arena views (views.view_spec): byte ranges, strides (against numpy), bounds and alignment, fuzzed against
    the tensor pool; DeviceArena with a fake cupy;
  * cuDNN graph parameters (tensor dims/strides, conv padding/stride/dilation, BN dims, cache keys) and the
    adapter's call sequence against a recording fake of the `cudnn` module;
  * convolution plans as workspace options (names, Pareto pruning, agreement with a brute-force planner);
  * kernel launch packing for every kernel of kernel_specs.KERNELS;
  * the backend's dispatch (which graph, which plan, which pointer goes where) with host arrays standing in for
    device arrays.
The numerics of the GPU path are tested by tests/backend/test_conformance.py on a machine with a GPU.
"""
from __future__ import annotations

import ctypes
import itertools
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from minidl.backend.cuda import cudnn_specs, launches, views
from minidl.backend.cuda import kernel_specs as ks
from minidl.backend.cuda.backend import CUDABackend, CudnnGraphs, DeviceArena, GraphUnsupported
from minidl.layers.base import WorkspaceOption
from minidl.memory.pool import ALIGNMENT, TensorPool

# ---------------------------------------------------------------------------------------------------------
# Import isolation
# ---------------------------------------------------------------------------------------------------------

def _run_isolated(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter in which cupy, cupyx and cudnn cannot be imported."""
    prelude = "import sys\nfor m in ('cupy', 'cupyx', 'cudnn'):\n    sys.modules[m] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_import_needs_no_cupy_or_cudnn():
    r = _run_isolated("""
        import minidl, minidl.backend.cuda.backend, minidl.backend.cuda.launches
        from minidl.backend import get_backend
        from minidl.backend.cuda.backend import CUDABackend, CUDAUnavailable
        assert sys.modules['cupy'] is None and sys.modules['cudnn'] is None
        for make in (CUDABackend, lambda: get_backend('cuda')):
            try:
                make()
            except RuntimeError as e:
                assert isinstance(e, CUDAUnavailable), type(e)
                assert 'CuPy' in str(e) and '--backend cpu' in str(e), str(e)
            else:
                raise AssertionError('constructing the CUDA backend without cupy must fail')
        print('OK')
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OK"


def test_missing_cudnn_frontend_is_named():
    r = _run_isolated("""
        import types
        sys.modules['cupy'] = types.ModuleType('cupy')    # a cupy that imports ...
        sys.modules['cupyx'] = types.ModuleType('cupyx')
        from minidl.backend.cuda.backend import CUDABackend, CUDAUnavailable
        try:
            CUDABackend()
        except CUDAUnavailable as e:
            assert 'cuDNN frontend' in str(e) and 'nvidia-cudnn-frontend' in str(e), str(e)
            print('OK')
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OK"


def test_cpu_backend_unaffected_without_cuda():
    r = _run_isolated("""
        import numpy as np
        from minidl.backend import get_backend
        be = get_backend('cpu')
        y = np.empty(4, np.float32)
        be.relu_forward(np.array([-1, 0, 2, -3], np.float32), y)
        assert y.tolist() == [0, 0, 2, 0]
        print('OK')
    """)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------------------------------------
# Arena views
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4, 5), (0, 3), (3, 0, 2), (1, 1, 1), (2, 1, 6, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.uint8, np.float16])
def test_strides_match_numpy(shape, dtype):
    a = np.empty(shape, dtype)
    assert len(views.contiguous_strides(shape, a.itemsize)) == a.ndim
    if a.size:  # numpy reports zero strides for zero-size arrays; no element is addressed there
        assert views.contiguous_strides(shape, a.itemsize) == a.strides
        assert views.contiguous_strides(shape) == tuple(s // a.itemsize for s in a.strides)


def test_view_spec_ranges_and_checks():
    s = views.view_spec(1024, (2, 3, 4), np.float32, capacity=4096)
    assert (s.offset, s.nbytes, s.end, s.size) == (1024, 96, 1120, 24)
    assert s.strides == (48, 16, 4) and s.dtype == np.float32 and s.shape == (2, 3, 4)
    assert views.view_spec(0, 5, np.uint8, 5).shape == (5,)
    assert views.view_spec(4096, (0,), np.float32, 4096).nbytes == 0
    with pytest.raises(ValueError, match="past the arena"):
        views.view_spec(4000, (100,), np.float32, 4096)
    with pytest.raises(ValueError, match="not aligned"):
        views.view_spec(8, (2,), np.float32, 4096)             # cuDNN wants 16-byte alignment
    with pytest.raises(ValueError, match="not aligned"):
        views.view_spec(1, (2,), np.uint8, 4096)
    assert views.view_spec(1, (2,), np.uint8, 4096, alignment=1).offset == 1
    with pytest.raises(ValueError, match="not aligned"):
        views.view_spec(4, (1,), np.float64, 4096, alignment=1)  # never below the itemsize
    with pytest.raises(ValueError, match="negative"):
        views.view_spec(-512, (1,), np.float32, 4096)
    with pytest.raises(ValueError, match="negative dimension"):
        views.view_spec(0, (2, -1), np.float32, 4096)
    views.check_base_alignment(0x7F0000000000)
    with pytest.raises(ValueError, match="256"):
        views.check_base_alignment(0x7F0000000080)


def test_views_of_live_pool_blocks_never_overlap():
    """Fuzz: any set of live pool blocks gives views that stay in the arena and share no byte."""
    rng = np.random.default_rng(0)
    pool = TensorPool(1 << 20)
    live: dict[int, views.ViewSpec] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            off = int(rng.choice(list(live)))
            pool.free(off)
            del live[off]
            continue
        dtype = [np.float32, np.float64, np.int64, np.uint8][rng.integers(4)]
        shape = tuple(int(d) for d in rng.integers(0, 20, size=rng.integers(0, 4)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        try:
            off = pool.alloc(nbytes)
        except MemoryError:
            continue
        spec = views.view_spec(off, shape, dtype, pool.capacity)
        assert spec.offset % ALIGNMENT == 0 and spec.end <= off + pool.size_of(off)
        for other in live.values():
            assert not views.ranges_overlap(spec, other)
        live[off] = spec


class _FakeMemory:
    def __init__(self, size, ptr=0x7F0000000000):
        self.size, self.ptr = size, ptr


class _FakeMemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.offset, self.ptr = mem, offset, mem.ptr + offset


class _FakeCupyArrays:
    """The slice of cupy DeviceArena uses: cuda.memory.Memory / MemoryPointer and ndarray(shape, dtype, memptr=)."""

    def __init__(self, base=0x7F0000000000):
        self.cuda = SimpleNamespace(memory=SimpleNamespace(Memory=lambda n: _FakeMemory(n, base),
                                                           MemoryPointer=_FakeMemoryPointer))

    @staticmethod
    def ndarray(shape, dtype, memptr):
        return SimpleNamespace(shape=shape, dtype=dtype, ptr=memptr.ptr, offset=memptr.offset, mem=memptr.mem)


def test_device_arena_views():
    arena = DeviceArena(_FakeCupyArrays(), 1 << 16)
    v = arena.view_at(1536, (4, 8), np.float32)
    assert v.shape == (4, 8) and v.dtype == np.float32 and v.offset == 1536 and v.ptr == arena.ptr + 1536
    assert v.mem is arena.memory                              # the view keeps the one allocation alive
    b = arena[512:1024]                                       # the generic pool.view path: arena[o:o+n]
    assert b.shape == (512,) and b.dtype == np.uint8 and b.offset == 512
    assert len(arena) == arena.shape[0] == 1 << 16
    with pytest.raises(ValueError, match="past the arena"):
        arena.view_at((1 << 16) - 512, (256,), np.float32)
    with pytest.raises(TypeError):
        arena[0:8:2]
    with pytest.raises(ValueError, match="256"):
        DeviceArena(_FakeCupyArrays(base=0x7F0000000010), 1024)


# ---------------------------------------------------------------------------------------------------------
# cuDNN graph parameters
# ---------------------------------------------------------------------------------------------------------

CONV_CONFIGS = [
    # x shape, w shape, stride, padding, dilation, groups
    ((2, 3, 8, 8), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((2, 4, 9, 7), (6, 2, 3, 2), (2, 1), (1, 0), (1, 1), 2),
    ((1, 8, 10, 10), (8, 1, 3, 3), (1, 1), (2, 2), (2, 2), 8),     # depthwise, dilated
    ((3, 5, 6, 6), (7, 5, 1, 1), (1, 1), (0, 0), (1, 1), 1),       # 1x1
    ((2, 3, 11, 13), (5, 3, 5, 3), (3, 2), (2, 1), (1, 2), 1),
]


def _torch_out_shape(x, w, stride, padding, dilation, groups):
    torch = pytest.importorskip("torch")
    return tuple(torch.nn.functional.conv2d(torch.zeros(x), torch.zeros(w), None, stride, padding, dilation,
                                            groups).shape)


@pytest.mark.parametrize("x,w,stride,padding,dilation,groups", CONV_CONFIGS)
def test_conv_spec(x, w, stride, padding, dilation, groups):
    y = _torch_out_shape(x, w, stride, padding, dilation, groups)
    spec = cudnn_specs.ConvSpec.from_shapes(x, w, y, stride, padding, dilation, groups, np.float32)
    assert spec.conv_kwargs() == {"padding": list(padding), "stride": list(stride), "dilation": list(dilation)}
    d = spec.descs()
    for name, shape in (("x", x), ("w", w), ("y", y)):
        assert d[name].dim == shape and d[name].dtype == "FLOAT" and d[name].name == name
        assert d[name].stride == tuple(s // 4 for s in np.empty(shape, np.float32).strides)
        assert d[name].kwargs() == {"name": name, "dim": list(shape), "stride": list(d[name].stride)}
    assert spec.io("fprop") == (("x", "w"), "y")
    assert spec.io("dgrad") == (("y", "w"), "x")
    assert spec.io("wgrad") == (("x", "y"), "w")
    wrong = (y[0], y[1], y[2] + 1, y[3])
    with pytest.raises(ValueError, match="output must be"):
        cudnn_specs.ConvSpec.from_shapes(x, w, wrong, stride, padding, dilation, groups, np.float32)


def test_conv_spec_rejects_bad_configs():
    ok = dict(stride=(1, 1), padding=(0, 0), dilation=(1, 1))
    with pytest.raises(ValueError, match="groups"):
        cudnn_specs.ConvSpec.from_shapes((1, 4, 5, 5), (4, 3, 1, 1), (1, 4, 5, 5), groups=1, dtype=np.float32, **ok)
    with pytest.raises(ValueError, match="4-D"):
        cudnn_specs.ConvSpec.from_shapes((4, 5, 5), (4, 4, 1, 1), (1, 4, 5, 5), groups=1, dtype=np.float32, **ok)
    with pytest.raises(ValueError, match="invalid stride"):
        cudnn_specs.ConvSpec.from_shapes((1, 4, 5, 5), (4, 4, 1, 1), (1, 4, 5, 5), (0, 1), (0, 0), (1, 1), 1,
                                    np.float32)
    with pytest.raises(ValueError, match="unknown convolution op"):
        cudnn_specs.ConvSpec.from_shapes((1, 4, 5, 5), (4, 4, 1, 1), (1, 4, 5, 5), groups=1, dtype=np.float32,
                                    **ok).io("bwd")


def test_graph_keys():
    f = cudnn_specs.EngineFilters()
    a = cudnn_specs.ConvSpec.from_shapes((2, 3, 8, 8), (4, 3, 3, 3), (2, 4, 8, 8), (1, 1), (1, 1), (1, 1), 1, "float32")
    b = cudnn_specs.ConvSpec.from_shapes([2, 3, 8, 8], np.array([4, 3, 3, 3]), (2, 4, 8, 8), [1, 1], (1, 1), (1, 1), 1,
                                    np.float32)
    c = cudnn_specs.ConvSpec.from_shapes((2, 3, 8, 8), (4, 3, 3, 3), (2, 4, 4, 4), (2, 2), (1, 1), (1, 1), 1, "float32")
    assert a.key("fprop", f) == b.key("fprop", f) and hash(a.key("fprop", f)) == hash(b.key("fprop", f))
    assert a.key("fprop", f) != a.key("dgrad", f) != a.key("wgrad", f)
    assert a.key("fprop", f) != c.key("fprop", f)
    assert a.key("fprop", f) != a.key("fprop", cudnn_specs.EngineFilters(allow_tf32=True))
    bn = cudnn_specs.BNSpec.from_shape((2, 3, 4, 4), np.float32)
    assert bn.key("bn_train", f) != bn.key("bn_infer", f)
    assert len({a.key("fprop", f), b.key("fprop", f), c.key("fprop", f), bn.key("bn_train", f)}) == 3
    with pytest.raises(ValueError):
        bn.key("bn_eval", f)


def test_bn_and_pointwise_descs():
    bn = cudnn_specs.BNSpec.from_shape((4, 6, 5, 3), np.float32)
    assert (bn.channels, bn.count) == (6, 60)
    d = bn.descs("bn_train")
    assert set(d) == {"x", "y", "scale", "bias", "running_mean", "running_var", "next_running_mean",
                      "next_running_var", "mean", "invstd", "epsilon", "momentum"}
    assert d["x"].dim == d["y"].dim == (4, 6, 5, 3) and d["x"].stride == (90, 15, 3, 1)
    for k in ("scale", "bias", "running_mean", "running_var", "mean", "invstd"):
        assert (d[k].dim, d[k].stride, d[k].by_value) == ((1, 6, 1, 1), (6, 1, 1, 1), False)
    for k in ("epsilon", "momentum"):
        assert (d[k].dim, d[k].stride, d[k].by_value) == ((1, 1, 1, 1), (1, 1, 1, 1), True)
        assert d[k].kwargs()["is_pass_by_value"] is True
    assert set(bn.descs("bn_infer")) == {"x", "y", "mean", "invstd", "scale", "bias"}
    assert set(bn.descs("bn_backward")) == {"x", "dy", "dx", "scale", "mean", "invstd", "dscale", "dbias"}
    assert cudnn_specs.PointwiseSpec.from_shape((8, 10), np.float32).dims4() == (8, 10, 1, 1)
    assert cudnn_specs.PointwiseSpec.from_shape((2, 3, 4, 5, 6), np.float32).dims4() == (2, 3, 4, 30)
    assert cudnn_specs.PointwiseSpec.from_shape((7,), np.float32).descs("relu_fwd")["x"].stride == (1, 1, 1, 1)
    with pytest.raises(TypeError, match="no cuDNN data type"):
        cudnn_specs.cudnn_dtype_name(np.complex64)
    assert cudnn_specs.cudnn_dtype_name(np.float16) == "HALF"


def test_engine_filters():
    assert cudnn_specs.EngineFilters().numeric_notes() == ("TENSOR_CORE", "DOWN_CONVERT_INPUTS", "NONDETERMINISTIC")
    assert cudnn_specs.EngineFilters(allow_tf32=True, deterministic=False).numeric_notes() == ()


# ---------------------------------------------------------------------------------------------------------
# Execution plans as workspace options
# ---------------------------------------------------------------------------------------------------------

def test_algo_names_round_trip():
    assert cudnn_specs.parse_conv_algo("fwd", cudnn_specs.fwd_algo(3)) == (3,)
    assert cudnn_specs.parse_conv_algo("bwd", cudnn_specs.bwd_algo(2, 11)) == (2, 11)
    for phase, bad in (("fwd", "im2col"), ("fwd", "cudnn:d1w2"), ("bwd", "cudnn:f1"), ("bwd", None)):
        with pytest.raises(ValueError, match="not a CUDA convolution algorithm"):
            cudnn_specs.parse_conv_algo(phase, bad)
    with pytest.raises(ValueError, match="phase"):
        cudnn_specs.parse_conv_algo("both", "cudnn:f1")


def _plans(ws, start=0):
    return [cudnn_specs.PlanInfo(start + i, f"eng{start + i}", w) for i, w in enumerate(ws)]


def test_conv_options_fwd_pareto():
    opts = cudnn_specs.conv_options("fwd", {"fprop": _plans([1000, 0, 500, 0, 2000])})
    assert [(o.algo, o.workspace_bytes) for o in opts] == [("cudnn:f0", 1000), ("cudnn:f1", 0)]
    assert all(isinstance(o, WorkspaceOption) for o in opts)
    assert opts[0].est_cost < opts[1].est_cost
    assert [o.algo for o in cudnn_specs.conv_options("fwd", {"fprop": _plans([0, 10])})] == ["cudnn:f0"]
    with pytest.raises(ValueError):
        cudnn_specs.conv_options("fwd", {"fprop": []})


def test_conv_options_bwd_pairs():
    opts = cudnn_specs.conv_options("bwd", {"dgrad": _plans([300, 0]), "wgrad": _plans([100, 50], start=4)})
    assert [(o.algo, o.workspace_bytes) for o in opts] == [("cudnn:d0w4", 300), ("cudnn:d1w4", 100),
                                                           ("cudnn:d1w5", 50)]


@pytest.mark.parametrize("seed", range(25))
def test_conv_options_choose_like_brute_force(seed):
    """Taking the first option that fits (the planner's rule) is the cheapest plan pair that fits."""
    rng = np.random.default_rng(seed)
    dg = _plans(rng.choice([0, 64, 512, 4096, 1 << 20], size=rng.integers(1, 6)).tolist())
    wg = _plans(rng.choice([0, 64, 512, 4096, 1 << 20], size=rng.integers(1, 6)).tolist(), start=10)
    opts = cudnn_specs.conv_options("bwd", {"dgrad": dg, "wgrad": wg})
    assert [o.est_cost for o in opts] == sorted(o.est_cost for o in opts)
    assert [o.workspace_bytes for o in opts] == sorted((o.workspace_bytes for o in opts), reverse=True)
    for limit in (0, 63, 64, 600, 5000, 1 << 20, 1 << 30):
        fits = [(cudnn_specs.plan_cost(a) + cudnn_specs.plan_cost(b), max(d.workspace_bytes, w.workspace_bytes))
                for (a, d), (b, w) in itertools.product(enumerate(dg), enumerate(wg))
                if max(d.workspace_bytes, w.workspace_bytes) <= limit]
        chosen = next((o for o in opts if o.workspace_bytes <= limit), None)
        if not fits:
            assert chosen is None
        else:
            assert chosen is not None and chosen.est_cost == pytest.approx(min(c for c, _ in fits))


def test_pick_plan():
    plans = _plans([4096, 512, 0])
    assert cudnn_specs.pick_plan(plans, 1 << 20).index == 0
    assert cudnn_specs.pick_plan(plans, 600).index == 1
    assert cudnn_specs.pick_plan(plans, 0).index == 2
    with pytest.raises(ValueError, match="no cuDNN plan fits"):
        cudnn_specs.pick_plan(_plans([10]), 0)


# ---------------------------------------------------------------------------------------------------------
# Kernel launches
# ---------------------------------------------------------------------------------------------------------

def _f(*shape):
    return np.zeros(shape, np.float32)


def _labels(n, k=5):
    return np.arange(n, dtype=np.int64) % k


LIMITS = launches.DeviceLimits(1024, 80)

# kernel -> (launcher arguments, the expected full argument list, the expected launch_config work)
x4, y4 = _f(2, 3, 9, 8), _f(2, 3, 4, 4)
_cat_out, _cat_part = _f(2, 7, 3, 3), _f(2, 2, 3, 3)
_logits, _lab, _rows = _f(6, 5), _labels(6), _f(6)
_p = _f(10)
LAUNCH_CASES = {
    "relu_forward": ((_f(2, 5), _f(2, 5)), lambda a: (a[0], a[1], 10), 10),
    "relu_backward": ((_f(7), _f(7), _f(7)), lambda a: (*a, 7), 7),
    "add_forward": ((_f(3, 2), _f(3, 2), _f(3, 2)), lambda a: (*a, 6), 6),
    "add_many": ((_f(3, 2), _f(3, 2), _f(6), _f(2, 3)), lambda a: (*a, *(a[1],) * 5, 3, 6), 6),
    "accumulate": ((_f(4), _f(4)), lambda a: (*a, 4), 4),
    "scale_copy": ((_f(4), _f(4), 0.5), lambda a: (a[0], a[1], 4, 0.5), 4),
    "dropout_forward": ((_f(9), _f(9), 0.25, -1), lambda a: (a[0], a[1], 9, 2**64 - 1, 1 << 22, 4.0 / 3.0), 9),
    "dropout_backward": ((_f(9), _f(9), 0.5, 7), lambda a: (a[0], a[1], 9, 7, 1 << 23, 2.0), 9),
    "dropout_forward_dev": ((_f(9), _f(9), 0.25, np.zeros(1, np.uint64)),
                            lambda a: (a[0], a[1], 9, a[3], 1 << 22, 4.0 / 3.0), 9),
    "dropout_backward_dev": ((_f(9), _f(9), 0.5, np.zeros(1, np.uint64)),
                             lambda a: (a[0], a[1], 9, a[3], 1 << 23, 2.0), 9),
    "sgd_update_dev": ((_p, _f(10), _f(10), np.zeros(1), 0.9, 0.0, 1e-4, True, False, np.zeros(1, np.int32)),
                       lambda a: (*a[:3], 10, a[3], 0.9, 0.0, 1e-4, 1, 0, a[9]), 10),
    "adam_update_dev": ((_p, _f(10), _f(10), _f(10), np.zeros(2), 0.9, 0.999, 1e-8, 0.0, np.zeros(1, np.int32)),
                        lambda a: (*a[:4], 10, a[4], 0.9, 0.999, 1e-8, 0.0, a[9]), 10),
    "nonfinite_flag": ((np.zeros(1, np.int32), _f(3, 4), 7), lambda a: (a[0], a[1], 12, 7), 12),
    "concat_copy_forward": ((_cat_out, _cat_part, 3), lambda a: (a[0], a[1], 2, 2, 9, 7, 3), 36),
    "concat_copy_backward": ((_cat_part, _cat_out, 5), lambda a: (a[0], a[1], 2, 2, 9, 7, 5), 36),
    "lrn_forward": ((_f(2, 6, 3, 1), _f(2, 6, 3, 1), 5, 1e-4, 0.75, 2.0),
                    lambda a: (a[0], a[1], 2, 6, 3, 5, 1e-4, 0.75, 2.0), 36),
    "lrn_backward": ((_f(2, 6, 3), _f(2, 6, 3), _f(2, 6, 3), _f(2, 6, 3), 3, 1e-3, 0.5, 1.0),
                     lambda a: (*a[:4], 2, 6, 3, 3, 1e-3, 0.5, 1.0), 36),
    "softmax_xent_forward": ((_rows, _logits, _lab), lambda a: (*a, 6, 5), (6, 5)),
    "softmax_xent_mean": ((np.zeros((), np.float32), _rows, 6), lambda a: a, 6),
    "softmax_xent_backward": ((_f(6, 5), _logits, _lab, 0.25), lambda a: (*a[:3], 6, 5, 0.25), (6, 5)),
    "sgd_update": ((_p, _f(10), _f(10), 0.1, 0.9, 0.0, 1e-4, True, False),
                   lambda a: (*a[:3], 10, 0.1, 0.9, 0.0, 1e-4, 1, 0), 10),
    "adam_update": ((_p, _f(10), _f(10), _f(10), 1e-3, 0.9, 0.999, 1e-8, 0.0, 3),
                    lambda a: (*a[:4], 10, 1e-3, 0.9, 0.999, 1e-8, 0.0, 3), 10),
    "maxpool2d_forward": ((y4, x4, (3, 2), (2, 2), (1, 0), (1, 2)),
                          lambda a: (a[0], a[1], 2, 3, 9, 8, 4, 4, 3, 2, 2, 2, 1, 0, 1, 2), y4.size),
    "maxpool2d_backward": ((_f(2, 3, 9, 8), y4, x4, (3, 3), (2, 2), (1, 1), (1, 1)),
                           lambda a: (*a[:3], 2, 3, 9, 8, 4, 4, 3, 3, 2, 2, 1, 1, 1, 1), y4.size),
    "avgpool2d_forward": ((y4, x4, (2, 2), (2, 2), (0, 0), False),
                          lambda a: (a[0], a[1], 2, 3, 9, 8, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0), y4.size),
    "avgpool2d_backward": ((_f(2, 3, 9, 8), y4, (3, 3), (2, 2), (1, 1), True),
                           lambda a: (a[0], a[1], 2, 3, 9, 8, 4, 4, 3, 3, 2, 2, 1, 1, 1, 0), x4.size),
    "global_avgpool_forward": ((_f(2, 3), x4), lambda a: (a[0], a[1], 6, 72), (6, 72)),
    "global_avgpool_backward": ((_f(2, 3, 9, 8), _f(2, 3)), lambda a: (a[0], a[1], 6, 72), x4.size),
    "sz_quantize": ((np.zeros(700, np.int64), np.zeros(700, np.uint8), _f(700), 1e-3),
                    lambda a: (*a[:3], 700, 1e-3), 700),
    "sz_encode_blocks": ((np.zeros(3 * 64 * 8, np.uint32), np.zeros(3, np.uint8), np.zeros(3, np.int64),
                          np.zeros(700, np.int64)), lambda a: (*a, 700, 3), (3, 256)),
    "sz_gather_planes": ((np.zeros(100, np.uint32), np.zeros(3 * 64 * 8, np.uint32), np.zeros(3, np.uint8),
                          np.zeros(3, np.int64)), lambda a: (*a, 3), 3 * 64 * 8),
    "sz_decode_blocks": ((_f(700), np.zeros(100, np.uint32), np.zeros(3, np.uint8), np.zeros(3, np.int64),
                          np.zeros(3, np.int64), 0.5), lambda a: (*a[:5], 700, 3, 0.5), (3, 256)),
    "sz_scatter_outliers": ((_f(700), np.zeros(4, np.int64), _f(4)), lambda a: (*a, 4), 4),
    "softmax_xent_ignore_forward": ((_rows, _logits, _lab, -100), lambda a: (*a[:3], 6, 5, -100), (6, 5)),
    "softmax_xent_ignore_mean": ((np.zeros((), np.float32), _rows, _lab, 3), lambda a: (*a[:3], 6, 3), 6),
    "softmax_xent_ignore_scale": ((_f(1), np.ones((), np.float32), _lab, 3), lambda a: (*a[:3], 6, 3), 6),
    "softmax_xent_ignore_backward": ((_f(6, 5), _logits, _lab, _f(1), 2),
                                     lambda a: (*a[:4], 6, 5, 2), (6, 5)),
    "layernorm_forward": ((_f(4, 3, 8), _f(12), _f(12), _f(4, 3, 8), _f(8), None, 1e-5),
                          lambda a: (*a[:6], 12, 8, 1e-5), (12, 8)),
    "layernorm_forward_apply": ((_f(12, 8), _f(12, 8), None, _f(8), _f(12), _f(12)),
                                lambda a: (*a, 12, 8), 96),
    "layernorm_backward_dx": ((_f(12, 8), _f(12, 8), _f(8), _f(12, 8), _f(12), _f(12)),
                              lambda a: (*a, 12, 8), (12, 8)),
    "layernorm_backward_partials": ((np.zeros((1, 8)), np.zeros((1, 8)), _f(12, 8), _f(12, 8), _f(12), _f(12)),
                                    lambda a: (*a, 12, 8, 32), 8),
    "layernorm_backward_params": ((_f(8), None, np.zeros((3, 8)), np.zeros((3, 8)), 96),
                                  lambda a: (*a[:4], 3, 8), 8),
    "gelu_forward": ((_f(3, 7), _f(3, 7), "tanh"), lambda a: (a[0], a[1], 21, 0), 21),
    "gelu_backward": ((_f(3, 7), _f(3, 7), _f(3, 7), "none"), lambda a: (*a[:3], 21, 1), 21),
    "softmax_forward": ((_f(2, 3, 5, 5), _f(2, 3, 5, 5), 0.5, 5), lambda a: (a[0], a[1], 30, 5, 0.5, 5), (30, 5)),
    "softmax_backward": ((_f(6, 5), _f(6, 5), _f(6, 5), 0.25), lambda a: (*a[:3], 6, 5, 0.25), (6, 5)),
    "embedding_forward": ((_f(6, 4), _f(10, 4), _labels(6, 10)), lambda a: (*a, 6, 4, 10), 24),
    "embedding_backward": ((_f(10, 4), _f(2, 3, 4), _labels(6, 10)), lambda a: (*a, 6, 4, 10, 10), 40),
    "position_embedding_forward": ((_f(2, 3, 4), _f(2, 3, 4), _f(5, 4)), lambda a: (*a, 2, 12), 24),
    "position_embedding_backward": ((_f(5, 4), _f(2, 3, 4)), lambda a: (*a, 2, 12), 12),
}


def test_every_kernel_has_a_launcher_and_a_case():
    """A launcher per kernel and its forms (the half forms' cases: tests/backend/test_cuda_half_kernels.py)."""
    assert set(launches.LAUNCHERS) == {s.base for s in ks.KERNELS.values()}
    assert set(LAUNCH_CASES) == {name for name, s in ks.KERNELS.items() if not s.half}


@pytest.mark.parametrize("name", sorted(LAUNCH_CASES))
def test_launch_packing(name):
    args, expected, work = LAUNCH_CASES[name]
    launch = launches.LAUNCHERS[name](*args, limits=LIMITS)
    spec = ks.KERNELS[name]
    assert launch.name == name and len(launch.args) == spec.nargs
    assert (launch.grid, launch.block) == ks.launch_config(name, work, LIMITS.max_threads_per_block,
                                                           LIMITS.sm_count)
    for a, got, want in zip(spec.args, launch.args, expected(args)):
        if a.is_pointer:
            assert got is want, f"{name}: pointer {a.name} is not the array passed"
        else:
            assert type(got) is ks.scalar_type(a.ctype), f"{name}: {a.name} is {type(got)}, not {a.ctype}"
            if isinstance(want, float):
                assert float(got) == pytest.approx(want, rel=1e-7), a.name
            else:
                assert int(got) == want, a.name


def test_launch_rejects_bad_arguments():
    with pytest.raises(TypeError, match="must be an array"):
        launches.pack_launch("relu_forward", (_f(4), 1.5, 4), 4)            # a number where a pointer goes
    with pytest.raises(TypeError, match="is None"):
        launches.pack_launch("relu_forward", (_f(4), None, 4), 4)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        launches.pack_launch("relu_forward", (_f(4), _f(4)), 4)
    with pytest.raises(ValueError, match="elements"):
        launches.relu_forward(_f(4), _f(5))
    with pytest.raises(ValueError, match="do not fit"):
        launches.concat_copy_forward(_f(2, 4, 3), _f(2, 3, 3), 2)
    with pytest.raises(ValueError, match="need 3 blocks"):
        launches.sz_encode_blocks(np.zeros(2 * 512, np.uint32), np.zeros(2, np.uint8), np.zeros(2, np.int64),
                                np.zeros(700, np.int64))
    with pytest.raises(ValueError, match="outside axis 1"):
        launches.concat_copy_forward(_f(2, 4, 3), _f(2, 3, 4), 0)
    with pytest.raises(ValueError, match="momentum buffer"):
        launches.sgd_update(_f(3), _f(3), None, 0.1, 0.9, 0, 0, False, True)
    with pytest.raises(ValueError, match="1-based"):
        launches.adam_update(_f(3), _f(3), _f(3), _f(3), 1e-3, 0.9, 0.999, 1e-8, 0, 0)
    with pytest.raises(ValueError, match="labels"):
        launches.softmax_xent_forward(_f(6), _f(6, 5), _labels(5))
    with pytest.raises(ValueError, match="float64 partial sums"):
        launches.layernorm_backward_partials(_f(1, 8), _f(1, 8), _f(12, 8), _f(12, 8), _f(12), _f(12))
    with pytest.raises(ValueError, match="needs rows of 4, got 5"):
        launches.softmax_forward(_f(4, 5), _f(4, 5), 1.0, 4)
    with pytest.raises(ValueError, match="w holds"):
        launches.layernorm_forward(_f(2, 3), _f(2), _f(2), _f(2, 3), _f(4), None, 1e-5)
    with pytest.raises(ValueError, match="same N and C"):
        launches.maxpool2d_forward(_f(2, 4, 4, 4), _f(2, 3, 9, 9), 2, 2, 0, 1)


def test_sgd_without_momentum_passes_null():
    launch = launches.sgd_update(_f(3), _f(3), _f(3), 0.1, 0.0, 0.0, 0.0, False, True)
    assert launch.args[2] is None                               # cupy passes None as a NULL pointer
    assert ("sgd_update", "momentum_buf") in launches.NULLABLE_POINTERS
    flag = np.zeros(1, np.int32)
    assert launches.sgd_update_dev(_f(3), _f(3), _f(3), np.zeros(1), 0.0, 0.0, 0.0, False, False, flag).args[2] is None
    with pytest.raises(ValueError, match="float64"):
        launches.adam_update_dev(_f(3), _f(3), _f(3), _f(3), np.zeros(2, np.float32), 0.9, 0.999, 1e-8, 0.0, flag)
    with pytest.raises(ValueError, match="one int32"):
        launches.nonfinite_flag(np.zeros(1, np.int64), _f(3), 1)
    with pytest.raises(ValueError, match="code 0"):
        launches.nonfinite_flag(flag, _f(3), 0)
    with pytest.raises(ValueError, match="uint64"):
        launches.dropout_forward_dev(_f(3), _f(3), 0.5, np.zeros(2, np.uint64))
    assert launches.ZERO_OUTPUT_FIRST == {"maxpool2d_backward", "embedding_backward", "embedding_backward_bf16",
                                          "embedding_backward_f16"}


# ---------------------------------------------------------------------------------------------------------
# The cuDNN frontend adapter against a recording fake of `import cudnn`
# ---------------------------------------------------------------------------------------------------------

#: Keyword names of the real `cudnn.pygraph` methods, (required, optional), as bound in NVIDIA/cudnn-frontend
#: (python/pygraph/pygraph.cpp for the convolutions and the constructor, python/pygraph/norm.cpp for batch norm,
#: python/pygraph/pointwise.cpp for ReLU, python/cudnn/__init__.py for tensor()); the 1.3x pure-Python pygraph keeps
#: the same names. The fake refuses any other keyword, so a misspelt port fails here rather than on a GPU.
_CONV_OPTIONAL = {"padding", "pre_padding", "post_padding", "stride", "dilation", "convolution_mode",
                  "compute_data_type", "name"}
_RELU_OPTIONAL = {"negative_slope", "lower_clip", "upper_clip", "compute_data_type", "name"}
FE_SIGNATURES = {
    "pygraph": (set(), {"name", "io_data_type", "intermediate_data_type", "compute_data_type", "handle", "sm_count",
                        "sm_version", "kernel_cache", "device_property", "is_dynamic_shape_enabled",
                        "is_override_shape_enabled"}),
    "tensor": ({"dim", "stride"}, {"data_type", "is_virtual", "is_pass_by_value", "ragged_offset", "reordering_type",
                                   "name", "uid"}),
    "conv_fprop": ({"image", "weight"}, _CONV_OPTIONAL),
    "conv_dgrad": ({"loss", "filter"}, _CONV_OPTIONAL),
    "conv_wgrad": ({"image", "loss"}, _CONV_OPTIONAL),
    "batchnorm": ({"input", "scale", "bias", "in_running_mean", "in_running_var", "epsilon", "momentum"},
                  {"peer_stats", "compute_data_type", "name"}),
    "batchnorm_inference": ({"input", "mean", "inv_variance", "scale", "bias"}, {"compute_data_type", "name"}),
    "batchnorm_backward": ({"grad", "input", "scale", "mean", "inv_variance"},
                           {"peer_stats", "compute_data_type", "name"}),
    "relu": ({"input"}, _RELU_OPTIONAL),
    "relu_backward": ({"loss", "input"}, _RELU_OPTIONAL),
    "add": ({"a", "b"}, {"compute_data_type", "name"}),   # python/pygraph/pointwise.cpp
    # the arguments of the 1.32 bindings' docstrings (`strings` of _compiled_module*.so), in their order
    "sdpa": ({"q", "k", "v"}, {
        "attn_scale", "bias", "use_alibi_mask", "use_padding_mask", "seq_len_q", "seq_len_kv", "dropout", "rng_dump",
        "paged_attention_k_table", "paged_attention_v_table", "paged_attention_max_seq_len_kv", "max_total_seq_len_q",
        "max_total_seq_len_kv", "compute_data_type", "name", "generate_stats", "implementation", "score_max",
        "score_sum_exp", "sink_token", "unfuse_fma", "cu_seq_len_q", "cu_seq_len_kv", "stats_use_log2",
        "diagonal_alignment", "diagonal_band_left_bound", "diagonal_band_right_bound", "sliding_window_length",
        "use_causal_mask", "use_causal_mask_bottom_right", "is_inference"}),
    "sdpa_backward": ({"q", "k", "v", "o", "dO", "stats"}, {
        "attn_scale", "bias", "dBias", "use_alibi_mask", "use_padding_mask", "seq_len_q", "seq_len_kv",
        "max_total_seq_len_q", "max_total_seq_len_kv", "dropout", "rng_dump", "use_deterministic_algorithm",
        "compute_data_type", "name", "score_mod", "score_mod_bprop", "sink_token", "dSink_token",
        "diagonal_alignment", "diagonal_band_left_bround",   # sic: the docstring's spelling
        "diagonal_band_right_bound", "sliding_window_length", "use_causal_mask", "use_causal_mask_bottom_right"}),
}

#: What each op returns, in the real order (norm.cpp: batchnorm -> {Y, mean, inv_var, next_running_mean,
#: next_running_var}, batchnorm_backward -> {DX, DScale, DBias}).
FE_OUTPUTS = {"conv_fprop": ("Y",), "conv_dgrad": ("DX",), "conv_wgrad": ("DW",),
              "batchnorm": ("Y", "mean", "inv_var", "next_running_mean", "next_running_var"),
              "batchnorm_inference": ("Y",), "batchnorm_backward": ("DX", "DScale", "DBias"), "relu": ("Y",),
              "relu_backward": ("Y",), "add": ("OUT_0",), "sdpa": ("O", "Stats"), "sdpa_backward": ("dQ", "dK", "dV")}


def _check_fe_call(op, kw):
    required, optional = FE_SIGNATURES[op]
    unknown = sorted(set(kw) - required - optional)
    missing = sorted(required - set(kw))
    if unknown or missing:
        raise TypeError(f"cudnn pygraph.{op}(): unexpected keyword(s) {unknown}, missing {missing}")
    if "padding" in kw and ({"pre_padding", "post_padding"} & set(kw)):
        raise TypeError(f"{op}(): `padding` and `pre_padding`/`post_padding` belong to different overloads")


def test_fake_cudnn_refuses_calls_the_real_bindings_refuse():
    g = FakeCudnn().pygraph(handle=1)
    x = g.tensor(name="x", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1])
    with pytest.raises(TypeError, match="unexpected"):
        g.conv_dgrad(dy=x, filter=x)
    with pytest.raises(TypeError, match="unexpected"):
        g.batchnorm_backward(grad=x, input=x, scale=x, mean=x, inv_var=x)
    with pytest.raises(TypeError, match="missing"):
        g.batchnorm(input=x, scale=x, bias=x, epsilon=x, momentum=x, in_running_mean=x)
    with pytest.raises(TypeError, match="unexpected"):
        g.tensor(name="y", dim=[1], stride=[1], pass_by_value=True)
    with pytest.raises(TypeError):
        g.create_execution_plans(modes=["heur_mode.A"])       # the binding takes it positionally only
    with pytest.raises(TypeError, match="unexpected"):
        FakeCudnn().pygraph(io_type="data_type.FLOAT")


class _Enum:
    def __init__(self, kind):
        self._kind = kind

    def __getattr__(self, member):
        if member.startswith("_"):
            raise AttributeError(member)
        return f"{self._kind}.{member}"


class FakeTensor:
    _uids = itertools.count(1)

    def __init__(self, origin, **kw):
        self.origin, self.kw, self.uid = origin, kw, next(FakeTensor._uids)
        self.output, self.dim, self.stride, self.data_type = False, None, None, kw.get("data_type")

    def set_output(self, v):
        self.output = v
        return self

    def set_dim(self, d):
        self.dim = d
        return self

    def set_stride(self, s):
        self.stride = s
        return self

    def set_data_type(self, t):
        self.data_type = t
        return self

    def get_uid(self):
        return self.uid


class FakeGraph:
    def __init__(self, fake, **kw):
        self.fake, self.kw, self.calls, self.built = fake, kw, [], set()
        self.deselected = []

    def _op(self, op, **kw):
        _check_fe_call(op, kw)
        self.calls.append((op, kw))
        outs = [FakeTensor(f"{op}::{port}") for port in FE_OUTPUTS[op]]   # origin names the real output port
        return outs[0] if len(outs) == 1 else outs

    def tensor(self, **kw):
        _check_fe_call("tensor", kw)
        self.calls.append(("tensor", kw))
        return FakeTensor("tensor", **kw)

    conv_fprop = lambda self, **kw: self._op("conv_fprop", **kw)            # noqa: E731
    conv_dgrad = lambda self, **kw: self._op("conv_dgrad", **kw)            # noqa: E731
    conv_wgrad = lambda self, **kw: self._op("conv_wgrad", **kw)            # noqa: E731
    batchnorm = lambda self, **kw: self._op("batchnorm", **kw)              # noqa: E731
    batchnorm_inference = lambda self, **kw: self._op("batchnorm_inference", **kw)  # noqa: E731
    batchnorm_backward = lambda self, **kw: self._op("batchnorm_backward", **kw)    # noqa: E731
    relu = lambda self, **kw: self._op("relu", **kw)                        # noqa: E731
    relu_backward = lambda self, **kw: self._op("relu_backward", **kw)      # noqa: E731
    add = lambda self, **kw: self._op("add", **kw)                          # noqa: E731
    sdpa_backward = lambda self, **kw: self._op("sdpa_backward", **kw)      # noqa: E731

    def sdpa(self, **kw):
        o, stats = self._op("sdpa", **kw)
        return [o, stats if kw.get("generate_stats") else None]   # a list, Stats None unless asked for (_pygraph.py)

    def validate(self):
        self.calls.append(("validate", {}))
        if self.fake.refuse_at_validate(self):
            raise FakeCudnn.cudnnGraphNotSupportedError("head dim not supported")

    def build_operation_graph(self):
        self.calls.append(("build_operation_graph", {}))

    def create_execution_plans(self, modes, /):   # bound without py::arg: positional only
        self.calls.append(("create_execution_plans", {"modes": modes}))

    def deselect_numeric_notes(self, notes, /):
        self.calls.append(("deselect_numeric_notes", {"notes": notes}))
        self.deselected = list(notes)

    def check_support(self):
        self.calls.append(("check_support", {}))
        if self.fake.unsupported(self):
            raise RuntimeError("cudnnGraphNotSupportedError: no engine")

    def _table(self):
        return self.fake.plan_table(self)

    def get_execution_plan_count(self):
        return len(self._table())

    def build_plan_at_index(self, index):
        ws, name, ok = self._table()[index]
        if not ok:
            raise RuntimeError("cannot build")
        self.built.add(index)

    def get_workspace_size_plan_at_index(self, index):
        return self._table()[index][0] if index in self.built else 0   # like the frontend: unbuilt reads 0

    def get_plan_name_at_index(self, index):
        return self._table()[index][1]

    def execute_plan_at_index(self, tensor_dict, workspace, index, handle=None):
        # python/cudnn/__init__.py: each buffer is an int pointer, a torch tensor or a DLPack producer; the backend
        # passes int pointers only (device addresses, host addresses for pass-by-value scalars).
        assert all(type(p) is int for p in tensor_dict.values()) and type(workspace) is int
        self.fake.executions.append(SimpleNamespace(graph=self, pack=tensor_dict, workspace=workspace, index=index,
                                                    handle=handle))


class FakeCudnn:
    """Enough of `import cudnn` for CudnnGraphs: enums, pygraph, and configurable plan tables/support."""

    data_type = _Enum("data_type")
    heur_mode = _Enum("heur_mode")
    numerical_note = _Enum("numerical_note")
    diagonal_alignment = _Enum("diagonal_alignment")

    class cudnnGraphNotSupportedError(RuntimeError):   # the frontend's name
        pass

    def __init__(self, plans=None, unsupported=lambda g: False, refuse_at_validate=lambda g: False):
        self.graphs: list[FakeGraph] = []
        self.executions = []
        self._plans = plans or (lambda g: [(0, "engA", True)])
        self.unsupported = unsupported
        self.refuse_at_validate = refuse_at_validate

    def plan_table(self, g):
        return self._plans(g)

    def pygraph(self, **kw):
        _check_fe_call("pygraph", kw)
        g = FakeGraph(self, **kw)
        self.graphs.append(g)
        return g


def _op_of(g):
    return next(op for op, _ in g.calls if op not in ("tensor",))


def refuses_sdpa(g):
    """A fake cuDNN's answer for a graph: no engine for attention (its kernels run instead)."""
    return _op_of(g) in ("sdpa", "sdpa_backward")


def _conv_key(op, filters=None):
    filters = cudnn_specs.EngineFilters() if filters is None else filters
    spec = cudnn_specs.ConvSpec.from_shapes((2, 4, 9, 7), (6, 2, 3, 2), (2, 6, 5, 7), (2, 1), (1, 1), (1, 2), 2,
                                       np.float32)
    return spec, spec.key(op, filters)


@pytest.mark.parametrize("op,fe_op,in_kw,out_name", [
    ("fprop", "conv_fprop", {"image": "x", "weight": "w"}, "y"),
    ("dgrad", "conv_dgrad", {"loss": "y", "filter": "w"}, "x"),
    ("wgrad", "conv_wgrad", {"image": "x", "loss": "y"}, "w"),
])
def test_adapter_builds_conv_graphs(op, fe_op, in_kw, out_name):
    fake = FakeCudnn()
    graphs = CudnnGraphs(fake, handle=1234)
    spec, key = _conv_key(op)
    built = graphs.get(key)
    g = fake.graphs[0]
    assert g.kw == {"io_data_type": "data_type.FLOAT", "intermediate_data_type": "data_type.FLOAT",
                    "compute_data_type": "data_type.FLOAT", "handle": 1234}
    d = spec.descs()
    tensors = [kw for op_, kw in g.calls if op_ == "tensor"]
    assert sorted(t["name"] for t in tensors) == sorted(in_kw.values())
    for t in tensors:
        assert t["dim"] == list(d[t["name"]].dim) and t["stride"] == list(d[t["name"]].stride)
        assert t["data_type"] == "data_type.FLOAT"
    (conv_kw,) = [kw for op_, kw in g.calls if op_ == fe_op]
    assert conv_kw["padding"] == [1, 1] and conv_kw["stride"] == [2, 1] and conv_kw["dilation"] == [1, 2]
    for arg, name in in_kw.items():
        assert conv_kw[arg] is built.tensors[name]
    out = built.tensors[out_name]
    assert out.output is True and out.dim == list(d[out_name].dim) and out.stride == list(d[out_name].stride)
    assert out.data_type == "data_type.FLOAT"
    assert set(built.tensors) == {"x", "w", "y"}


def test_adapter_finalize_sequence_and_plans():
    table = [(4096, "engA", True), (0, "engB", False), (512, "engC", True), (4096, "engA", True),
             (0, "engD", True), (64, "engE", True)]
    fake = FakeCudnn(plans=lambda g: table)
    graphs = CudnnGraphs(fake, handle=1, max_plans=3)
    built = graphs.get(_conv_key("fprop")[1])
    g = fake.graphs[0]
    steps = [op for op, _ in g.calls if op not in ("tensor", "conv_fprop")]
    assert steps == ["validate", "build_operation_graph", "create_execution_plans", "deselect_numeric_notes",
                     "check_support"]
    assert dict(g.calls)["create_execution_plans"]["modes"] == ["heur_mode.A", "heur_mode.FALLBACK"]
    assert g.deselected == ["numerical_note.TENSOR_CORE", "numerical_note.DOWN_CONVERT_INPUTS",
                            "numerical_note.NONDETERMINISTIC"]
    # unbuildable plan 1 skipped, duplicate engA (3) dropped, at most 3 plans, workspace read after building
    assert built.plans == [cudnn_specs.PlanInfo(0, "engA", 4096), cudnn_specs.PlanInfo(2, "engC", 512),
                           cudnn_specs.PlanInfo(4, "engD", 0)]
    assert built.relaxed == ()
    assert graphs.get(_conv_key("fprop")[1]) is built and len(fake.graphs) == 1 and len(graphs) == 1
    assert built.plan(2).workspace_bytes == 512
    with pytest.raises(ValueError, match="no built execution plan 1"):
        built.plan(1)


def test_adapter_relaxes_filters_then_gives_up():
    fake = FakeCudnn(unsupported=lambda g: bool(g.deselected))
    built = CudnnGraphs(fake, handle=1).get(_conv_key("wgrad")[1])
    assert len(fake.graphs) == 2 and built.relaxed == ("TENSOR_CORE", "DOWN_CONVERT_INPUTS", "NONDETERMINISTIC")
    assert not any(op == "deselect_numeric_notes" for op, _ in fake.graphs[1].calls)
    never = FakeCudnn(unsupported=lambda g: True)
    with pytest.raises(GraphUnsupported, match="cannot run conv_dgrad"):
        CudnnGraphs(never, handle=1).get(_conv_key("dgrad")[1])
    none_build = FakeCudnn(plans=lambda g: [(0, "x", False)])
    with pytest.raises(GraphUnsupported, match="no execution plan could be built"):
        CudnnGraphs(none_build, handle=1).get(_conv_key("fprop", cudnn_specs.EngineFilters(True, False))[1])


def test_adapter_execute_binds_pointers_by_tensor():
    fake = FakeCudnn(plans=lambda g: [(0, "a", True), (256, "b", True)])
    graphs = CudnnGraphs(fake, handle=99)
    built = graphs.get(_conv_key("fprop")[1])
    graphs.execute(built, {"x": 0x1000, "w": 0x2000, "y": 0x3000}, 0x4000, 1)
    (ex,) = fake.executions
    assert ex.pack == {built.tensors["x"]: 0x1000, built.tensors["w"]: 0x2000, built.tensors["y"]: 0x3000}
    assert (ex.workspace, ex.index, ex.handle) == (0x4000, 1, 99)
    with pytest.raises(ValueError, match="missing"):
        graphs.execute(built, {"x": 1, "w": 2}, 0, 0)


def test_adapter_builds_bn_and_relu_graphs():
    fake = FakeCudnn()
    graphs = CudnnGraphs(fake, handle=1)
    f = cudnn_specs.EngineFilters()
    bn = cudnn_specs.BNSpec.from_shape((4, 6, 5, 3), np.float32)
    built = graphs.get(bn.key("bn_train", f))
    (kw,) = [kw for op, kw in fake.graphs[-1].calls if op == "batchnorm"]
    t = built.tensors
    assert {k: kw[k] for k in ("input", "scale", "bias", "in_running_mean", "in_running_var", "epsilon",
                                "momentum")} == {"input": t["x"], "scale": t["scale"], "bias": t["bias"],
                                                 "in_running_mean": t["running_mean"],
                                                 "in_running_var": t["running_var"], "epsilon": t["epsilon"],
                                                 "momentum": t["momentum"]}
    assert t["epsilon"].kw["is_pass_by_value"] is True and t["epsilon"].kw["dim"] == [1, 1, 1, 1]
    for name, port in (("y", "Y"), ("mean", "mean"), ("invstd", "inv_var"), ("next_running_mean", "next_running_mean"),
                       ("next_running_var", "next_running_var")):
        assert t[name].output is True and t[name].origin == f"batchnorm::{port}"   # unpacked in the real order
    assert t["mean"].dim == [1, 6, 1, 1] and t["mean"].stride == [6, 1, 1, 1]
    assert t["y"].dim == [4, 6, 5, 3]
    built = graphs.get(bn.key("bn_backward", f))
    (kw,) = [kw for op, kw in fake.graphs[-1].calls if op == "batchnorm_backward"]
    t = built.tensors
    assert (kw["grad"], kw["input"], kw["scale"], kw["mean"], kw["inv_variance"]) == \
        (t["dy"], t["x"], t["scale"], t["mean"], t["invstd"])
    assert all(t[k].output for k in ("dx", "dscale", "dbias"))
    assert [t[k].origin for k in ("dx", "dscale", "dbias")] == ["batchnorm_backward::DX", "batchnorm_backward::DScale",
                                                                 "batchnorm_backward::DBias"]
    built = graphs.get(bn.key("bn_infer", f))
    (kw,) = [kw for op, kw in fake.graphs[-1].calls if op == "batchnorm_inference"]
    assert kw["inv_variance"] is built.tensors["invstd"] and built.tensors["y"].output
    pw = cudnn_specs.PointwiseSpec.from_shape((8, 10), np.float32)
    built = graphs.get(pw.key("relu_bwd", f))
    (kw,) = [kw for op, kw in fake.graphs[-1].calls if op == "relu_backward"]
    assert kw["loss"] is built.tensors["dy"] and kw["input"] is built.tensors["y"]
    assert built.tensors["dx"].dim == [8, 10, 1, 1]


# ---------------------------------------------------------------------------------------------------------
# Backend dispatch, with host arrays standing in for device arrays
# ---------------------------------------------------------------------------------------------------------

class _NullStream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _HostSide:
    """Side buffers as host arrays, remembered by name."""

    def __init__(self):
        self.bufs = {}

    def get(self, name, shape, dtype):
        shp = (shape,) if isinstance(shape, int) else tuple(shape)
        a = self.bufs.get(name)
        if a is None or a.shape != shp or a.dtype != dtype:
            a = self.bufs[name] = np.zeros(shp, dtype)
        return a

    @property
    def nbytes(self):
        return sum(a.nbytes for a in self.bufs.values())


class HostEmulatedCUDA(CUDABackend):
    """The CUDA backend's dispatch with numpy arrays as 'device' arrays: host addresses as pointers, kernel
    launches recorded instead of run, the channel sums of conv/linear bias gradients done by numpy."""

    @staticmethod
    def _ptr(a):
        return a.ctypes.data

    def _launch(self, launch):
        self.launches.append(launch)

    def _norm_kernels(self):
        return EmulatedNormKernels()


_NP = {"float32": np.float32, "float64": np.float64,     # parameter types: numpy names, as cupy parses them
       "float16": np.float16, "uint16": np.uint16}
_C_NP = {"float": np.float32, "double": np.float64}       # reduce_type: a C type, pasted verbatim by cupy


def _c_to_python(code: str) -> list[str]:
    """The statements of a (tiny, straight-line) C operation as Python: casts become numpy casts, local
    declarations plain assignments."""
    import re

    out = []
    for stmt in filter(None, (s.strip() for s in code.split(";"))):
        stmt = re.sub(r"^(?:double|float)\s+", "", stmt)
        stmt = re.sub(r"\(unsigned int\)\s*(\w+)", r"_uint(\1)", stmt)
        stmt = re.sub(r"\((double|float)\)\s*\(", lambda m: f"_{m.group(1)}(", stmt)
        stmt = re.sub(r"\((double|float)\)\s*(\w+)", lambda m: f"_{m.group(1)}({m.group(2)})", stmt)
        out.append(stmt)
    return out


_CASTS = {"_double": lambda v: np.asarray(v, np.float64), "_float": lambda v: np.asarray(v, np.float32),
          "sqrt": np.sqrt, "_uint": lambda v: np.asarray(v, np.uint32),
          "__uint_as_float": lambda v: np.asarray(v, np.uint32).view(np.float32),
          "minidl_bf16_bits": lambda v: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)}


class _EmulatedKernel:
    """A cupy Elementwise/ReductionKernel evaluated with numpy (broadcasting, C types, reading outputs)."""

    def __init__(self, src):
        from minidl.backend.cuda.backend import ReductionSource

        self.src, self.reduction = src, isinstance(src, ReductionSource)
        self.ins = [(_NP[t], n) for t, n in (p.split() for p in src.in_params.split(","))]
        self.outs = [(_NP[t], n) for t, n in (p.split() for p in src.out_params.split(","))]

    def _inputs(self, args):
        arrays = [np.asarray(a, t) for (t, _), a in zip(self.ins, args)]
        return {n: a for (_, n), a in zip(self.ins, arrays)}

    def __call__(self, *args, axis=None, out=None):
        if self.reduction:
            assert self.src.reduce_expr == "a + b" and self.src.identity == "0"
            env = {**_CASTS, **self._inputs(args)}
            shape = np.broadcast_shapes(*(np.shape(env[n]) for _, n in self.ins))
            env = {k: np.broadcast_to(v, shape) if k in dict((n, 0) for _, n in self.ins) else v
                   for k, v in env.items()}
            mapped = eval(_c_to_python(self.src.map_expr)[0], {}, env).astype(_C_NP[self.src.reduce_type])
            env["a"] = mapped.sum(axis=axis)
            (t, name), = self.outs
            env[name] = out
            for stmt in _c_to_python(self.src.post_map_expr):
                target, expr = (x.strip() for x in stmt.split("=", 1))
                out[...] = np.asarray(eval(expr, {}, env)).astype(t)
            return out
        nin = len(self.ins)
        env = {**_CASTS, **self._inputs(args[:nin])}
        outs = args[nin:]
        assert len(outs) == len(self.outs), "outputs are passed explicitly"
        for (t, n), o in zip(self.outs, outs):
            env[n] = o.astype(t)                      # outputs are readable (C references)
        for stmt in _c_to_python(self.src.operation):
            target, expr = (x.strip() for x in stmt.split("=", 1))
            value = eval(expr, {}, env)
            declared = dict((n, t) for t, n in self.outs)
            env[target] = np.asarray(value).astype(declared[target]) if target in declared else value
        for (_, n), o in zip(self.outs, outs):
            o[...] = np.broadcast_to(env[n], o.shape)
        return outs


class EmulatedNormKernels:
    def __init__(self):
        from minidl.backend.cuda.backend import NORM_KERNELS

        for name, src in NORM_KERNELS.items():
            setattr(self, name, _EmulatedKernel(src))


def _host_backend(fake: FakeCudnn, **kw) -> HostEmulatedCUDA:
    cp_ns = SimpleNamespace(ndarray=np.ndarray, add=np.add, multiply=np.multiply, copyto=np.copyto,
                            broadcast_to=np.broadcast_to, lib=np.lib)
    be = HostEmulatedCUDA.from_parts(cupy=cp_ns, cupyx=None, cudnn=fake, cublas=None, compute=_NullStream(),
                                     transfer=_NullStream(), graphs=CudnnGraphs(fake, handle=5), side=_HostSide(),
                                     limits=LIMITS, filters=cudnn_specs.EngineFilters(), **kw)
    be.launches = []
    return be


def _conv_arrays():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 9, 7)).astype(np.float32)
    w = rng.standard_normal((6, 2, 3, 2)).astype(np.float32)
    y = np.zeros((2, 6, 5, 7), np.float32)
    return x, w, y, dict(stride=(2, 1), padding=(1, 1), dilation=(1, 2), groups=2)


def _table_by_op(tables):
    """Plan tables per graph, told apart by the graph's operation."""
    return lambda g: tables[_op_of(g)]


TABLES = {"conv_fprop": [(2048, "f0", True), (0, "f1", True)],
          "conv_dgrad": [(512, "d0", True), (128, "d1", True)],
          "conv_wgrad": [(1024, "w0", True), (0, "w1", True)]}


def test_conv_workspace_options_hook():
    be = _host_backend(FakeCudnn(plans=_table_by_op(TABLES)))
    x, w, y, p = _conv_arrays()
    fwd = be.conv_workspace_options("fwd", x.shape, w.shape, y.shape, p["stride"], p["padding"], p["dilation"],
                                    p["groups"])
    assert [(o.algo, o.workspace_bytes) for o in fwd] == [("cudnn:f0", 2048), ("cudnn:f1", 0)]
    bwd = be.conv_workspace_options("bwd", x.shape, w.shape, y.shape, p["stride"], p["padding"], p["dilation"],
                                    p["groups"])
    assert [(o.algo, o.workspace_bytes) for o in bwd] == [("cudnn:d0w0", 1024), ("cudnn:d0w1", 512),
                                                          ("cudnn:d1w1", 128)]


def test_conv_forward_dispatch():
    fake = FakeCudnn(plans=_table_by_op(TABLES))
    be = _host_backend(fake)
    x, w, y, p = _conv_arrays()
    b = np.arange(6, dtype=np.float32)
    ws = np.zeros(2048, np.uint8)
    be.conv2d_forward(x, w, b, y, algo="cudnn:f0", workspace=ws, **p)
    (ex,) = fake.executions
    built = be.graphs.get(cudnn_specs.ConvSpec.from_shapes(x.shape, w.shape, y.shape, **p, dtype=np.float32)
                          .key("fprop", be.filters))
    assert ex.pack == {built.tensors["x"]: x.ctypes.data, built.tensors["w"]: w.ctypes.data,
                       built.tensors["y"]: y.ctypes.data}
    assert (ex.workspace, ex.index, ex.handle) == (ws.ctypes.data, 0, 5)
    np.testing.assert_array_equal(y, np.broadcast_to(b.reshape(1, -1, 1, 1), y.shape))  # bias added after
    with pytest.raises(ValueError, match="needs a workspace of 2048 bytes, got 100"):
        be.conv2d_forward(x, w, None, y, algo="cudnn:f0", workspace=np.zeros(100, np.uint8), **p)
    with pytest.raises(ValueError, match="not a CUDA convolution algorithm"):
        be.conv2d_forward(x, w, None, y, algo="im2col", workspace=ws, **p)
    be.conv2d_forward(x, w, None, y, algo=None, workspace=None, **p)   # no workspace: the zero-workspace plan
    assert fake.executions[-1].index == 1 and fake.executions[-1].workspace == 0
    with pytest.raises(TypeError, match="float32"):
        be.conv2d_forward(x.astype(np.float64), w, None, y, algo="cudnn:f1", workspace=None, **p)
    with pytest.raises(ValueError, match="output must be"):
        be.conv2d_forward(x, w, None, np.zeros((2, 6, 5, 8), np.float32), algo="cudnn:f1", workspace=None, **p)


def test_conv_backward_dispatch():
    fake = FakeCudnn(plans=_table_by_op(TABLES))
    be = _host_backend(fake)
    x, w, dy, p = _conv_arrays()
    dy[:] = np.random.default_rng(1).standard_normal(dy.shape)
    dx, dw, db = np.zeros_like(x), np.zeros_like(w), np.zeros(6, np.float32)
    ws = np.zeros(512, np.uint8)
    be.conv2d_backward(x, w, dy, dx, dw, db, algo="cudnn:d0w1", workspace=ws, **p)
    dgrad, wgrad = fake.executions
    assert _op_of(dgrad.graph) == "conv_dgrad" and _op_of(wgrad.graph) == "conv_wgrad"
    spec = cudnn_specs.ConvSpec.from_shapes(x.shape, w.shape, dy.shape, **p, dtype=np.float32)
    td = be.graphs.get(spec.key("dgrad", be.filters)).tensors
    tw = be.graphs.get(spec.key("wgrad", be.filters)).tensors
    assert dgrad.pack == {td["y"]: dy.ctypes.data, td["w"]: w.ctypes.data, td["x"]: dx.ctypes.data}
    assert wgrad.pack == {tw["x"]: x.ctypes.data, tw["y"]: dy.ctypes.data, tw["w"]: dw.ctypes.data}
    assert (dgrad.index, wgrad.index) == (0, 1) and dgrad.workspace == wgrad.workspace == ws.ctypes.data
    np.testing.assert_allclose(db, dy.sum(axis=(0, 2, 3)), rtol=1e-5)
    fake.executions.clear()
    be.conv2d_backward(x, w, dy, None, dw, None, algo="cudnn:d0w0", workspace=np.zeros(1024, np.uint8), **p)
    assert [_op_of(e.graph) for e in fake.executions] == ["conv_wgrad"]   # no dx wanted: no dgrad
    with pytest.raises(ValueError, match="needs a workspace of 1024"):
        be.conv2d_backward(x, w, dy, None, dw, None, algo="cudnn:d1w0", workspace=ws, **p)


def _host_scalar_at(ptr):
    return ctypes.c_float.from_address(ptr).value


def test_batchnorm_dispatch():
    fake = FakeCudnn()
    be = _host_backend(fake)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 5, 5)).astype(np.float32)
    y = np.zeros_like(x)
    w, b = np.ones(3, np.float32), np.zeros(3, np.float32)
    rm, rv, mean, inv = (np.zeros(3, np.float32) for _ in range(4))
    be.batchnorm_forward_train(x, w, b, rm, rv, y, mean, inv, momentum=0.1, eps=1e-5)
    ex, apply = fake.executions   # the statistics, then y written by the recomputation's own call
    bn = cudnn_specs.BNSpec.from_shape(x.shape, x.dtype)
    assert apply.graph is be.graphs.get(bn.key("bn_infer", be.filters)).graph
    t = be.graphs.get(bn.key("bn_train", be.filters)).tensors
    ptr = {k: ex.pack[t[k]] for k in t}
    assert ptr["x"] == x.ctypes.data and ptr["y"] == y.ctypes.data
    assert ptr["running_mean"] == ptr["next_running_mean"] == rm.ctypes.data      # updated in place
    assert ptr["running_var"] == ptr["next_running_var"] == rv.ctypes.data
    assert ptr["mean"] == mean.ctypes.data and ptr["invstd"] == inv.ctypes.data
    assert _host_scalar_at(ptr["epsilon"]) == np.float32(1e-5) and _host_scalar_at(ptr["momentum"]) == np.float32(0.1)
    fake.executions.clear()
    be.batchnorm_forward_train(x, None, None, rm, rv, y, mean, inv, momentum=0.1, eps=1e-5, update_running=False)
    ptr = {k: fake.executions[0].pack[t[k]] for k in t}
    assert ptr["next_running_mean"] not in (rm.ctypes.data, rv.ctypes.data)       # running stats left alone
    ones = be.side.bufs["ones3"]
    assert ptr["scale"] == ones.ctypes.data and ones.tolist() == [1, 1, 1]        # affine=False: scale 1, bias 0
    assert be.side.bufs["zeros3"].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="more than one value per channel"):
        be.batchnorm_forward_train(x[:1, :, :1, :1].copy(), w, b, rm, rv, y[:1, :, :1, :1].copy(), mean, inv,
                                   0.1, 1e-5)
    fake.executions.clear()
    dx, dw, db = np.zeros_like(x), np.zeros(3, np.float32), np.zeros(3, np.float32)
    be.batchnorm_backward(x, w, y, mean, inv, dx, dw, db)
    tb = be.graphs.get(cudnn_specs.BNSpec.from_shape(x.shape, x.dtype).key("bn_backward", be.filters)).tensors
    ptr = {k: fake.executions[0].pack[tb[k]] for k in tb}
    assert (ptr["dy"], ptr["dx"], ptr["dscale"], ptr["dbias"]) == (y.ctypes.data, dx.ctypes.data, dw.ctypes.data,
                                                                  db.ctypes.data)


def test_unsupported_graphs_fall_back_and_say_why():
    fake = FakeCudnn(unsupported=lambda g: _op_of(g) in ("relu", "batchnorm"))
    be = _host_backend(fake)
    x, y = np.array([-1, 2, -3, 4], np.float32), np.zeros(4, np.float32)
    be.relu_forward(x, y)
    assert [launch.name for launch in be.launches] == ["relu_forward"]
    assert be.launches[0].args[:2] == (y, x) and not fake.executions
    assert "relu_fwd" in be.fallbacks and "no engine" in be.fallbacks["relu_fwd"]
    be.relu_forward(x, y)                                        # remembered: not rebuilt
    assert len([g for g in fake.graphs if _op_of(g) == "relu"]) == 2      # with and without the filters, once
    dx = np.zeros(4, np.float32)
    be.relu_backward(y, x, dx)                                   # relu_bwd is supported: a cuDNN graph
    assert _op_of(fake.executions[-1].graph) == "relu_backward"
    spec = cudnn_specs.BNSpec.from_shape((2, 3, 4, 4), np.float32)
    assert be._bn_graph("bn_train", spec) is None and "bn_train" in be.fallbacks
    assert be._bn_graph("bn_infer", spec) is not None
    off = _host_backend(FakeCudnn(), use_cudnn_relu=False)
    off.relu_forward(x, y)
    assert [launch.name for launch in off.launches] == ["relu_forward"]


def test_kernel_dispatch():
    be = _host_backend(FakeCudnn())
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 6)).astype(np.float32)
    dy = np.zeros((2, 3, 3, 3), np.float32)
    dx = np.full_like(x, np.nan)
    be.maxpool2d_backward(x, dy, dx, (2, 2), (2, 2), (0, 0), (1, 1))
    assert np.all(dx == 0)                                       # zeroed before the atomic scatter
    assert be.launches[-1].name == "maxpool2d_backward" and be.launches[-1].args[0] is dx
    be.launches.clear()
    a, b, c, out = (np.zeros((2, 5), np.float32) for _ in range(4))
    be.add_forward([a, b], out)
    be.add_forward([a, b, c], out)                               # one launch sums up to ADD_ARITY inputs
    be.add_forward([a, b, c] * 3, out)                           # and the rest add into out
    assert [(c.name, c.args[:4]) for c in be.launches] == [
        ("add_forward", (out, a, b, 10)), ("add_many", (out, a, b, c)), ("add_many", (out, a, b, c)),
        ("add_forward", (out, out, c, 10))]
    assert [c.args[-2:] for c in be.launches[1:3]] == [(3, 10), (8, 10)]
    be.launches.clear()
    parts = [np.zeros((2, k, 3, 3), np.float32) for k in (1, 4, 2)]
    cat = np.zeros((2, 7, 3, 3), np.float32)
    be.concat_forward(parts, cat)
    assert [int(c.args[-1]) for c in be.launches] == [0, 1, 5]
    be.launches.clear()
    be.concat_backward(cat, [parts[0], None, parts[2]], [1, 4, 2])
    assert [int(c.args[-1]) for c in be.launches] == [0, 5]
    be.launches.clear()
    logits, labels, loss = np.zeros((6, 5), np.float32), np.arange(6, dtype=np.int64) % 5, np.zeros((), np.float32)
    be.softmax_xent_forward(logits, labels, loss)
    assert [c.name for c in be.launches] == ["softmax_xent_forward", "softmax_xent_mean"]
    assert be.launches[0].args[0] is be.launches[1].args[1] and be.launches[1].args[0] is loss
    with pytest.raises(TypeError, match="int64"):
        be.softmax_xent_forward(logits, labels.astype(np.int32), loss)
    be.launches.clear()
    dlogits = np.ones((6, 5), np.float32)
    be.softmax_xent_backward(logits, labels, np.array(2.0, np.float32), dlogits)
    assert be.launches[0].args[-1] == np.float32(1 / 6)
    np.testing.assert_array_equal(dlogits, 2.0)                 # * dloss on the device, no host round trip
    be.launches.clear()
    p = np.zeros(4, np.float32)
    be.sgd_update(p, p.copy(), None, 0.1, 0.0, 0.0, 0.0, False, True)
    assert be.launches[-1].args[2] is None
    with pytest.raises(ValueError, match="C-contiguous"):
        be.relu_forward(x[:, :, ::2], np.zeros((2, 3, 3, 6), np.float32))


# ---------------------------------------------------------------------------------------------------------
# The cupy-compiled fallback kernels (cuda.NORM_KERNELS) compile as CUDA C
# ---------------------------------------------------------------------------------------------------------

_CTYPES = {"float32": "float", "float64": "double", "float16": "__half", "uint16": "unsigned short"}


def _params(spec: str) -> list[tuple[str, str]]:
    return [(_CTYPES[t], n) for t, n in (p.split() for p in spec.split(","))]


def _cupy_like_source(name: str, src, ctypes=_CTYPES) -> str:
    """The kernel as cupy generates it, reduced to what matters for compiling the user code: inputs bound as
    const values, outputs as references, the elementwise loop index `i`, and the reduction's REDUCE/POST_MAP
    macros over `_type_reduce` operands; `ctypes`: the C type of each parameter type."""
    from minidl.backend.cuda.backend import ElementwiseSource

    ins = [(ctypes[t], n) for t, n in (p.split() for p in src.in_params.split(","))]
    outs = [(ctypes[t], n) for t, n in (p.split() for p in src.out_params.split(","))]
    sig = ", ".join([f"const {t}* _raw_{n}" for t, n in ins] + [f"{t}* _raw_{n}" for t, n in outs]
                    + ["long long _n"])
    bind_in = " ".join(f"const {t} {n} = _raw_{n}[_j];" for t, n in ins)
    bind_out = " ".join(f"{t} &{n} = _raw_{n}[_j];" for t, n in outs)
    loop = "for (long long {v} = blockIdx.x * (long long)blockDim.x + threadIdx.x; {v} < _n; " \
           "{v} += (long long)blockDim.x * gridDim.x)"
    if isinstance(src, ElementwiseSource):
        body = f"{loop.format(v='i')} {{ const long long _j = i; {bind_in} {bind_out} {src.operation}; }}"
        return f'extern "C" __global__ void minidl_{name}({sig}) {{ {body} }}\n'
    # cupy/_core/_reduction.pyx pastes reduce_type verbatim: `typedef ${reduce_type} _type_reduce;`
    return (f"typedef {src.reduce_type} _type_reduce;\n"
            f"#define REDUCE(a, b) ({src.reduce_expr})\n#define POST_MAP(a) ({src.post_map_expr})\n"
            f'extern "C" __global__ void minidl_{name}({sig}) {{\n'
            f"  _type_reduce _s = _type_reduce({src.identity});\n"
            f"  {loop.format(v='_j')} {{ {bind_in} _type_reduce _a = static_cast<_type_reduce>({src.map_expr});"
            f" _s = REDUCE(_s, _a); }}\n"
            f"  {{ const long long _j = 0; {bind_out} POST_MAP(_s); }}\n}}\n"
            f"#undef REDUCE\n#undef POST_MAP\n")


def test_fallback_kernels_compile(tmp_path):
    import shutil

    from minidl.backend.cuda.backend import NORM_KERNELS

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: cannot compile-check the fallback kernels")
    preambles = dict.fromkeys(getattr(k, "preamble", "") for k in NORM_KERNELS.values())
    src = "#include <cuda_fp16.h>\n" + "".join(preambles) + "".join(_cupy_like_source(name, k)
                                                                 for name, k in NORM_KERNELS.items())
    path = tmp_path / "norm_kernels.cu"
    path.write_text(src)
    r = subprocess.run([nvcc, "-arch=sm_75", "-Werror", "all-warnings", "-c", str(path), "-o",
                        str(tmp_path / "k.o")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr + "\n" + src


def test_reduction_kernels_name_reduce_type_in_c():
    """cupy.ReductionKernel takes its parameters with numpy type names ("float64 s", parsed by
    cupy/_core/_kernel.pyx ParameterInfo) but `reduce_type` as C source: it is substituted verbatim into
    `typedef ${reduce_type} _type_reduce;` (cupy/_core/_reduction.pyx), so "float64" would not compile on the
    GPU. Checked here because the nvcc compile test is skipped where nvcc is missing."""
    from minidl.backend.cuda.backend import NORM_KERNELS, ReductionSource

    reductions = {name: k for name, k in NORM_KERNELS.items() if isinstance(k, ReductionSource)}
    assert reductions
    for name, k in reductions.items():
        assert k.reduce_type in _C_NP, f"{name}: reduce_type {k.reduce_type!r} is not a C type"
        for t, _ in (p.split() for p in (k.in_params + "," + k.out_params).split(",")):
            assert t in _NP, f"{name}: parameter type {t!r} is not a numpy dtype name"


def test_fallback_kernel_operations_avoid_reserved_names():
    import re

    from minidl.backend.cuda.backend import NORM_KERNELS, ElementwiseSource

    for name, k in NORM_KERNELS.items():
        names = [n for _, n in _params(k.in_params) + _params(k.out_params)]
        assert not any(n == "i" or n.startswith("_") for n in names), name
        if isinstance(k, ElementwiseSource):
            assert not re.search(r"\b(?:int|long|double|float|auto)\s+i\b", k.operation), name
        else:
            assert not {"a", "b"} & set(names), f"{name}: a and b are the reduction's operands"


@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (2, 6, 7, 9), (8, 4, 1, 1)])
@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm_fallback_path_matches_torch(shape, affine):
    """The cupy-kernel BN path (used when cuDNN has no engine), its C expressions evaluated with numpy."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    be = _host_backend(FakeCudnn(), use_cudnn_bn=False)
    rng = np.random.default_rng(3)
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    w = rng.uniform(0.5, 1.5, c).astype(np.float32) if affine else None
    b = rng.standard_normal(c).astype(np.float32) if affine else None
    rm0, rv0 = rng.standard_normal(c).astype(np.float32), rng.uniform(0.5, 2, c).astype(np.float32)
    for training in (True, False):
        tx = torch.tensor(x, requires_grad=True)
        tw = torch.tensor(w, requires_grad=True) if affine else None
        tb = torch.tensor(b, requires_grad=True) if affine else None
        trm, trv = torch.tensor(rm0), torch.tensor(rv0)
        ty = F.batch_norm(tx, trm, trv, tw, tb, training=training, momentum=0.1, eps=1e-5)
        ty.backward(torch.tensor(dy))
        rm, rv, y = rm0.copy(), rv0.copy(), np.zeros_like(x)
        dx, dw, db = np.zeros_like(x), np.zeros(c, np.float32), np.zeros(c, np.float32)
        if training:
            mean, inv = np.zeros(c, np.float32), np.zeros(c, np.float32)
            be.batchnorm_forward_train(x, w, b, rm, rv, y, mean, inv, 0.1, 1e-5)
            be.batchnorm_backward(x, w, dy, mean, inv, dx, dw if affine else None, db if affine else None)
            y2 = np.zeros_like(x)
            be.batchnorm_forward_apply(x, w, b, mean, inv, y2)     # recomputation reproduces the forward
            np.testing.assert_array_equal(y2, y)
        else:
            be.batchnorm_forward_eval(x, w, b, rm, rv, y, 1e-5)
            be.batchnorm_backward_eval(x, w, dy, rm, rv, 1e-5, dx, dw if affine else None, db if affine else None)
        np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(rm, trm.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rv, trv.numpy(), rtol=1e-5, atol=1e-6)
        if affine:
            np.testing.assert_allclose(dw, tw.grad.numpy(), rtol=1e-3, atol=1e-3)
            np.testing.assert_allclose(db, tb.grad.numpy(), rtol=1e-4, atol=1e-4)
    assert not be.graphs._cache          # cuDNN was never asked


# ---------------------------------------------------------------------------------------------------------
# Transfers: timing events, device-side waits, and device times on the host clock
# ---------------------------------------------------------------------------------------------------------

class _TimedStream:
    """A fake CUDA stream with its own device clock in ms: an event recorded on it takes the clock's time, and
    is complete once it or a later event on the same stream was synchronized."""

    def __init__(self, name, log):
        self.name, self.log, self.now = name, log, 0.0
        self.ptr = id(self)  # what the backend hands cudaMemcpyAsync (_FakeRuntime finds the stream by it)
        self.recorded = 0
        self.synced_through = -1

    def wait_event(self, ev):
        self.log.append((self.name, "wait", ev))


class _TimedEvent:
    def __init__(self, log, block=False, disable_timing=False, interprocess=False):
        self.log, self.timing = log, not disable_timing
        self.stream = self.t = self.seq = None

    def record(self, stream=None):
        self.stream, self.t, self.seq = stream, stream.now, stream.recorded
        stream.recorded += 1
        self.log.append((stream.name, "record", self))

    def synchronize(self):
        self.stream.synced_through = max(self.stream.synced_through, self.seq)
        self.log.append(("host", "sync", self))

    @property
    def done(self):
        return self.seq is not None and self.seq <= self.stream.synced_through


class _DeviceArray:
    """A 'device' array whose copies advance the stream's clock by `copy_ms`. Its 'device pointer' is its host
    buffer's address, so `_FakeRuntime.memcpyAsync` (what the backend's copies call) really copies."""

    def __init__(self, a, copy_ms):
        self.a, self.copy_ms = a, copy_ms
        self.shape, self.dtype, self.nbytes = a.shape, a.dtype, a.nbytes
        self.data = SimpleNamespace(ptr=a.ctypes.data)
        _DEVICE_ARRAYS[self.data.ptr] = self


_DEVICE_ARRAYS: dict[int, _DeviceArray] = {}


class _FakeRuntime:
    """cupy.cuda.runtime's memcpyAsync (dst, src, size, kind, stream pointer) over fake device arrays: the bytes
    are copied, and the stream (found by its `ptr`, an id) logs the copy and advances by the array's `copy_ms`."""

    memcpyHostToDevice, memcpyDeviceToHost = 1, 2

    @staticmethod
    def memcpyAsync(dst, src, size, kind, stream_ptr):
        dev = _DEVICE_ARRAYS[dst if kind == _FakeRuntime.memcpyHostToDevice else src]
        assert size == dev.nbytes
        ctypes.memmove(dst, src, size)
        stream = ctypes.cast(stream_ptr, ctypes.py_object).value
        stream.log.append((stream.name, "copy", None))
        stream.now += dev.copy_ms


def _timed_backend(duplex: bool = False):
    """The real CUDABackend transfer code over fake events and streams; `be.elapsed` lists the event pairs
    whose elapsed time was read, and reading one that has not completed fails as cudaEventElapsedTime does.
    `duplex`: a stream per direction ('d2h' offloads, 'h2d' prefetches), as the real backend has."""
    log, elapsed, pinned = [], [], []

    def get_elapsed_time(a, b):
        assert a.timing and b.timing, "elapsed time of an event created with disable_timing"
        if not (a.done and b.done):
            raise RuntimeError("cudaErrorNotReady")
        elapsed.append((a, b))
        return b.t - a.t

    def empty_pinned(shape, dtype):
        pinned.append(np.empty(shape, dtype))
        return pinned[-1]

    cp = SimpleNamespace(cuda=SimpleNamespace(Event=lambda **kw: _TimedEvent(log, **kw),
                                              get_elapsed_time=get_elapsed_time, runtime=_FakeRuntime))
    be = CUDABackend.from_parts(cupy=cp, cupyx=SimpleNamespace(empty_pinned=empty_pinned), cudnn=None,
                                cublas=None, compute=_TimedStream("compute", log),
                                transfer=_TimedStream("d2h" if duplex else "transfer", log),
                                prefetch=_TimedStream("h2d", log) if duplex else None, graphs=None, side=None,
                                limits=LIMITS, filters=cudnn_specs.EngineFilters())
    be.log, be.elapsed, be.pinned = log, elapsed, pinned
    return be


@pytest.fixture
def perf_counter(monkeypatch):
    """The host clock the backend pairs its anchor with: fixed at 1000 s, calls counted."""
    import minidl.backend.cuda.copies as cuda_mod  # the transfer clock lives with the transfers

    calls = []
    monkeypatch.setattr(cuda_mod, "time", SimpleNamespace(perf_counter=lambda: calls.append(1) or 1000.0))
    return calls


@pytest.mark.parametrize("kind", ["offload", "prefetch"])
def test_transfers_record_timing_events_around_the_copy(kind):
    be = _timed_backend()
    host = np.arange(6, dtype=np.float32)
    dev = _DeviceArray(np.zeros(6, np.float32), copy_ms=2.0)
    t = be.offload_async(dev, host) if kind == "offload" else be.prefetch_async(host, dev)
    anchor, ready, start, done = (ev for _, what, ev in be.log if what == "record")
    assert [(s, what, ev) for s, what, ev in be.log] == [
        ("compute", "record", anchor), ("host", "sync", anchor),  # the clock anchor, made by the first transfer
        ("compute", "record", ready), ("transfer", "wait", ready), ("transfer", "record", start),
        ("transfer", "copy", None), ("transfer", "record", done)]
    assert (t.kind, t.nbytes, t.start, t.done, t.reached) == (kind, 24, start, done, None)
    assert not ready.timing and start.timing and done.timing    # only measured events pay for timing
    assert done.t - start.t == 2.0
    be.transfer_wait(t)
    reached = t.reached
    assert be.log[-2:] == [("compute", "record", reached), ("compute", "wait", done)]
    assert reached.timing and reached.stream is be.compute


def test_transfer_times_map_device_events_onto_the_host_clock(perf_counter):
    be = _timed_backend()
    host = np.zeros(4, np.float32)
    dev = _DeviceArray(np.ones(4, np.float32), copy_ms=2.0)
    be.compute.now = 3.0                         # where the anchor is recorded: by the first transfer
    be.transfer.now = 5.0
    t1 = be.offload_async(dev, host)            # copies over [5, 7] ms
    be.compute.now = 6.0
    be.transfer_wait(t1)                         # compute reaches the wait at 6: stalls 1 ms
    t2 = be.prefetch_async(host, dev)            # [7, 9]
    be.compute.now = 12.0
    be.transfer_wait(t2)                         # reached after the copy: no stall
    t3 = be.offload_async(dev, host)             # [9, 11], never waited on
    be.compute.now = 20.0

    be.transfer_sync(t1)
    assert be.transfer_times(t1) == pytest.approx((1000 + 0.002, 1000 + 0.004, 0.001))
    anchor = be._clock_anchor[0]
    assert anchor.stream is be.compute and anchor.t == 3.0 and anchor.timing and ("host", "sync", anchor) in be.log
    assert be.elapsed == [(anchor, t1.start), (anchor, t1.done), (t1.reached, t1.done)]

    be.elapsed.clear()
    assert be.transfer_times(t2) == pytest.approx((1000 + 0.004, 1000 + 0.006, 0.0))
    assert be.elapsed == [(anchor, t2.start), (anchor, t2.done), (t2.reached, t2.done)]
    be.elapsed.clear()
    assert be.transfer_times(t3) == pytest.approx((1000 + 0.006, 1000 + 0.008, 0.0))
    assert be.elapsed == [(anchor, t3.start), (anchor, t3.done)]     # nobody waited: no stall to measure

    # a copy waited on after the anchor: its `reached` is synchronized before being read
    t4 = be.prefetch_async(host, dev)            # [11, 13]
    be.compute.now = 11.5
    be.transfer_wait(t4)
    be.transfer_sync(t4)
    assert be.transfer_times(t4) == pytest.approx((1000 + 0.008, 1000 + 0.010, 0.0015))
    assert len(perf_counter) == 1                # one anchor for the backend's lifetime


def test_host_store_runs_on_the_cuda_backend_transfer_code(perf_counter):
    """HostStore's stream engine against the backend's real transfer methods (fake events and streams)."""
    from minidl.memory.host import HostStore, StreamTransfers

    be = _timed_backend()
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    dev = _DeviceArray(a.copy(), copy_ms=4.0)
    trace = []
    with HostStore(t0=999.0, trace=trace, backend=be) as h:
        assert isinstance(h.engine, StreamTransfers)
        h.offload("a", dev, 0)                                       # runs [0, 4] ms
        be.compute.now = 5.0                                         # reaches the release after it: no stall
        h.wait_offload("a")
        (_, _, done), (_, _, reached), wait = be.log[-3:]             # device-side: compute waits for `done`
        assert wait == ("compute", "wait", done) and done.stream is be.transfer and reached.stream is be.compute
        # the host never blocked, except once for the clock anchor made by the first transfer
        assert [ev for _, what, ev in be.log if what == "sync"] == [be._clock_anchor[0]]
        dev.a[...] = 0
        be.compute.now = 6.0                                         # the prefetch runs [4, 8]: 2 ms stall
        h.prefetch("a", dev, 1)
        h.wait_prefetch("a")
        be.compute.now = 10.0
        h.end_iteration()
        assert np.array_equal(dev.a, a) and h.host_copy("a") is be.pinned[0] and len(be.pinned) == 1
        s = h.stats()
    assert (s.offloads, s.prefetches, s.offloaded_bytes, s.prefetched_bytes) == (1, 1, a.nbytes, a.nbytes)
    assert s.transfer_time_s == pytest.approx(0.008) and s.stall_time_s == pytest.approx(0.002)
    assert [(e.name, e.step) for e in trace] == [("offload a", 0), ("prefetch a", 1)]
    assert [e.start_s for e in trace] == pytest.approx([1.0, 1.004])  # anchor at 0 ms, host 1000 s, t0 999 s
    assert [e.dur_s for e in trace] == pytest.approx([0.004, 0.004])


def test_copies_overlap_on_one_stream_per_direction_ordered_by_events_only(perf_counter):
    """Offloads on the d2h stream, prefetches on the h2d stream: each waits for an event recorded on compute,
    compute waits for each copy's `done` event, and the host blocks nowhere inside the step: only in the
    store's end_iteration (settling the step's copies) and once for the clock anchor."""
    from minidl.memory.host import HostStore

    be = _timed_backend(duplex=True)
    a = _DeviceArray(np.arange(8, dtype=np.float32), copy_ms=4.0)
    b = _DeviceArray(np.arange(8, dtype=np.float32) + 8, copy_ms=4.0)
    with HostStore(t0=999.0, trace=[], backend=be) as h:
        be._anchor()                                  # the real backend makes it at construction
        be.log.clear()
        h.offload("a", a, 0)
        h.wait_offload("a")                           # RELEASE a
        h.offload("b", b, 1)                          # b's offload ...
        h.prefetch("a", a, 2)                         # ... and a's prefetch overlap: two streams
        h.wait_prefetch("a")
        h.wait_offload("b")
        step = list(be.log)
        h.end_iteration()
    streams = {s for s, what, _ in step if what == "copy"}
    assert streams == {"d2h", "h2d"}
    assert not [e for s, what, e in step if s == "host"], "the host blocked inside the step"
    # each copy waits for compute's `ready` event; compute waits for each copy's `done` event
    ready_a, ready_b, ready_pa = [e for s, what, e in step if what == "record" and s == "compute"
                                  and not e.timing]
    assert ("d2h", "wait", ready_a) in step and ("d2h", "wait", ready_b) in step and ("h2d", "wait", ready_pa) in step
    copies = [(s, i) for i, (s, what, _) in enumerate(step) if what == "copy"]
    assert [s for s, _ in copies] == ["d2h", "d2h", "h2d"]
    # a's prefetch is ordered after a's offload through compute: compute waited for a's offload before it
    # recorded the event the prefetch waits for
    waits = [e for s, what, e in step if s == "compute" and what == "wait"]
    assert step.index(("compute", "wait", waits[0])) < step.index(("compute", "record", ready_pa))
    assert waits[0].stream.name == "d2h"
    assert [ev for s, what, ev in be.log if s == "host"]   # end_iteration settled the copies: the one block


def test_adapter_builds_the_data_gradient_with_a_fused_add():
    """dgrad_add: conv_dgrad's result stays inside the graph (dims set, not an output) and an add of x_acc, the
    delta it is added to, is the graph's output x."""
    fake = FakeCudnn()
    spec, key = _conv_key("dgrad_add")
    built = CudnnGraphs(fake, handle=1).get(key)
    g = fake.graphs[0]
    (dgrad_kw,) = [kw for op, kw in g.calls if op == "conv_dgrad"]
    (add_kw,) = [kw for op, kw in g.calls if op == "add"]
    t = built.tensors
    assert set(t) == {"x", "w", "y", "x_acc"} and key.op == "conv_dgrad_add"
    assert dgrad_kw["loss"] is t["y"] and dgrad_kw["filter"] is t["w"]
    assert add_kw["b"] is t["x_acc"] and add_kw["a"].origin == "conv_dgrad::DX"
    assert add_kw["a"].output is False and add_kw["a"].dim == list(spec.descs()["x"].dim)
    assert t["x"].origin == "add::OUT_0" and t["x"].output is True
    assert t["x_acc"].kw["dim"] == t["x"].dim


def _accumulating_backend(fused: bool):
    tables = {**TABLES, "conv_dgrad": [(512, "d0", True), (128, "d1", True)]}
    fake = FakeCudnn(plans=lambda g: tables["conv_dgrad" if _op_of(g) == "conv_dgrad" else _op_of(g)],
                     unsupported=lambda g: not fused and any(op == "add" for op, _ in g.calls))
    return fake, _host_backend(fake)


def test_an_accumulating_backward_adds_in_the_data_gradients_graph():
    """A fork's later convolution: one dgrad_add execution over the whole batch, x_acc and x both the delta's
    memory (the add reads each value before it writes it), then wgrad; the options are dgrad_add's plans."""
    fake, be = _accumulating_backend(fused=True)
    x, w, dy, p = _conv_arrays()
    opts = be.conv_workspace_options("bwd", x.shape, w.shape, dy.shape, p["stride"], p["padding"], p["dilation"],
                                     p["groups"], accumulate=True)
    assert [o.algo for o in opts] == ["cudnn:d0w0", "cudnn:d0w1", "cudnn:d1w1"]
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    ws = np.zeros(512, np.uint8)
    be.conv2d_backward(x, w, dy, dx, dw, None, algo="cudnn:d0w1", workspace=ws, accumulate=True, **p)
    dgrad, wgrad = fake.executions
    spec = cudnn_specs.ConvSpec.from_shapes(x.shape, w.shape, dy.shape, **p, dtype=np.float32)
    td = be.graphs.get(spec.key("dgrad_add", be.filters)).tensors
    assert dgrad.graph is be.graphs.get(spec.key("dgrad_add", be.filters)).graph
    assert dgrad.pack == {td["y"]: dy.ctypes.data, td["w"]: w.ctypes.data, td["x"]: dx.ctypes.data,
                          td["x_acc"]: dx.ctypes.data}
    assert (dgrad.index, wgrad.index, dgrad.workspace) == (0, 1, ws.ctypes.data)
    assert _op_of(wgrad.graph) == "conv_wgrad" and not be.launches and not be.fallbacks


def test_without_a_fused_add_the_data_gradient_goes_through_the_workspace():
    """Where cuDNN builds no dgrad_add: the options say `+add`, each with dx's bytes (rounded to 256) ahead of
    the dgrad plan's own workspace; the call runs dgrad into that head and adds it to the delta after."""
    fake, be = _accumulating_backend(fused=False)
    x, w, dy, p = _conv_arrays()
    head = cudnn_specs.dx_scratch_bytes(x.shape, x.dtype)
    assert head == 2 * 4 * 9 * 7 * 4 + 32 == 2048
    opts = be.conv_workspace_options("bwd", x.shape, w.shape, dy.shape, p["stride"], p["padding"], p["dilation"],
                                     p["groups"], accumulate=True)
    assert [(o.algo, o.workspace_bytes) for o in opts] == [("cudnn:d0w0+add", head + 512),
                                                           ("cudnn:d1w0+add", head + 128)]
    assert "conv_dgrad_add" in be.fallbacks
    dx = np.zeros_like(x)
    ws = np.zeros(head + 128, np.uint8)
    be.conv2d_backward(x, w, dy, dx, None, None, algo="cudnn:d1w0+add", workspace=ws, accumulate=True, **p)
    (dgrad,) = fake.executions
    spec = cudnn_specs.ConvSpec.from_shapes(x.shape, w.shape, dy.shape, **p, dtype=np.float32)
    td = be.graphs.get(spec.key("dgrad", be.filters)).tensors
    assert dgrad.pack[td["x"]] == ws.ctypes.data and dgrad.workspace == ws.ctypes.data + head and dgrad.index == 1
    (add,) = be.launches
    assert add.name == "accumulate" and add.args[0] is dx
    with pytest.raises(ValueError, match="needs a workspace of 128 bytes, got 127"):
        be.conv2d_backward(x, w, dy, dx, None, None, algo="cudnn:d1w0+add", workspace=ws[:head + 127],
                           accumulate=True, **p)
