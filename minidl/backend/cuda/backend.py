"""The CUDA backend: cupy arrays inside one device arena, cuDNN frontend graphs, and minidl's own kernels.

STATUS: written against the documented APIs of CuPy (>= 13) and NVIDIA's cuDNN frontend Python package
(`import cudnn`, nvidia-cudnn-frontend >= 1.x), with every device-free computation tested on the host
(`cuda_plan.py`, tests/backend/test_cuda_host.py) and the kernels compiled by nvcc, but it has NOT been run on a
GPU yet. The conformance tests (tests/backend/test_conformance.py) run it against PyTorch wherever a GPU, cupy and
cuDNN are present; they are skipped, with the reason, everywhere else.

Importing this module needs neither cupy nor cuDNN (both are imported inside `CUDABackend.__init__`), so
`import minidl` and the CPU path work on machines without CUDA; constructing a `CUDABackend` there raises
`CUDAUnavailable` (a RuntimeError) saying what is missing.

What lives where on the device:

* **The arena.** `arena_backing()` hands the tensor pool a backing whose `allocate(nbytes)` makes ONE raw
  `cudaMalloc` (`cupy.cuda.memory.Memory`, not cupy's caching memory pool) and returns a `DeviceArena`; every
  tensor is a `cupy.ndarray` view at `base + offset` (`DeviceArena.view_at`), bounds- and alignment-checked by
  `cuda_plan.view_spec`. The budget is the arena: kernels write only into the views they are given.
* **Outside the arena**, counted and reported by `memory_report()`: cuDNN/cuBLAS handles, per-channel and
  per-sample scratch of a few KiB (`_SideBuffers`: BN statistics in float64, per-row losses, the workspace of
  the small BN/ReLU graphs), and, only if cupy allocates behind our back, "stray" bytes that an allocator hook
  counts (`stray_bytes`: assigning a numpy array into a view, `view[...] = numpy_array`, stages it in a cupy
  allocation; the executor initializes parameters with `copy_in`, which does not).
* **Streams.** All compute (kernels, cuDNN graphs, cuBLAS, cupy elementwise ops) runs on one non-blocking
  compute stream; offloads run on their own non-blocking stream (`transfer`, device -> host) and prefetches on
  another (`prefetch_stream`, host -> device), one per direction because the link is full duplex. They are
  ordered against compute by events only (the host never blocks except in `to_host`, `transfer_sync` and
  `transfer_times`, which the host store calls once per step, after it; the clock anchor is made at
  construction). A tensor's prefetch never overtakes its own offload although they are on different streams:
  the plan releases the tensor (compute waits for the offload's `done`) before it prefetches it, and the
  prefetch waits for an event recorded on compute after that wait. The host store
  is pinned memory (`host_empty`), so device<->host copies are truly asynchronous.
* **cuDNN graphs** (convolution forward / backward-data / backward-filter, batch norm training / inference /
  backward, ReLU forward / backward) are built once per shape (`cuda_plan.GraphKey`) by `CudnnGraphs`, the one
  class that calls the cuDNN frontend (a version difference of its API is a fix in one place). Convolutions
  expose every buildable execution plan with its workspace size to the memory planner through
  `conv_workspace_options` (see `cuda_plan.conv_options`). If cuDNN supports no engine for a BN or ReLU graph
  (e.g. an engine that insists on NHWC), the backend falls back to cupy kernels (BN) or kernels/elementwise.cu
  (ReLU) and records why in `fallbacks`; convolutions have no fallback and fail loudly.
* **kernels/*.cu** (pooling, loss, optimizers, dropout, concat, LRN, elementwise) are loaded with
  `cupy.RawModule` and launched with the arguments and grid of `cuda_plan.LAUNCHERS`.

Data types: float32 activations/parameters and int64 labels (as the kernels are written); anything else raises
TypeError naming the argument.
"""
from __future__ import annotations

import atexit
import functools
import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...core.errors import MinidlError
from ...core.vocab import WorkspaceOption
from ..base import Capabilities
from . import kernel_specs as ks
from . import plan as cuplan
from .sequence import SEQUENCE_KERNELS, SequenceOps

__all__ = ["CUDABackend", "CUDAUnavailable", "CudnnGraphs", "BuiltGraph", "GraphUnsupported", "DeviceArena",
           "DeviceArenaBacking", "Transfer", "load_cuda_modules", "NORM_KERNELS", "ElementwiseSource",
           "ReductionSource"]

_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)


class CUDAUnavailable(MinidlError, RuntimeError):
    """cupy, the cuDNN frontend or a CUDA device is missing."""


def load_cuda_modules() -> tuple[Any, Any, Any]:
    """Import (cupy, cupyx, cudnn) and check that a device is visible; raise CUDAUnavailable saying what is
    missing otherwise."""
    try:
        import cupy
        import cupyx
    except ImportError as e:
        raise CUDAUnavailable(
            f"the CUDA backend needs CuPy, which is not importable here ({e}). Install the optional "
            f"dependencies with `pip install 'minidl[cuda]'` (cupy-cuda13x[ctk], nvidia-cudnn-frontend, "
            f"nvidia-cudnn-cu13), or use "
            f"--backend cpu. To plan for a GPU you do not have, use the simulator's device profiles.") from e
    try:
        import cudnn
    except ImportError as e:
        raise CUDAUnavailable(
            f"the CUDA backend needs NVIDIA's cuDNN frontend (`import cudnn`, package nvidia-cudnn-frontend), "
            f"which is not importable here ({e}); CuPy 14 no longer ships its own cuDNN bindings.") from e
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # cupy raises CUDARuntimeError when there is no driver
        raise CUDAUnavailable(f"CuPy is installed but cannot talk to a CUDA driver: {e}") from e
    if count < 1:
        raise CUDAUnavailable("CuPy is installed but no CUDA device is visible")
    return cupy, cupyx, cudnn


# ---------------------------------------------------------------------------------------------------------
# cuDNN frontend adapter: the only code that calls `cudnn.*`
# ---------------------------------------------------------------------------------------------------------

class GraphUnsupported(RuntimeError):
    """cuDNN has no engine (or no buildable plan) for a graph."""


#: Characters of a fallback reason kept in the report: cuDNN's own errors run to several KB of log lines.
REASON_CHARS = 200


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """`text` as one line of at most `limit` characters: its first non-empty line, whitespace collapsed
    (cuDNN's not-supported errors carry multi-KB logs; a report needs the reason, not the log)."""
    first = next((ln for ln in str(text).splitlines() if ln.strip()), "")
    first = " ".join(first.split())
    return first if len(first) <= limit else first[:limit - 3] + "..."


#: Every CudnnGraphs and CUDABackend alive, so their cuDNN objects are released before the interpreter shuts
#: down (see `_release_all`).
_LIVE_GRAPHS: "weakref.WeakSet[CudnnGraphs]" = weakref.WeakSet()
_LIVE_BACKENDS: "weakref.WeakSet[CUDABackend]" = weakref.WeakSet()


def _release_all() -> None:
    """atexit: drop every cached cuDNN graph and handle while the cudnn module still exists. Left to interpreter
    shutdown, the frontend's nanobind objects outlive their module and nanobind prints "leaked N instances"."""
    for be in list(_LIVE_BACKENDS):
        be.release_cudnn()
    for graphs in list(_LIVE_GRAPHS):
        graphs.release()


atexit.register(_release_all)


@dataclass(slots=True)
class BuiltGraph:
    """A validated cuDNN graph with its built execution plans, cached per `GraphKey`."""

    key: cuplan.GraphKey
    graph: Any
    tensors: dict[str, Any]             # tensor name (cuda_plan descs) -> cudnn tensor handle
    plans: list[cuplan.PlanInfo]        # in cuDNN's heuristic order
    relaxed: tuple[str, ...] = ()       # numerical-note filters dropped because nothing else was supported

    def plan(self, index: int) -> cuplan.PlanInfo:
        for p in self.plans:
            if p.index == index:
                return p
        raise ValueError(f"{self.key.op}: no built execution plan {index}; have "
                         f"{[p.index for p in self.plans]}")


class CudnnGraphs:
    """Builds, caches and executes cuDNN frontend graphs (`cudnn.pygraph`).

    The workflow is the documented one: `pygraph(io_data_type=, intermediate_data_type=, compute_data_type=,
    handle=)`, `tensor(name=, dim=, stride=, data_type=)`, the op, `set_output(True)` + dims/strides/type of
    the outputs, `validate()`, `build_operation_graph()`, `create_execution_plans([A, FALLBACK])`,
    `deselect_numeric_notes(...)`, `check_support()`, then `build_plan_at_index(i)` and
    `get_workspace_size_plan_at_index(i)` for each engine config, and `execute_plan_at_index(variant_pack,
    workspace, index, handle=)` with device pointers (ints) in the variant pack.

    `cudnn` is the module, injected so host tests can pass a recording fake.
    """

    def __init__(self, cudnn, handle, max_plans: int = 8):
        self.cudnn = cudnn
        self.handle = handle
        self.max_plans = int(max_plans)
        self._cache: dict[cuplan.GraphKey, BuiltGraph] = {}
        _LIVE_GRAPHS.add(self)

    def __len__(self) -> int:
        return len(self._cache)

    def release(self) -> None:
        """Drop every built graph (and its tensors and plans); later `get`s build them again."""
        self._cache.clear()

    def _enum(self, enum: str, member: str):
        return getattr(getattr(self.cudnn, enum), member)

    def _new_graph(self):
        f = self._enum("data_type", "FLOAT")
        return self.cudnn.pygraph(io_data_type=f, intermediate_data_type=f, compute_data_type=f,
                                  handle=self.handle)

    def _tensor(self, g, d: cuplan.TensorDesc):
        return g.tensor(data_type=self._enum("data_type", d.dtype), **d.kwargs())

    def _output(self, t, d: cuplan.TensorDesc):
        t.set_output(True)
        t.set_dim(list(d.dim))
        t.set_stride(list(d.stride))
        t.set_data_type(self._enum("data_type", d.dtype))
        return t

    # -- graph bodies: each returns {tensor name: handle} ---------------------------------------------------
    def _conv_body(self, g, spec: cuplan.ConvSpec, op: str) -> dict[str, Any]:
        d = spec.descs()
        (a, b), out = spec.io(op)
        ta, tb = self._tensor(g, d[a]), self._tensor(g, d[b])
        kw = spec.conv_kwargs()
        if op == "fprop":
            t = g.conv_fprop(image=ta, weight=tb, name="fprop", **kw)
        elif op == "dgrad":
            t = g.conv_dgrad(loss=ta, filter=tb, name="dgrad", **kw)
        else:
            t = g.conv_wgrad(image=ta, loss=tb, name="wgrad", **kw)
        return {a: ta, b: tb, out: self._output(t, d[out])}

    def _bn_body(self, g, spec: cuplan.BNSpec, op: str) -> dict[str, Any]:
        d = spec.descs(op)
        if op == "bn_train":
            ins = {k: self._tensor(g, d[k]) for k in ("x", "scale", "bias", "running_mean", "running_var",
                                                       "epsilon", "momentum")}
            y, mean, invstd, nrm, nrv = g.batchnorm(
                name="bn", input=ins["x"], scale=ins["scale"], bias=ins["bias"],
                in_running_mean=ins["running_mean"], in_running_var=ins["running_var"],
                epsilon=ins["epsilon"], momentum=ins["momentum"])
            outs = {"y": y, "mean": mean, "invstd": invstd, "next_running_mean": nrm, "next_running_var": nrv}
        elif op == "bn_infer":
            ins = {k: self._tensor(g, d[k]) for k in ("x", "mean", "invstd", "scale", "bias")}
            y = g.batchnorm_inference(name="bn_infer", input=ins["x"], mean=ins["mean"],
                                      inv_variance=ins["invstd"], scale=ins["scale"], bias=ins["bias"])
            outs = {"y": y}
        else:
            ins = {k: self._tensor(g, d[k]) for k in ("dy", "x", "scale", "mean", "invstd")}
            dx, dscale, dbias = g.batchnorm_backward(name="bn_bwd", grad=ins["dy"], input=ins["x"],
                                                     scale=ins["scale"], mean=ins["mean"],
                                                     inv_variance=ins["invstd"])
            outs = {"dx": dx, "dscale": dscale, "dbias": dbias}
        return {**ins, **{k: self._output(t, d[k]) for k, t in outs.items()}}

    def _pointwise_body(self, g, spec: cuplan.PointwiseSpec, op: str) -> dict[str, Any]:
        d = spec.descs(op)
        if op == "relu_fwd":
            x = self._tensor(g, d["x"])
            return {"x": x, "y": self._output(g.relu(name="relu", input=x), d["y"])}
        y, dy = self._tensor(g, d["y"]), self._tensor(g, d["dy"])
        # RELU_BWD: dx = dy where input > 0. Fed the forward OUTPUT y, which is > 0 exactly where x is.
        return {"y": y, "dy": dy, "dx": self._output(g.relu_backward(name="relu_bwd", loss=dy, input=y), d["dx"])}

    def _body(self, key: cuplan.GraphKey) -> Callable[[Any], dict[str, Any]]:
        op, spec = key.op, key.spec
        if op.startswith("conv_"):
            return lambda g: self._conv_body(g, spec, op[len("conv_"):])
        if op in cuplan.BN_OPS:
            return lambda g: self._bn_body(g, spec, op)
        if op in cuplan.POINTWISE_OPS:
            return lambda g: self._pointwise_body(g, spec, op)
        raise ValueError(f"unknown graph op {op!r}")

    # -- build ---------------------------------------------------------------------------------------------
    def get(self, key: cuplan.GraphKey) -> BuiltGraph:
        """The built graph for `key`, building it on first use. Raises GraphUnsupported."""
        built = self._cache.get(key)
        if built is None:
            built = self._cache[key] = self._build(key)
        return built

    def _build(self, key: cuplan.GraphKey) -> BuiltGraph:
        body = self._body(key)
        notes = key.filters.numeric_notes()
        # First with the engine filters; if they leave nothing, without them (recorded in `relaxed`).
        attempts = [notes, ()] if notes else [()]
        errors = []
        for deselect in attempts:
            g = self._new_graph()
            tensors = body(g)
            try:
                plans = self._finalize(g, deselect)
            except GraphUnsupported as e:
                errors.append(f"{e}" + (f" (with {', '.join(deselect)} deselected)" if deselect else ""))
                continue
            return BuiltGraph(key, g, tensors, plans, tuple(n for n in notes if n not in deselect))
        # The reason first (the report keeps one line of it), the graph last.
        raise GraphUnsupported(f"cuDNN cannot run {key.op}: " + "; ".join(reversed(errors)) + f"; for {key.spec}")

    def _finalize(self, g, deselect: tuple[str, ...]) -> list[cuplan.PlanInfo]:
        g.validate()  # an error here is a malformed graph (our bug): let it propagate
        try:
            g.build_operation_graph()
            g.create_execution_plans([self._enum("heur_mode", "A"), self._enum("heur_mode", "FALLBACK")])
            if deselect:
                g.deselect_numeric_notes([self._enum("numerical_note", n) for n in deselect])
            g.check_support()
        except Exception as e:  # cudnnGraphNotSupportedError or a cuDNN status error
            raise GraphUnsupported(f"{type(e).__name__}: {one_line(str(e))}") from e
        plans: list[cuplan.PlanInfo] = []
        seen: set[str] = set()
        for i in range(int(g.get_execution_plan_count())):
            if len(plans) >= self.max_plans:
                break
            try:
                g.build_plan_at_index(index=i)
            except Exception:  # deselected, or this engine config fails to build: not an option
                continue
            # Only a built plan reports its true workspace (an unbuilt one reads as 0).
            ws = int(g.get_workspace_size_plan_at_index(index=i))
            name = self._plan_name(g, i)
            if name in seen:  # heuristics A and FALLBACK may both list the same engine config
                continue
            seen.add(name)
            plans.append(cuplan.PlanInfo(i, name, ws))
        if not plans:
            raise GraphUnsupported("no execution plan could be built")
        return plans

    @staticmethod
    def _plan_name(g, i: int) -> str:
        try:
            return str(g.get_plan_name_at_index(index=i))
        except Exception:
            return f"plan{i}"

    # -- execute -------------------------------------------------------------------------------------------
    def execute(self, built: BuiltGraph, pointers: dict[str, int], workspace_ptr: int, plan_index: int) -> None:
        """Run plan `plan_index` of `built`; `pointers` maps every tensor name to a device address (or, for a
        pass-by-value scalar, a host address)."""
        missing = sorted(set(built.tensors) - set(pointers))
        extra = sorted(set(pointers) - set(built.tensors))
        if missing or extra:
            raise ValueError(f"{built.key.op}: variant pack is missing {missing}, has unknown {extra}")
        pack = {built.tensors[name]: int(ptr) for name, ptr in pointers.items()}
        built.graph.execute_plan_at_index(pack, int(workspace_ptr), index=int(plan_index), handle=self.handle)


# ---------------------------------------------------------------------------------------------------------
# Device memory: the arena, side buffers, transfers
# ---------------------------------------------------------------------------------------------------------

class DeviceArena:
    """The tensor pool's device memory: one raw allocation; tensors are cupy views at offsets."""

    def __init__(self, cupy, nbytes: int):
        self._cupy = cupy
        self.nbytes = int(nbytes)
        self.memory = cupy.cuda.memory.Memory(self.nbytes)  # cudaMalloc: no cupy memory pool underneath
        self.ptr = int(self.memory.ptr)
        if self.nbytes:
            cuplan.check_base_alignment(self.ptr)

    def view_at(self, offset: int, shape, dtype):
        """A C-contiguous `cupy.ndarray` of `shape`/`dtype` at byte `offset` (bounds and alignment checked)."""
        s = cuplan.view_spec(offset, shape, dtype, self.nbytes)
        ptr = self._cupy.cuda.memory.MemoryPointer(self.memory, s.offset)
        return self._cupy.ndarray(s.shape, s.dtype, memptr=ptr)

    def __getitem__(self, key):
        """`arena[a:b]`: a uint8 view of bytes [a, b), so generic `arena[o:o+n].view(dt).reshape(s)` works."""
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a DeviceArena supports only contiguous byte slices arena[a:b]")
        start, stop, _ = key.indices(self.nbytes)
        return self.view_at_bytes(start, max(0, stop - start))

    def view_at_bytes(self, offset: int, nbytes: int):
        s = cuplan.view_spec(offset, (nbytes,), np.uint8, self.nbytes, alignment=1)
        ptr = self._cupy.cuda.memory.MemoryPointer(self.memory, s.offset)
        return self._cupy.ndarray(s.shape, s.dtype, memptr=ptr)

    def __len__(self) -> int:
        return self.nbytes

    @property
    def shape(self) -> tuple[int]:
        return (self.nbytes,)

    def __repr__(self) -> str:
        return f"DeviceArena({self.nbytes} bytes at {self.ptr:#x})"


class DeviceArenaBacking:
    """What the tensor pool asks for its memory (`allocate` is called once)."""

    def __init__(self, cupy):
        self._cupy = cupy

    def allocate(self, nbytes: int) -> DeviceArena:
        return DeviceArena(self._cupy, nbytes)


class _SideBuffers:
    """Small named device buffers outside the arena (per-channel / per-sample scratch, small graph workspaces).

    Each is one raw allocation, grown (never shrunk) when a larger one is asked for; the total is reported. A
    name is used by one op at a time, so buffers with different names never alias.
    """

    def __init__(self, cupy):
        self._cupy = cupy
        self._mem: dict[str, Any] = {}

    def get(self, name: str, shape, dtype):
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = max(int(np.prod(shp, dtype=np.int64)) * dt.itemsize, 1)
        mem = self._mem.get(name)
        if mem is None or mem.size < nbytes:
            if mem is not None:  # kernels still in flight may use the old buffer: wait before it is freed
                self._cupy.cuda.Device().synchronize()
            mem = self._mem[name] = self._cupy.cuda.memory.Memory(nbytes)
        return self._cupy.ndarray(shp, dt, memptr=self._cupy.cuda.memory.MemoryPointer(mem, 0))

    @property
    def nbytes(self) -> int:
        return sum(int(m.size) for m in self._mem.values())


@dataclass(slots=True)
class Transfer:
    """An asynchronous device<->host copy on the transfer stream, with the timing events around it.

    `start` and `done` are recorded on the transfer stream just before and just after the copy; `reached` is
    recorded on the compute stream by `transfer_wait`, where compute begins to wait for `done` (None while
    nobody waited). All three are timing-enabled, so `transfer_times` can measure both the copy and the stall.
    """

    kind: str    # "offload" (device -> host) or "prefetch" (host -> device)
    nbytes: int
    done: Any
    start: Any = None
    reached: Any = None


# ---------------------------------------------------------------------------------------------------------
# Fallback kernels for batch norm (cupy ElementwiseKernel / ReductionKernel), used when cuDNN has no engine
# ---------------------------------------------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class ElementwiseSource:
    """The arguments of one `cupy.ElementwiseKernel` (in params, out params, the per-element operation)."""

    in_params: str
    out_params: str
    operation: str


@dataclass(slots=True, frozen=True)
class ReductionSource:
    """The arguments of one `cupy.ReductionKernel`; `a`, `b` are the reduction's operands.

    `reduce_type` is a C type name ("double"), NOT a numpy dtype name: unlike the in/out parameters, which cupy
    parses with numpy names ("float64 s"), cupy pastes it verbatim into the generated source as
    `typedef ${reduce_type} _type_reduce;` (cupy/_core/_reduction.pyx), where "float64" does not compile."""

    in_params: str
    out_params: str
    map_expr: str
    reduce_expr: str
    post_map_expr: str
    identity: str
    reduce_type: str


#: The batch-norm fallback and channel-sum kernels. Per-channel statistics accumulate in float64 (two passes:
#: mean first, then squared deviations from it), like the CPU backend. Names beginning with `_` and `i` (cupy's
#: loop index) are reserved inside the operations; tests/backend/test_cuda_host.py compiles these with nvcc.
NORM_KERNELS: dict[str, ElementwiseSource | ReductionSource] = {
    "sum": ReductionSource("float32 x", "float64 s", "(double)x", "a + b", "s = a", "0", "double"),
    "sum_f32": ReductionSource("float32 x", "float32 s", "(double)x", "a + b", "s = (float)a", "0", "double"),
    "sqdev": ReductionSource("float32 x, float32 m", "float64 s", "(double)(x - m) * (double)(x - m)", "a + b",
                             "s = a", "0", "double"),
    "dot": ReductionSource("float32 dy, float32 x, float32 m", "float64 s", "(double)dy * (double)(x - m)",
                           "a + b", "s = a", "0", "double"),
    "mean": ElementwiseSource("float64 s, float64 inv_m", "float32 mean", "mean = (float)(s * inv_m)"),
    "invstd": ElementwiseSource("float64 ssq, float64 inv_m, float64 eps", "float32 invstd",
                                "invstd = (float)(1.0 / sqrt(ssq * inv_m + eps))"),
    "invstd_from_var": ElementwiseSource("float32 var, float64 eps", "float32 invstd",
                                         "invstd = (float)(1.0 / sqrt((double)var + eps))"),
    "running": ElementwiseSource("float64 s, float64 ssq, float64 inv_m, float64 unbias, float64 mom",
                                 "float32 rm, float32 rv",
                                 "rm = (float)((1.0 - mom) * (double)rm + mom * s * inv_m); "
                                 "rv = (float)((1.0 - mom) * (double)rv + mom * ssq * inv_m * unbias)"),
    "coef": ElementwiseSource("float32 invstd, float32 w, float32 mean, float32 b", "float32 a, float32 c",
                              "a = invstd * w; c = b - mean * a"),
    "affine": ElementwiseSource("float32 x, float32 a, float32 c", "float32 y", "y = x * a + c"),
    "bwd_coef": ElementwiseSource("float64 sdy, float64 sdyd, float32 invstd, float32 w, float64 inv_m",
                                  "float32 k, float32 g, float32 s, float32 dw, float32 db",
                                  "double inv = (double)invstd; k = (float)(inv * inv * sdyd * inv_m); "
                                  "g = (float)(sdy * inv_m); s = (float)(inv * (double)w); "
                                  "dw = (float)(sdyd * inv); db = (float)sdy"),
    "dx": ElementwiseSource("float32 x, float32 dy, float32 m, float32 k, float32 g, float32 s", "float32 dx",
                            "dx = (dy - ((x - m) * k + g)) * s"),
    "scale": ElementwiseSource("float32 dy, float32 s", "float32 dx", "dx = dy * s"),
}


class _NormKernels:
    """`NORM_KERNELS` compiled by cupy (on first use), as attributes: `k.sum(x, axis=..., out=...)`, ..."""

    def __init__(self, cupy):
        for name, src in NORM_KERNELS.items():
            if isinstance(src, ReductionSource):
                kern = cupy.ReductionKernel(src.in_params, src.out_params, src.map_expr, src.reduce_expr,
                                            src.post_map_expr, src.identity, f"minidl_{name}",
                                            reduce_type=src.reduce_type)
            else:
                kern = cupy.ElementwiseKernel(src.in_params, src.out_params, src.operation, f"minidl_{name}")
            setattr(self, name, kern)


def _device_name(cupy, device: int) -> str:
    name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _on_compute(fn):
    """Run a backend op with the compute stream current (cupy ops and cuBLAS then enqueue there)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with self.compute:
            return fn(self, *args, **kwargs)
    return wrapper


def _cublas_math_setter(cupy) -> Callable[[bool], None]:
    """A function that puts cupy's cuBLAS handle (the one `cupy.cublas.gemm` uses on this device) in TF32
    tensor-op math (True) or default math (False): cuBLAS's half of `--math tf32` (cuDNN's half is the engine
    filters)."""
    def set_tf32(on: bool) -> None:
        try:  # imported here: an fp32 run never needs it
            from cupy_backends.cuda.libs import cublas as libcublas
        except ImportError as e:
            raise CUDAUnavailable(f"--math: cannot set cuBLAS's math mode, cupy's cuBLAS bindings are not "
                                  f"importable ({e})") from e
        tf32_math = getattr(libcublas, "CUBLAS_TF32_TENSOR_OP_MATH", 3)   # cublas_api.h: = 3
        default_math = getattr(libcublas, "CUBLAS_DEFAULT_MATH", 0)
        libcublas.setMathMode(cupy.cuda.device.get_cublas_handle(), tf32_math if on else default_math)
    return set_tf32


def _chan4(v):
    """A (C,) device vector as (1, C, 1, 1), to broadcast over NCHW."""
    return v.reshape(1, -1, 1, 1)


# ---------------------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------------------

class CUDABackend(SequenceOps):
    """cupy + cuDNN frontend backend with the CPU backend's interface (see minidl/backend/cpu/backend.py).

    Options: `allow_tf32` lets cuDNN compute float32 convolutions, and cuBLAS float32 products, in TF32 (faster on
    Ampere+, ~1e-3 off the reference; `--math tf32`, see `mathmode.py` and `set_math`); `deterministic` excludes
    non-deterministic engines; `max_plans` bounds how many execution plans are built per graph (each becomes a
    workspace option); `use_cudnn_bn` / `use_cudnn_relu` choose cuDNN graphs over the fallback kernels;
    `count_stray_allocations` installs a cupy allocator hook that counts (and still serves) any allocation made
    outside the arena.
    """

    # The sequence family's kernels (`sequence.py`), no fusions, one update per parameter; host copies on copy
    # streams, the step replayed as captured graphs whose gradients are checked on the device (`guard_nonfinite`).
    capabilities = Capabilities(name="cuda", device="gpu", kernels=SEQUENCE_KERNELS, stream_copies=True,
                                graph_capture=True, device_guard=True, paged_arena=True, host_link=True)

    def __init__(self, device: int = 0, *, allow_tf32: bool = False, deterministic: bool = True,
                 max_plans: int = 8, use_cudnn_bn: bool = True, use_cudnn_relu: bool = True,
                 count_stray_allocations: bool = True):
        cupy, cupyx, cudnn = load_cuda_modules()
        from cupy import cublas

        dev = cupy.cuda.Device(int(device))
        dev.use()
        attrs = dev.attributes
        compute = cupy.cuda.Stream(non_blocking=True)
        try:
            # An int before frontend 1.3x, a `cudnn.Handle` since: used opaquely either way. This is where a missing
            # libcudnn.so.9 shows (the frontend package dlopens it and does not depend on nvidia-cudnn-cu13).
            handle = cudnn.create_handle()
        except Exception as e:
            raise CUDAUnavailable(f"the cuDNN frontend cannot create a cuDNN handle ({e}); is the cuDNN library "
                                  f"installed (`pip install nvidia-cudnn-cu13`)?") from e
        cudnn.set_stream(handle=handle, stream=compute.ptr)
        self._init_state(
            cupy=cupy, cupyx=cupyx, cudnn=cudnn, cublas=cublas, compute=compute,
            transfer=cupy.cuda.Stream(non_blocking=True), prefetch=cupy.cuda.Stream(non_blocking=True),
            graphs=CudnnGraphs(cudnn, handle, max_plans=max_plans),
            side=_SideBuffers(cupy),
            limits=cuplan.DeviceLimits(int(attrs["MaxThreadsPerBlock"]), int(attrs["MultiProcessorCount"])),
            filters=cuplan.EngineFilters(allow_tf32=allow_tf32, deterministic=deterministic),
            use_cudnn_bn=use_cudnn_bn, use_cudnn_relu=use_cudnn_relu)
        self.device = dev
        self.gpu_name = _device_name(cupy, int(device))
        self._handle = handle
        self._cublas_math = _cublas_math_setter(cupy)
        if allow_tf32:
            self._cublas_math(True)
        if count_stray_allocations:
            self._install_stray_counter()
        self._anchor()  # the transfer clock's anchor, now: the host then never blocks for it inside a step

    def _init_state(self, *, cupy, cupyx, cudnn, cublas, compute, transfer, graphs: CudnnGraphs, side, limits,
                    filters, use_cudnn_bn: bool = True, use_cudnn_relu: bool = True, prefetch=None) -> None:
        self.cp, self.cpx, self.cudnn, self._cublas = cupy, cupyx, cudnn, cublas
        self.xp = cupy
        self.device = None
        self.gpu_name = ""
        self.compute, self.transfer = compute, transfer        # transfer: the offload (device -> host) stream
        self.prefetch_stream = prefetch if prefetch is not None else transfer   # host -> device
        self.graphs, self.side = graphs, side
        self.limits, self.filters = limits, filters
        self.use_cudnn_bn, self.use_cudnn_relu = bool(use_cudnn_bn), bool(use_cudnn_relu)
        self._handle = None
        self.fallbacks: dict[str, str] = {}     # graph op -> why the fallback kernels run instead
        self._unsupported: set[cuplan.GraphKey] = set()
        self._modules: dict[str, Any] = {}      # .cu file -> cupy.RawModule
        self._kernels: dict[str, Any] = {}      # kernel name -> RawKernel
        self._norm: _NormKernels | None = None
        self._host_scalars: dict[float, np.ndarray] = {}
        self._filled: set[str] = set()
        self.stray_bytes = 0
        self.stray_allocs = 0
        self._prev_allocator = None
        self._clock_anchor: tuple[Any, float] | None = None  # (event, perf_counter) pairing the two clocks
        self._cublas_math: Callable[[bool], None] | None = None  # sets cuBLAS's TF32 math (None: host tests)
        self.graph_scalars = None  # backend/scalars.StepScalars while a graph is captured: the `_dev` kernels
        _LIVE_BACKENDS.add(self)

    @classmethod
    def from_parts(cls, **parts) -> "CUDABackend":
        """Assemble a backend from ready-made parts (the keyword arguments of `_init_state`) without touching a
        device: host tests inject fakes of cupy / the cuDNN module / streams to check the dispatch logic."""
        obj = cls.__new__(cls)
        obj._init_state(**parts)
        return obj

    @property
    def math(self) -> str:
        """The math mode (`backend/mathmode.py`): 'tf32' when cuDNN may pick TF32 engines, else 'fp32'."""
        return "tf32" if self.filters.allow_tf32 else "fp32"

    def set_math(self, math: str) -> None:
        """Switch between 'fp32' and 'tf32' (before planning: the mode decides which convolution engines, hence
        which workspace options, exist). cuDNN's engine filters and cuBLAS's math mode change together."""
        from ..mathmode import check_math

        tf32 = check_math(math) == "tf32"
        changed = tf32 != self.filters.allow_tf32
        self.filters = cuplan.EngineFilters(allow_tf32=tf32, deterministic=self.filters.deterministic)
        if changed and self._cublas_math is not None:
            self._cublas_math(tf32)

    @property
    def profile(self) -> str:
        """The simulator profile nearest this GPU (see `cuda_plan.profile_for_gpu`): the speeds a plan's timing
        decisions assume when the caller names none."""
        return cuplan.profile_for_gpu(self.gpu_name)

    # -- lifecycle / reports ------------------------------------------------------------------------------------
    def _install_stray_counter(self) -> None:
        pool = self.cp.get_default_memory_pool()

        def counting_malloc(nbytes):
            self.stray_bytes += int(nbytes)
            self.stray_allocs += 1
            return pool.malloc(nbytes)

        self._prev_allocator = pool.malloc
        self.cp.cuda.set_allocator(counting_malloc)

    def close(self) -> None:
        """Wait for all work, restore cupy's allocator and release the cuDNN graphs and handle."""
        self.synchronize()
        if self._prev_allocator is not None:
            self.cp.cuda.set_allocator(self._prev_allocator)
            self._prev_allocator = None
        self.release_cudnn()

    def release_cudnn(self) -> None:
        """Drop the built graphs, then destroy the handle they were built with (run at exit for live backends)."""
        self.graphs.release()
        handle, self._handle = self._handle, None
        if handle is not None:
            self.graphs.handle = None
            try:
                self.synchronize()
                self.cudnn.destroy_handle(handle)
            except Exception:  # at exit the device may already be gone; dropping the reference is what matters
                pass

    def memory_report(self) -> dict[str, Any]:
        """Device memory the backend uses outside the arena, and which graphs fell back to other kernels."""
        return {"side_bytes": self.side.nbytes, "stray_bytes": self.stray_bytes,
                "stray_allocs": self.stray_allocs, "cached_graphs": len(self.graphs),
                "fallbacks": dict(self.fallbacks)}

    def step_scope(self):
        """A step needs no host-side context here: the kernels run on the streams."""
        return nullcontext()

    def compute_scope(self):
        """The compute stream as the current one: cupy work done by a caller (the gradient reducer's division)
        is ordered with the kernels'."""
        return self.compute

    def synchronize(self) -> None:
        self.compute.synchronize()
        self.transfer.synchronize()
        if self.prefetch_stream is not self.transfer:
            self.prefetch_stream.synchronize()

    # -- arena -----------------------------------------------------------------------------------------------
    def arena_backing(self) -> DeviceArenaBacking:
        """The tensor pool's backing: one raw device allocation whose `view_at(offset, shape, dtype)` gives the
        cupy view of a block (the executor calls this factory once per pool)."""
        return DeviceArenaBacking(self.cp)

    def paged_backing(self):
        """The paged pool's memory (`--paged`): driver-API chunks mapped into a reserved range (`cuda_vmm`)."""
        from .vmm import VmmBacking

        return VmmBacking(self.cp, device=int(self.cp.cuda.runtime.getDevice()))

    def measure_link(self, nbytes: int | None = None, repeats: int = 3):
        """The host link's bandwidth (each direction alone and with both busy) and per-copy latency, measured on
        this backend's copy streams (`cuda_calibrate.measure_link`): what `memory/calibrate.py` builds the
        simulator's measured profile from. Blocks; call before training."""
        from .calibrate import BANDWIDTH_BYTES, measure_link

        return measure_link(self, nbytes or BANDWIDTH_BYTES, repeats)

    # -- CUDA graphs (minidl/runtime/capture.py) -----------------------------------------------------------------------
    #: The kernels a captured graph launches instead of their plain variants (backend/scalars.py).
    GRAPH_KERNELS = ("dropout_forward_dev", "dropout_backward_dev", "sgd_update_dev", "adam_update_dev",
                     "nonfinite_flag")

    @_on_compute
    def guard_nonfinite(self, x, code: int) -> None:
        """The divergence guard inside a graph: set the capture's `diverged` flag to `code` if `x` (a gradient,
        or the loss) is not finite and no earlier guarded tensor was (minidl/runtime/capture.py)."""
        self._launch(cuplan.nonfinite_flag(self.graph_scalars.diverged, x, code, self.limits))

    def prepare_graph(self) -> None:
        """Load the graph variants of the per-step kernels before a capture: loading a module or a function is
        not a stream operation, so it happens now rather than while the stream is being captured."""
        for name in self.GRAPH_KERNELS:
            self._kernel(name)

    def begin_graph(self) -> None:
        """Start capturing the compute stream: what is enqueued on it until `end_graph` is recorded, not run.
        cupy's default capture mode (relaxed) lets cupy allocate meanwhile; capture.py refuses a graph during
        whose capture `stray_bytes` grew, since such a temporary goes back to cupy's pool afterwards."""
        self.compute.begin_capture()

    def end_graph(self):
        """End the capture begun by `begin_graph`: the recorded work as a `cupy.cuda.Graph`."""
        return self.compute.end_capture()

    def launch_graph(self, graph) -> None:
        """Replay a captured graph on the compute stream (asynchronous: the host does not wait)."""
        graph.launch(stream=self.compute)

    def copy_in_async(self, dst, src: np.ndarray) -> None:
        """Copy pinned host array `src` into device view `dst` on the compute stream (a graph's batch input: the
        copy reads `src` when it runs, so the host refills the same buffer before each replay)."""
        self._check_transfer(dst, src)
        dst.set(src, stream=self.compute)

    def copy_out_async(self, src, dst: np.ndarray) -> None:
        """Copy device view `src` into pinned host array `dst` on the compute stream (a graph's loss output)."""
        self._check_transfer(src, dst)
        src.get(stream=self.compute, out=dst, blocking=False)

    def scalar_buffer(self, name: str, n: int, dtype):
        """A small device array outside the arena (a side buffer) for a graph's per-step scalars."""
        return self.side.get(name, (int(n),), dtype)

    def wait_compute(self) -> None:
        """Block the host until the compute stream is idle (after a step's graphs, to read the loss)."""
        self.compute.synchronize()

    # -- host transfers (offload / prefetch) -----------------------------------------------------------------
    def host_empty(self, shape, dtype) -> np.ndarray:
        """A numpy array in pinned (page-locked) host memory: the host store's buffers."""
        return self.cpx.empty_pinned(shape, dtype=dtype)

    def offload_async(self, src, dst: np.ndarray) -> Transfer:
        """Copy device view `src` into host array `dst` on the transfer stream, after every kernel already
        enqueued on the compute stream (which may still be writing `src`). Returns at once."""
        self._check_transfer(src, dst)
        self._anchor()  # before the first copy: every transfer event is then later than the anchor
        ready = self._event()
        ready.record(self.compute)
        self.transfer.wait_event(ready)
        start = self._record(self.transfer, timing=True)
        src.get(stream=self.transfer, out=dst, blocking=False)
        return Transfer("offload", int(src.nbytes), self._record(self.transfer, timing=True), start)

    def prefetch_async(self, src: np.ndarray, dst) -> Transfer:
        """Copy host array `src` into device view `dst` on the prefetch stream, after every kernel already
        enqueued on the compute stream (the block's previous tenant may still be in use). Returns at once."""
        self._check_transfer(dst, src)
        self._anchor()
        stream = self.prefetch_stream
        ready = self._event()
        ready.record(self.compute)
        stream.wait_event(ready)
        start = self._record(stream, timing=True)
        dst.set(src, stream=stream)
        return Transfer("prefetch", int(dst.nbytes), self._record(stream, timing=True), start)

    def transfer_wait(self, t: Transfer) -> None:
        """Make the compute stream wait for `t` (device-side: the host does not block). Call before a kernel
        reads a prefetched tensor, and before an offloaded tensor's block is reused.

        The `reached` event marks where compute starts waiting, so `transfer_times` can tell how long it stalled.
        """
        t.reached = self._record(self.compute, timing=True)
        self.compute.wait_event(t.done)

    def transfer_sync(self, t: Transfer) -> None:
        """Block the host until `t` has completed (e.g. before reading or reusing its host buffer)."""
        t.done.synchronize()

    @staticmethod
    def transfer_done(t: Transfer) -> bool:
        return bool(t.done.done)

    def transfer_times(self, t: Transfer) -> tuple[float, float, float]:
        """(start_s, end_s, stall_s) of transfer `t`, in seconds; blocks until the copy (and the compute stream's
        wait for it, if any) has happened.

        These are device times mapped onto the host's `time.perf_counter` clock: the first transfer records an
        anchor event on the compute stream, synchronizes it and reads `perf_counter()` right after (once per
        backend, before any transfer event exists, so every elapsed time read from it is positive), and every
        time is then the anchor's host time plus `get_elapsed_time(anchor, event)`. The offset is approximate
        (the host wakes up a few microseconds after the anchor completes, and the clocks may drift apart over a
        long run), the durations exact: both ends are device timestamps. `stall_s` is how long the compute
        stream sat at `transfer_wait` before the copy completed, elapsed(reached, done), clamped at 0 when the
        copy was done first; 0 when nobody waited.
        """
        t.done.synchronize()
        anchor, anchor_s = self._anchor()
        ms = self.cp.cuda.get_elapsed_time  # milliseconds from its first event to its second
        start_s = anchor_s + ms(anchor, t.start) / 1e3
        end_s = anchor_s + ms(anchor, t.done) / 1e3
        stall_s = 0.0
        if t.reached is not None:
            t.reached.synchronize()  # recorded on the compute stream, which may still be behind
            stall_s = max(0.0, ms(t.reached, t.done) / 1e3)
        return start_s, end_s, stall_s

    def _anchor(self) -> tuple[Any, float]:
        """A completed compute-stream event and the `perf_counter()` time just after it (made once, by the first
        transfer)."""
        if self._clock_anchor is None:
            ev = self._record(self.compute, timing=True)
            ev.synchronize()
            self._clock_anchor = (ev, time.perf_counter())
        return self._clock_anchor

    def _event(self, timing: bool = False):
        """A CUDA event; timing only where it is measured (a timing event costs more to record and wait on)."""
        return self.cp.cuda.Event(disable_timing=not timing)

    def _record(self, stream, timing: bool = False):
        ev = self._event(timing)
        ev.record(stream)
        return ev

    @staticmethod
    def _check_transfer(dev, host) -> None:
        if not isinstance(host, np.ndarray):
            raise TypeError(f"host side of a transfer must be a numpy array, got {type(host).__name__}")
        if tuple(dev.shape) != tuple(host.shape) or np.dtype(dev.dtype) != host.dtype:
            raise ValueError(f"transfer between {tuple(dev.shape)} {dev.dtype} (device) and {host.shape} "
                             f"{host.dtype} (host): shapes and dtypes must match")
        if not host.flags.c_contiguous:
            raise ValueError("host side of a transfer must be C-contiguous")

    # -- helpers ---------------------------------------------------------------------------------------------
    def _check(self, op: str, dtype: np.dtype = _F32, **arrays) -> None:
        """Arrays given (not None) must be C-contiguous device arrays of `dtype`."""
        for name, a in arrays.items():
            if a is None:
                continue
            if not isinstance(a, self.cp.ndarray):
                raise TypeError(f"{op}: {name} must be a cupy array on the device, got {type(a).__name__}")
            if a.dtype != dtype:
                raise TypeError(f"{op}: {name} must be {dtype}, got {a.dtype} (the CUDA backend is float32 with "
                                f"int64 labels)")
            if not a.flags.c_contiguous:
                raise ValueError(f"{op}: {name} must be C-contiguous")

    @staticmethod
    def _ptr(a) -> int:
        return int(a.data.ptr)

    def _kernel(self, name: str):
        k = self._kernels.get(name)
        if k is None:
            file = ks.KERNELS[name].file
            mod = self._modules.get(file)
            if mod is None:
                mod = self._modules[file] = self.cp.RawModule(code=ks.source_path(file).read_text())
            k = self._kernels[name] = mod.get_function(name)
        return k

    def _launch(self, launch: cuplan.KernelLaunch) -> None:
        self._kernel(launch.name)(launch.grid, launch.block, launch.args, stream=self.compute)

    def _norm_kernels(self) -> _NormKernels:
        if self._norm is None:
            self._norm = _NormKernels(self.cp)
        return self._norm

    def _graph(self, key: cuplan.GraphKey) -> BuiltGraph | None:
        """The built graph, or None when cuDNN cannot run it (reason recorded in `fallbacks`)."""
        if key in self._unsupported:
            return None
        try:
            return self.graphs.get(key)
        except GraphUnsupported as e:
            self._unsupported.add(key)
            self.fallbacks[key.op] = one_line(str(e))
            return None

    def _run_graph(self, built: BuiltGraph, arrays: dict[str, Any], scalars: dict[str, float] | None = None):
        """Execute the heuristics' first plan of a small graph (BN, ReLU) with a side-buffer workspace."""
        plan = built.plans[0]
        pointers = {name: self._ptr(a) for name, a in arrays.items()}
        for name, value in (scalars or {}).items():
            pointers[name] = self._host_scalar(value).ctypes.data
        ws = self.side.get("graph_workspace", (plan.workspace_bytes,), np.uint8) if plan.workspace_bytes else None
        self.graphs.execute(built, pointers, self._ptr(ws) if ws is not None else 0, plan.index)

    def _host_scalar(self, value: float) -> np.ndarray:
        """A float32 host scalar passed by value to cuDNN, kept alive for the backend's lifetime."""
        a = self._host_scalars.get(float(value))
        if a is None:
            a = self._host_scalars[float(value)] = np.full((1, 1, 1, 1), value, np.float32)
        return a

    def _constant(self, name: str, n: int, value: float):
        """A cached device vector of `n` copies of `value` (ones/zeros for a BN without affine parameters)."""
        key = f"{name}{n}"
        buf = self.side.get(key, (n,), np.float32)
        if key not in self._filled:
            buf.fill(value)
            self._filled.add(key)
        return buf

    # -- memory helpers --------------------------------------------------------------------------------------
    def to_host(self, a) -> np.ndarray:
        if isinstance(a, np.ndarray):
            return a
        self.compute.synchronize()
        return a.get(stream=self.compute)

    @_on_compute
    def copy_in(self, dst, src) -> None:
        if isinstance(src, self.cp.ndarray):
            self.cp.copyto(dst, src.reshape(dst.shape))
            return
        # np.asarray + copy, not np.ascontiguousarray: that one returns at least 1-d, so a 0-d source (a loss
        # delta) became shape (1,) and cupy's set() refused it for the 0-d destination.
        host = np.asarray(src, dtype=dst.dtype).reshape(dst.shape)
        if not host.flags.c_contiguous:
            host = host.copy(order="C")
        # Pageable host memory: the copy is staged before memcpyAsync returns, so `host` may die afterwards.
        dst.set(host, stream=self.compute)

    @_on_compute
    def fill(self, dst, value: float) -> None:
        dst.fill(value)

    @_on_compute
    def accumulate(self, dst, src) -> None:
        if dst.dtype == _F32 and src.dtype == _F32 and dst.flags.c_contiguous and src.flags.c_contiguous:
            self._launch(cuplan.accumulate(dst, src, self.limits))
        else:
            self.cp.add(dst, src, out=dst)

    @_on_compute
    def copy(self, dst, src) -> None:
        self.cp.copyto(dst, src)

    # -- activation ------------------------------------------------------------------------------------------
    @_on_compute
    def relu_forward(self, x, y) -> None:
        self._check("relu_forward", x=x, y=y)
        built = self._graph(cuplan.PointwiseSpec.from_shape(x.shape, x.dtype).key("relu_fwd", self.filters)) \
            if self.use_cudnn_relu and x.size else None
        if built is not None:
            self._run_graph(built, {"x": x, "y": y})
        else:
            self._launch(cuplan.relu_forward(y, x, self.limits))

    @_on_compute
    def relu_backward(self, y, dy, dx) -> None:
        self._check("relu_backward", y=y, dy=dy, dx=dx)
        built = self._graph(cuplan.PointwiseSpec.from_shape(y.shape, y.dtype).key("relu_bwd", self.filters)) \
            if self.use_cudnn_relu and y.size else None
        if built is not None:
            self._run_graph(built, {"y": y, "dy": dy, "dx": dx})
        else:
            self._launch(cuplan.relu_backward(dx, y, dy, self.limits))

    # -- joins -----------------------------------------------------------------------------------------------
    @_on_compute
    def add_forward(self, xs: list, y) -> None:
        self._check("add_forward", y=y, **{f"x{i}": x for i, x in enumerate(xs)})
        self._launch(cuplan.add_forward(y, xs[0], xs[1], self.limits))
        for x in xs[2:]:
            self._launch(cuplan.add_forward(y, y, x, self.limits))  # out may alias an input

    @_on_compute
    def concat_forward(self, xs: list, y) -> None:
        self._check("concat_forward", y=y, **{f"x{i}": x for i, x in enumerate(xs)})
        c = 0
        for x in xs:
            self._launch(cuplan.concat_copy_forward(y, x, c, self.limits))
            c += x.shape[1]

    @_on_compute
    def concat_backward(self, dy, dxs: list, channels: list[int]) -> None:
        self._check("concat_backward", dy=dy, **{f"dx{i}": d for i, d in enumerate(dxs)})
        c = 0
        for dx, ch in zip(dxs, channels):
            if dx is not None:
                self._launch(cuplan.concat_copy_backward(dx, dy, c, self.limits))
            c += ch

    # -- dense (cuBLAS through cupy.cublas.gemm: writes straight into the given views) ----------------------
    @_on_compute
    def linear_forward(self, x, w, b, y) -> None:
        self._check("linear_forward", x=x, w=w, b=b, y=y)
        self._cublas.gemm("N", "T", x.reshape(x.shape[0], -1), w, out=y)
        if b is not None:
            self.cp.add(y, b, out=y)

    @_on_compute
    def linear_backward(self, x, w, dy, dx, dw, db) -> None:
        self._check("linear_backward", x=x, w=w, dy=dy, dx=dx, dw=dw, db=db)
        if dx is not None:
            self._cublas.gemm("N", "N", dy, w, out=dx.reshape(dx.shape[0], -1))
        if dw is not None:
            self._cublas.gemm("T", "N", dy, x.reshape(x.shape[0], -1), out=dw)
        if db is not None:
            self._norm_kernels().sum_f32(dy, axis=0, out=db)

    # -- dropout ---------------------------------------------------------------------------------------------
    # While a graph is captured (`graph_scalars` set) the key is read from its device slot (backend/scalars.py).
    @_on_compute
    def dropout_forward(self, x, y, p: float, key: int) -> None:
        self._check("dropout_forward", x=x, y=y)
        gs = self.graph_scalars
        self._launch(cuplan.dropout_forward(y, x, p, key, self.limits) if gs is None else
                     cuplan.dropout_forward_dev(y, x, p, gs.key_slot(key), self.limits))

    @_on_compute
    def dropout_backward(self, dy, dx, p: float, key: int) -> None:
        self._check("dropout_backward", dy=dy, dx=dx)
        gs = self.graph_scalars
        self._launch(cuplan.dropout_backward(dx, dy, p, key, self.limits) if gs is None else
                     cuplan.dropout_backward_dev(dx, dy, p, gs.key_slot(key), self.limits))

    # -- loss ------------------------------------------------------------------------------------------------
    @_on_compute
    def softmax_xent_forward(self, logits, labels, loss) -> None:
        self._check("softmax_xent_forward", logits=logits, loss=loss)
        self._check("softmax_xent_forward", _I64, labels=labels)
        n = logits.shape[0]
        rows = self.side.get("xent_rows", (n,), np.float32)
        self._launch(cuplan.softmax_xent_forward(rows, logits, labels, self.limits))
        self._launch(cuplan.softmax_xent_mean(loss, rows, n, self.limits))

    @_on_compute
    def softmax_xent_backward(self, logits, labels, dloss, dlogits) -> None:
        self._check("softmax_xent_backward", logits=logits, dloss=dloss, dlogits=dlogits)
        self._check("softmax_xent_backward", _I64, labels=labels)
        n = logits.shape[0]
        # scale = 1/N in the kernel, then * dloss on the device: no device->host sync to read dloss.
        self._launch(cuplan.softmax_xent_backward(dlogits, logits, labels, 1.0 / n, self.limits))
        self.cp.multiply(dlogits, dloss.reshape(()), out=dlogits)

    # -- optimizers ------------------------------------------------------------------------------------------
    @_on_compute
    def sgd_update(self, p, g, buf, lr, momentum, dampening, weight_decay, nesterov, first_step) -> None:
        self._check("sgd_update", p=p, g=g, buf=buf)
        gs = self.graph_scalars  # capturing: the learning rate from its device slot (a schedule changes it)
        if gs is not None:
            self._launch(cuplan.sgd_update_dev(p, g, buf, gs.lr_slot(lr), momentum, dampening, weight_decay,
                                               nesterov, first_step, gs.diverged, self.limits))
            return
        self._launch(cuplan.sgd_update(p, g, buf, lr, momentum, dampening, weight_decay, nesterov, first_step,
                                       self.limits))

    @_on_compute
    def adam_update(self, p, g, m, v, lr, beta1, beta2, eps, weight_decay, step) -> None:
        self._check("adam_update", p=p, g=g, m=m, v=v)
        gs = self.graph_scalars  # capturing: lr and the step (bias corrections) from their device slots
        if gs is not None:
            self._launch(cuplan.adam_update_dev(p, g, m, v, gs.adam_slot(lr, step), beta1, beta2, eps, weight_decay,
                                                gs.diverged, self.limits))
            return
        self._launch(cuplan.adam_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, self.limits))

    # -- convolution (cuDNN graphs; the planner picks the execution plan) -----------------------------------
    def _conv_graph(self, op: str, spec: cuplan.ConvSpec) -> BuiltGraph:
        return self.graphs.get(spec.key(op, self.filters))  # no fallback: GraphUnsupported propagates

    def conv_workspace_options(self, phase: str, x_shape, w_shape, y_shape, stride, padding, dilation,
                               groups: int, dtype=np.float32) -> list[WorkspaceOption]:
        """The convolution's algorithms for `phase` ('fwd' or 'bwd') with their exact workspace bytes, fastest
        first: what `Conv2d.workspace_options` returns on the CPU. Builds (and caches) the cuDNN graphs."""
        spec = cuplan.ConvSpec.from_shapes(x_shape, w_shape, y_shape, stride, padding, dilation, groups, dtype)
        if phase == "fwd":
            plans = {"fprop": self._conv_graph("fprop", spec).plans}
        elif phase == "bwd":
            plans = {"dgrad": self._conv_graph("dgrad", spec).plans, "wgrad": self._conv_graph("wgrad", spec).plans}
        else:
            raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
        return cuplan.conv_options(phase, plans)

    def _workspace(self, op: str, workspace) -> tuple[int, int]:
        if workspace is None:
            return 0, 0
        self._check(op, np.dtype(np.uint8), workspace=workspace)
        return self._ptr(workspace), int(workspace.nbytes)

    @staticmethod
    def _choose(built: BuiltGraph, phase: str, algo: str | None, which: int, ws_bytes: int) -> cuplan.PlanInfo:
        if algo is None:  # e.g. a recomputation: the heuristics' first plan that fits what was handed in
            return cuplan.pick_plan(built.plans, ws_bytes)
        plan = built.plan(cuplan.parse_conv_algo(phase, algo)[which])
        if plan.workspace_bytes > ws_bytes:
            raise ValueError(f"conv2d {phase}: algorithm {algo!r} ({built.key.op} plan {plan.index}, "
                             f"{plan.name}) needs a workspace of {plan.workspace_bytes} bytes, got {ws_bytes}")
        return plan

    @_on_compute
    def conv2d_forward(self, x, w, b, y, stride, padding, dilation, groups: int, algo: str | None,
                       workspace) -> None:
        self._check("conv2d_forward", x=x, w=w, b=b, y=y)
        spec = cuplan.ConvSpec.from_shapes(x.shape, w.shape, y.shape, stride, padding, dilation, groups, x.dtype)
        ws_ptr, ws_bytes = self._workspace("conv2d_forward", workspace)
        g = self._conv_graph("fprop", spec)
        plan = self._choose(g, "fwd", algo, 0, ws_bytes)
        self.graphs.execute(g, {"x": self._ptr(x), "w": self._ptr(w), "y": self._ptr(y)}, ws_ptr, plan.index)
        if b is not None:
            self.cp.add(y, _chan4(b), out=y)

    @_on_compute
    def conv2d_backward(self, x, w, dy, dx, dw, db, stride, padding, dilation, groups: int, algo: str | None,
                        workspace) -> None:
        self._check("conv2d_backward", x=x, w=w, dy=dy, dx=dx, dw=dw, db=db)
        spec = cuplan.ConvSpec.from_shapes(x.shape, w.shape, dy.shape, stride, padding, dilation, groups,
                                           x.dtype)
        ws_ptr, ws_bytes = self._workspace("conv2d_backward", workspace)
        if dx is not None:
            g = self._conv_graph("dgrad", spec)
            plan = self._choose(g, "bwd", algo, 0, ws_bytes)
            self.graphs.execute(g, {"y": self._ptr(dy), "w": self._ptr(w), "x": self._ptr(dx)}, ws_ptr,
                                plan.index)
        if dw is not None:  # same stream, so it reuses the workspace after dgrad is done with it
            g = self._conv_graph("wgrad", spec)
            plan = self._choose(g, "bwd", algo, 1, ws_bytes)
            self.graphs.execute(g, {"x": self._ptr(x), "y": self._ptr(dy), "w": self._ptr(dw)}, ws_ptr,
                                plan.index)
        if db is not None:
            self._norm_kernels().sum_f32(dy, axis=(0, 2, 3), out=db)

    # -- pooling (kernels/pool.cu) ---------------------------------------------------------------------------
    @_on_compute
    def maxpool2d_forward(self, x, y, kernel, stride, padding, dilation) -> None:
        self._check("maxpool2d_forward", x=x, y=y)
        self._launch(cuplan.maxpool2d_forward(y, x, kernel, stride, padding, dilation, self.limits))

    @_on_compute
    def maxpool2d_backward(self, x, dy, dx, kernel, stride, padding, dilation) -> None:
        self._check("maxpool2d_backward", x=x, dy=dy, dx=dx)
        launch = cuplan.maxpool2d_backward(dx, dy, x, kernel, stride, padding, dilation, self.limits)
        dx.fill(0)  # the kernel scatters with atomicAdd (cuda_plan.ZERO_OUTPUT_FIRST)
        self._launch(launch)

    @_on_compute
    def avgpool2d_forward(self, x, y, kernel, stride, padding, count_include_pad: bool) -> None:
        self._check("avgpool2d_forward", x=x, y=y)
        self._launch(cuplan.avgpool2d_forward(y, x, kernel, stride, padding, count_include_pad, 0, self.limits))

    @_on_compute
    def avgpool2d_backward(self, dy, dx, kernel, stride, padding, count_include_pad: bool) -> None:
        self._check("avgpool2d_backward", dy=dy, dx=dx)
        self._launch(cuplan.avgpool2d_backward(dx, dy, kernel, stride, padding, count_include_pad, 0,
                                               self.limits))

    @_on_compute
    def global_avgpool_forward(self, x, y) -> None:
        self._check("global_avgpool_forward", x=x, y=y)
        self._launch(cuplan.global_avgpool_forward(y, x, self.limits))

    @_on_compute
    def global_avgpool_backward(self, dy, dx) -> None:
        self._check("global_avgpool_backward", dy=dy, dx=dx)
        self._launch(cuplan.global_avgpool_backward(dx, dy, self.limits))

    # -- LRN (kernels/elementwise.cu) ------------------------------------------------------------------------
    @_on_compute
    def lrn_forward(self, x, y, size: int, alpha: float, beta: float, k: float) -> None:
        self._check("lrn_forward", x=x, y=y)
        self._launch(cuplan.lrn_forward(y, x, size, alpha, beta, k, self.limits))

    @_on_compute
    def lrn_backward(self, x, y, dy, dx, size: int, alpha: float, beta: float, k: float) -> None:
        self._check("lrn_backward", x=x, y=y, dy=dy, dx=dx)
        self._launch(cuplan.lrn_backward(dx, x, y, dy, size, alpha, beta, k, self.limits))

    # -- batch normalization (cuDNN graphs, cupy kernels as the fallback) -----------------------------------
    def _bn_graph(self, op: str, spec: cuplan.BNSpec) -> BuiltGraph | None:
        return self._graph(spec.key(op, self.filters)) if self.use_cudnn_bn else None

    def _affine(self, weight, bias, c: int):
        scale = weight if weight is not None else self._constant("ones", c, 1.0)
        shift = bias if bias is not None else self._constant("zeros", c, 0.0)
        return scale, shift

    @_on_compute
    def batchnorm_forward_train(self, x, weight, bias, running_mean, running_var, y, mean, invstd,
                                momentum: float, eps: float, update_running: bool = True) -> None:
        self._check("batchnorm_forward_train", x=x, weight=weight, bias=bias, running_mean=running_mean,
                    running_var=running_var, y=y, mean=mean, invstd=invstd)
        spec = cuplan.BNSpec.from_shape(x.shape, x.dtype)
        if spec.count < 2:
            raise ValueError(f"batch norm in training needs more than one value per channel, got input {x.shape}")
        c = spec.channels
        built = self._bn_graph("bn_train", spec)
        if built is not None:
            scale, shift = self._affine(weight, bias, c)
            if update_running:
                nrm, nrv = running_mean, running_var  # read and updated in place, as in cuDNN's own samples
            else:
                nrm = self.side.get("bn_next_mean", (c,), np.float32)
                nrv = self.side.get("bn_next_var", (c,), np.float32)
            self._run_graph(built, {"x": x, "y": y, "scale": scale, "bias": shift, "running_mean": running_mean,
                                    "running_var": running_var, "next_running_mean": nrm, "next_running_var": nrv,
                                    "mean": mean, "invstd": invstd},
                            scalars={"epsilon": eps, "momentum": momentum})
            return
        k = self._norm_kernels()
        m = spec.count
        s = self.side.get("bn_sum", (c,), np.float64)
        ssq = self.side.get("bn_ssq", (c,), np.float64)
        k.sum(x, axis=(0, 2, 3), out=s)
        k.mean(s, 1.0 / m, mean)
        k.sqdev(x, _chan4(mean), axis=(0, 2, 3), out=ssq)
        k.invstd(ssq, 1.0 / m, float(eps), invstd)
        if update_running:
            k.running(s, ssq, 1.0 / m, m / (m - 1), float(momentum), running_mean, running_var)
        self._bn_apply_fallback(x, weight, bias, mean, invstd, y)

    def _bn_apply_fallback(self, x, weight, bias, mean, invstd, y) -> None:
        k = self._norm_kernels()
        c = x.shape[1]
        scale, shift = self._affine(weight, bias, c)
        a = self.side.get("bn_a", (c,), np.float32)
        b = self.side.get("bn_b", (c,), np.float32)
        k.coef(invstd, scale, mean, shift, a, b)
        k.affine(x, _chan4(a), _chan4(b), y)

    @_on_compute
    def batchnorm_forward_apply(self, x, weight, bias, mean, invstd, y) -> None:
        self._check("batchnorm_forward_apply", x=x, weight=weight, bias=bias, mean=mean, invstd=invstd, y=y)
        built = self._bn_graph("bn_infer", cuplan.BNSpec.from_shape(x.shape, x.dtype))
        if built is None:
            self._bn_apply_fallback(x, weight, bias, mean, invstd, y)
            return
        scale, shift = self._affine(weight, bias, x.shape[1])
        self._run_graph(built, {"x": x, "y": y, "mean": mean, "invstd": invstd, "scale": scale, "bias": shift})

    @_on_compute
    def batchnorm_forward_eval(self, x, weight, bias, running_mean, running_var, y, eps: float) -> None:
        self._check("batchnorm_forward_eval", x=x, weight=weight, bias=bias, running_mean=running_mean,
                    running_var=running_var, y=y)
        inv = self.side.get("bn_eval_invstd", (x.shape[1],), np.float32)
        self._norm_kernels().invstd_from_var(running_var, float(eps), inv)
        self.batchnorm_forward_apply(x, weight, bias, running_mean, inv, y)

    @_on_compute
    def batchnorm_backward(self, x, weight, dy, mean, invstd, dx, dweight, dbias) -> None:
        self._check("batchnorm_backward", x=x, weight=weight, dy=dy, mean=mean, invstd=invstd, dx=dx,
                    dweight=dweight, dbias=dbias)
        spec = cuplan.BNSpec.from_shape(x.shape, x.dtype)
        c = spec.channels
        built = self._bn_graph("bn_backward", spec) if dx is not None else None
        if built is not None:
            scale, _ = self._affine(weight, None, c)
            dw = dweight if dweight is not None else self.side.get("bn_dscale", (c,), np.float32)
            db = dbias if dbias is not None else self.side.get("bn_dbias", (c,), np.float32)
            self._run_graph(built, {"x": x, "dy": dy, "dx": dx, "scale": scale, "mean": mean, "invstd": invstd,
                                    "dscale": dw, "dbias": db})
            return
        self._bn_backward_fallback(x, weight, dy, mean, invstd, dx, dweight, dbias, spec)

    def _bn_backward_fallback(self, x, weight, dy, mean, invstd, dx, dweight, dbias, spec, batch_stats=True):
        k = self._norm_kernels()
        c, m = spec.channels, spec.count
        sdy = self.side.get("bn_sdy", (c,), np.float64)
        sdyd = self.side.get("bn_sdyd", (c,), np.float64)
        k.sum(dy, axis=(0, 2, 3), out=sdy)
        k.dot(dy, x, _chan4(mean), axis=(0, 2, 3), out=sdyd)
        scale, _ = self._affine(weight, None, c)
        kk = self.side.get("bn_k", (c,), np.float32)
        g = self.side.get("bn_g", (c,), np.float32)
        s = self.side.get("bn_s", (c,), np.float32)
        dw = dweight if dweight is not None else self.side.get("bn_dscale", (c,), np.float32)
        db = dbias if dbias is not None else self.side.get("bn_dbias", (c,), np.float32)
        k.bwd_coef(sdy, sdyd, invstd, scale, 1.0 / m, kk, g, s, dw, db)
        if dx is None:
            return
        if batch_stats:
            k.dx(x, dy, _chan4(mean), _chan4(kk), _chan4(g), _chan4(s), dx)
        else:  # fixed statistics: a per-channel affine map, dx = dy * weight * invstd
            k.scale(dy, _chan4(s), dx)

    @_on_compute
    def batchnorm_backward_eval(self, x, weight, dy, running_mean, running_var, eps: float, dx, dweight,
                                dbias) -> None:
        """Backward with the running statistics (no cuDNN op covers it): cupy kernels."""
        self._check("batchnorm_backward_eval", x=x, weight=weight, dy=dy, running_mean=running_mean,
                    running_var=running_var, dx=dx, dweight=dweight, dbias=dbias)
        spec = cuplan.BNSpec.from_shape(x.shape, x.dtype)
        inv = self.side.get("bn_eval_invstd", (spec.channels,), np.float32)
        self._norm_kernels().invstd_from_var(running_var, float(eps), inv)
        self._bn_backward_fallback(x, weight, dy, running_mean, inv, dx, dweight, dbias, spec, batch_stats=False)
