"""The CUDA backend: cupy arrays inside one device arena, cuDNN frontend graphs, and minidl's own kernels.

Rules: importing needs neither cupy nor cuDNN (construction raises `CUDAUnavailable`). The budget is the arena, one
raw `cudaMalloc`; outside it only `_SideBuffers`, handles and counted strays. Compute, offloads and prefetches run on
a stream each, ordered by events. `CudnnGraphs` alone calls the cuDNN frontend; BN and ReLU may fall back
(`fallbacks` says why), convolutions fail loudly. float32 data (in `--math bf16|fp16` also the mode's half
storage: `halves`), int64 labels, else TypeError.
"""
from __future__ import annotations

import atexit
import os
import re
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from ...core import startup
from ...core.errors import MinidlError
from ...core.user_cache import cache_folder, writable
from ..base import Capabilities
from ..precision import HALF_DTYPES, precision
from . import cudnn_specs, halves, launches, norm, views
from . import kernel_specs as ks
from .conv import ConvOps
from .copies import CopyOps, Transfer
from .cudnn_graphs import LIVE_GRAPHS, BuiltGraph, CudnnGraphs, GraphUnsupported, one_line
from .dense import DenseOps
from .norm import NormOps
from .ops import F32, on_compute
from .plan_cache import PlanEnv, PlanStore
from .pointwise import PointwiseOps
from .sequence import SEQUENCE_KERNELS, SequenceOps
from .update import UpdateOps

__all__ = ["CUDABackend", "CUDAUnavailable", "CudnnGraphs", "BuiltGraph", "GraphUnsupported", "DeviceArena",
           "DeviceArenaBacking", "Transfer", "load_cuda_modules", "NORM_KERNELS", "ElementwiseSource",
           "ReductionSource"]

class CUDAUnavailable(MinidlError, RuntimeError):
    """cupy, the cuDNN frontend or a CUDA device is missing."""


def load_cuda_modules() -> tuple[Any, Any, Any]:
    """Import (cupy, cupyx, cudnn) and check that a device is visible, or raise CUDAUnavailable."""
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


#: Every CUDABackend alive, released at exit.
_LIVE_BACKENDS: "weakref.WeakSet[CUDABackend]" = weakref.WeakSet()


def _release_all() -> None:
    """atexit: drop cuDNN graphs and handles while the cudnn module exists (else nanobind reports leaks)."""
    for be in list(_LIVE_BACKENDS):
        be.release_cudnn()
    for graphs in list(LIVE_GRAPHS):
        graphs.release()


atexit.register(_release_all)


class DeviceArena:
    """The tensor pool's device memory: one raw allocation; tensors are cupy views at offsets."""

    def __init__(self, cupy, nbytes: int):
        self._cupy = cupy
        self.nbytes = int(nbytes)
        self.memory = cupy.cuda.memory.Memory(self.nbytes)  # cudaMalloc: no cupy memory pool underneath
        self.ptr = int(self.memory.ptr)
        if self.nbytes:
            views.check_base_alignment(self.ptr)

    def view_at(self, offset: int, shape, dtype):
        """A C-contiguous `cupy.ndarray` of `shape`/`dtype` at byte `offset` (bounds and alignment checked)."""
        s = views.view_spec(offset, shape, dtype, self.nbytes)
        ptr = self._cupy.cuda.memory.MemoryPointer(self.memory, s.offset)
        return self._cupy.ndarray(s.shape, s.dtype, memptr=ptr)

    def __getitem__(self, key):
        """`arena[a:b]`: a uint8 view of bytes [a, b)."""
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a DeviceArena supports only contiguous byte slices arena[a:b]")
        start, stop, _ = key.indices(self.nbytes)
        return self.view_at_bytes(start, max(0, stop - start))

    def view_at_bytes(self, offset: int, nbytes: int):
        s = views.view_spec(offset, (nbytes,), np.uint8, self.nbytes, alignment=1)
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
    """Named device scratch outside the arena, each grown (never shrunk) on demand. A name is used by one op at
    a time, so different names never alias."""

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



@dataclass(slots=True, frozen=True)
class ElementwiseSource:
    """The arguments of one `cupy.ElementwiseKernel`; `preamble` holds the device functions its operation calls."""

    in_params: str
    out_params: str
    operation: str
    preamble: str = ""


@dataclass(slots=True, frozen=True)
class ReductionSource:
    """The arguments of one `cupy.ReductionKernel`. `reduce_type` is a C type name ("double"): cupy pastes it
    verbatim into a typedef (cupy/_core/_reduction.pyx), where a numpy name does not compile."""

    in_params: str
    out_params: str
    map_expr: str
    reduce_expr: str
    post_map_expr: str
    identity: str
    reduce_type: str


#: float32 -> bf16 bits, to nearest even, a NaN staying a quiet NaN: kernels/*.cu's `store(bf16*, ...)`.
BF16_ROUND = """
__device__ __forceinline__ unsigned short minidl_bf16_bits(float v)
{
    const unsigned int u = __float_as_uint(v);
    return (u & 0x7fffffffu) > 0x7f800000u
        ? (unsigned short)((u >> 16) | 0x40u)
        : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
"""

#: Batch-norm fallback kernels in float32: statistics in float64, mean then squared deviations (as the CPU
#: backend); the channel sums of bias gradients.
_NORM_F32: dict[str, ElementwiseSource | ReductionSource] = {
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

#: The float32 kernels with half forms (`halves.variant`), by the arguments those hold in half storage: a half
#: batch norm's fallback, and the bias gradients of half convolutions and products (`sum_f32`).
_NORM_HALF_ARGS: dict[str, tuple[str, ...]] = {
    "sum": ("x",), "sum_f32": ("x",), "sqdev": ("x",), "dot": ("dy", "x"), "affine": ("x", "y"),
    "dx": ("x", "dy", "dx"), "scale": ("dy", "dx")}
#: A half argument's device type, its exact float32 value, and a float32 result stored into it, by half.
_HALF_TYPE = {"bf16": "uint16", "fp16": "float16"}
_HALF_READ = {"bf16": "(__uint_as_float((unsigned int){} << 16))", "fp16": "((float){})"}
_HALF_STORE = {"bf16": "minidl_bf16_bits({})", "fp16": "{}"}


def _half_form(src: ElementwiseSource | ReductionSource, half: str, names: tuple[str, ...]):
    """`src` with `names` in `half` storage: each read is the half's exact float32 value and the float32 kernel's
    arithmetic follows; each float32 result written to one is rounded once (cupy's float16 store, `BF16_ROUND`)."""
    def retype(params: str) -> str:
        return ", ".join(f"{_HALF_TYPE[half]} {n}" if n in names else f"{t} {n}"
                         for t, n in (p.split() for p in params.split(",")))

    def read(expr: str) -> str:
        return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: _HALF_READ[half].format(m.group(1)), expr)

    if isinstance(src, ReductionSource):
        return replace(src, in_params=retype(src.in_params), map_expr=read(src.map_expr))
    outs = {n for _, n in (p.split() for p in src.out_params.split(","))}
    stmts = []
    for stmt in (s.strip() for s in src.operation.split(";")):
        target, expr = (t.strip() for t in stmt.split("=", 1))
        stmts.append(f"{target} = " + (_HALF_STORE[half].format(read(expr)) if target in names and target in outs
                                       else read(expr)))
    return ElementwiseSource(retype(src.in_params), retype(src.out_params), "; ".join(stmts),
                             BF16_ROUND if half == "bf16" and outs & set(names) else src.preamble)


#: The batch-norm fallback kernels and their half forms, by entry point.
NORM_KERNELS: dict[str, ElementwiseSource | ReductionSource] = {
    **_NORM_F32, **{halves.variant(name, half): _half_form(_NORM_F32[name], half, names)
                    for name, names in _NORM_HALF_ARGS.items() for half in ("bf16", "fp16")}}


class _NormKernels:
    """`NORM_KERNELS` compiled by cupy, as attributes."""

    def __init__(self, cupy):
        for name, src in NORM_KERNELS.items():
            if isinstance(src, ReductionSource):
                kern = cupy.ReductionKernel(src.in_params, src.out_params, src.map_expr, src.reduce_expr,
                                            src.post_map_expr, src.identity, f"minidl_{name}",
                                            reduce_type=src.reduce_type)
            else:
                kern = cupy.ElementwiseKernel(src.in_params, src.out_params, src.operation, f"minidl_{name}",
                                              preamble=src.preamble)
            setattr(self, name, kern)


def use_kernel_cache() -> None:
    """cupy's compiled kernels go to minidl's user cache folder unless CUPY_CACHE_DIR names another."""
    os.environ.setdefault("CUPY_CACHE_DIR", cache_folder("cupy"))


def plan_store(cudnn, gpu_name: str, capability: str) -> PlanStore | None:
    """The cuDNN plan cache for this GPU and libraries; None where their versions are unknown or the folder is
    not writable."""
    try:
        env = PlanEnv(gpu_name, str(capability), str(cudnn.backend_version()), str(cudnn.__version__))
    except Exception:  # noqa: BLE001 - no cache rather than a wrong one
        return None
    folder = cache_folder("cudnn")
    if not writable(folder, "cuDNN's execution plans are built again in every process"):
        return None
    return PlanStore(folder, env)


def _device_name(cupy, device: int) -> str:
    name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _cublas_math_setter(cupy) -> Callable[[bool], None]:
    """A setter of cupy's cuBLAS handle's math (TF32 or default): cuBLAS's half of `--math tf32`."""
    def set_tf32(on: bool) -> None:
        try:
            from cupy_backends.cuda.libs import cublas as libcublas
        except ImportError as e:
            raise CUDAUnavailable(f"--math: cannot set cuBLAS's math mode, cupy's cuBLAS bindings are not "
                                  f"importable ({e})") from e
        tf32_math = getattr(libcublas, "CUBLAS_TF32_TENSOR_OP_MATH", 3)   # cublas_api.h: = 3
        default_math = getattr(libcublas, "CUBLAS_DEFAULT_MATH", 0)
        libcublas.setMathMode(cupy.cuda.device.get_cublas_handle(), tf32_math if on else default_math)
    return set_tf32


class CUDABackend(ConvOps, DenseOps, NormOps, PointwiseOps, SequenceOps, UpdateOps, CopyOps):
    """The CPU backend's interface on cupy + cuDNN. `max_plans`: execution plans (workspace options) per graph;
    `count_stray_allocations`: count cupy allocations outside the arena."""

    capabilities = Capabilities(name="cuda", device="gpu", kernels=SEQUENCE_KERNELS, stream_copies=True,
                                graph_capture=True, device_guard=True, paged_arena=True, host_link=True,
                                half_kernels=(launches.HALF_KERNELS | cudnn_specs.HALF_KERNELS
                                              | norm.HALF_KERNELS))

    def __init__(self, device: int = 0, *, allow_tf32: bool = False, deterministic: bool = True,
                 max_plans: int = 8, use_cudnn_bn: bool = True, use_cudnn_relu: bool = True,
                 count_stray_allocations: bool = True, plan_cache: bool = True):
        use_kernel_cache()
        cupy, cupyx, cudnn = load_cuda_modules()
        from cupy import cublas

        dev = cupy.cuda.Device(int(device))
        dev.use()
        attrs = dev.attributes
        gpu_name = _device_name(cupy, int(device))
        store = plan_store(cudnn, gpu_name, dev.compute_capability) if plan_cache else None
        compute = cupy.cuda.Stream(non_blocking=True)
        try:
            handle = cudnn.create_handle()
        except Exception as e:
            raise CUDAUnavailable(f"the cuDNN frontend cannot create a cuDNN handle ({e}); is the cuDNN library "
                                  f"installed (`pip install nvidia-cudnn-cu13`)?") from e
        cudnn.set_stream(handle=handle, stream=compute.ptr)
        self._init_state(
            cupy=cupy, cupyx=cupyx, cudnn=cudnn, cublas=cublas, compute=compute,
            transfer=cupy.cuda.Stream(non_blocking=True), prefetch=cupy.cuda.Stream(non_blocking=True),
            graphs=CudnnGraphs(cudnn, handle, max_plans=max_plans, store=store),
            side=_SideBuffers(cupy),
            limits=launches.DeviceLimits(int(attrs["MaxThreadsPerBlock"]), int(attrs["MultiProcessorCount"])),
            filters=cudnn_specs.EngineFilters(allow_tf32=allow_tf32, deterministic=deterministic),
            use_cudnn_bn=use_cudnn_bn, use_cudnn_relu=use_cudnn_relu)
        self.device = dev
        self.gpu_name = gpu_name
        self._handle = handle
        self._cublas_math = _cublas_math_setter(cupy)
        if allow_tf32:
            self._cublas_math(True)
        if count_stray_allocations:
            self._install_stray_counter()
        self._anchor()  # the transfer clock's anchor, made now so no step blocks for it

    def _init_state(self, *, cupy, cupyx, cudnn, cublas, compute, transfer, graphs: CudnnGraphs, side, limits,
                    filters, use_cudnn_bn: bool = True, use_cudnn_relu: bool = True, prefetch=None) -> None:
        self.cp, self.cpx, self.cudnn, self._cublas = cupy, cupyx, cudnn, cublas
        self.xp = cupy
        self.device = None
        self.gpu_name = ""
        self.compute, self.transfer = compute, transfer        # transfer: device -> host
        self.prefetch_stream = prefetch if prefetch is not None else transfer   # host -> device
        self.graphs, self.side = graphs, side
        self.limits, self.filters = limits, filters
        self.use_cudnn_bn, self.use_cudnn_relu = bool(use_cudnn_bn), bool(use_cudnn_relu)
        self._handle = None
        self.fallbacks: dict[str, str] = {}     # graph op -> why it fell back
        self._unsupported: set[cudnn_specs.GraphKey] = set()
        self._modules: dict[tuple[str, str | None], Any] = {}   # (.cu file, its text's half) -> cupy.RawModule
        self._kernels: dict[str, Any] = {}      # kernel name -> RawKernel
        self._norm: _NormKernels | None = None
        self._host_scalars: dict[float, np.ndarray] = {}
        self._filled: set[str] = set()
        self.stray_bytes = 0
        self.stray_allocs = 0
        self._prev_allocator = None
        self._clock_anchor: tuple[Any, float] | None = None  # (event, perf_counter)
        self._cublas_math: Callable[[bool], None] | None = None  # None: host tests
        self._cublas_ex: tuple[Any, int] | None = None   # (cupy's cuBLAS bindings, handle): half products, lazily
        self.graph_scalars = None  # backend/scalars.StepScalars while a graph is captured
        _LIVE_BACKENDS.add(self)

    @classmethod
    def from_parts(cls, **parts) -> "CUDABackend":
        """A backend from `_init_state`'s parts without a device: host tests inject fakes."""
        obj = cls.__new__(cls)
        obj._init_state(**parts)
        return obj

    @property
    def math(self) -> str:
        """'tf32' when cuDNN may pick TF32 engines, the half mode ('bf16', 'fp16') when in one, else 'fp32'."""
        return self.filters.half or ("tf32" if self.filters.allow_tf32 else "fp32")

    def set_math(self, math: str) -> None:
        """Switch 'fp32' / 'tf32' / 'bf16' / 'fp16' before planning (the mode decides the engines, hence the
        workspace options); the half modes allow tensor-core engines on half inputs, float32 stays TF32-free."""
        prec = precision(math)
        tf32 = prec.mode == "tf32"
        changed = tf32 != self.filters.allow_tf32
        self.filters = cudnn_specs.EngineFilters(allow_tf32=tf32, deterministic=self.filters.deterministic,
                                                 half=prec.mode if prec.half is not None else None)
        if changed and self._cublas_math is not None:
            self._cublas_math(tf32)

    @property
    def profile(self) -> str:
        """The simulator profile nearest this GPU: the speeds a plan assumes when the caller names none."""
        return cudnn_specs.profile_for_gpu(self.gpu_name)

    # -- lifecycle / reports
    def _install_stray_counter(self) -> None:
        pool = self.cp.get_default_memory_pool()

        def counting_malloc(nbytes):
            self.stray_bytes += int(nbytes)
            self.stray_allocs += 1
            return pool.malloc(nbytes)

        self._prev_allocator = pool.malloc
        self.cp.cuda.set_allocator(counting_malloc)

    def close(self) -> None:
        self.synchronize()
        if self._prev_allocator is not None:
            self.cp.cuda.set_allocator(self._prev_allocator)
            self._prev_allocator = None
        self.release_cudnn()

    def release_cudnn(self) -> None:
        """Drop the built graphs, then destroy their handle."""
        if self.graphs is None:  # a backend assembled from parts without cuDNN
            return
        self.graphs.release()
        handle, self._handle = self._handle, None
        if handle is not None:
            self.graphs.handle = None
            try:
                self.synchronize()
                self.cudnn.destroy_handle(handle)
            except Exception:  # at exit the device may be gone already
                pass

    def autotune_path(self) -> str | None:
        """`--autotune`'s file for this GPU and math mode, beside the cached plans whose indices it names."""
        store = self.graphs.store
        return None if store is None else str(store.folder / f"autotune-{self.math}.json")

    def startup_caches(self) -> dict[str, Any]:
        """What this process took from the user cache folder and what it built (`--json`'s `startup_caches`)."""
        g = self.graphs
        out: dict[str, Any] = {"cudnn_graphs": dict(g.stats)}
        if g.store is not None:
            out["cudnn_folder"] = str(g.store.folder)
        if g.cache_notes:
            out["cudnn_notes"] = list(g.cache_notes)
        out["cupy_folder"] = os.environ.get("CUPY_CACHE_DIR", "")
        return out

    def memory_report(self) -> dict[str, Any]:
        return {"side_bytes": self.side.nbytes, "stray_bytes": self.stray_bytes,
                "stray_allocs": self.stray_allocs, "cached_graphs": len(self.graphs),
                "fallbacks": dict(self.fallbacks)}

    def step_scope(self):
        return nullcontext()

    def compute_scope(self):
        """The compute stream, so a caller's cupy work is ordered with the kernels'."""
        return self.compute

    def synchronize(self) -> None:
        self.compute.synchronize()
        self.transfer.synchronize()
        if self.prefetch_stream is not self.transfer:
            self.prefetch_stream.synchronize()

    # -- arena
    def arena_backing(self) -> DeviceArenaBacking:
        return DeviceArenaBacking(self.cp)

    def paged_backing(self):
        """The paged pool's memory: driver-API chunks mapped into a reserved range."""
        from .vmm import VmmBacking

        return VmmBacking(self.cp, device=int(self.cp.cuda.runtime.getDevice()))

    def measure_link(self, nbytes: int | None = None, repeats: int = 3):
        """The host link's bandwidth and latency on these copy streams (for memory/calibrate.py). Blocks."""
        from .calibrate import BANDWIDTH_BYTES, measure_link

        return measure_link(self, nbytes or BANDWIDTH_BYTES, repeats)

    # -- CUDA graphs (runtime/capture.py)
    #: The kernels a captured graph launches instead of their plain variants.
    GRAPH_KERNELS = ("dropout_forward_dev", "dropout_backward_dev", "sgd_update_dev", "adam_update_dev",
                     "nonfinite_flag")
    #: Raised by a call that cannot be captured (cupy's cuBLAS wrappers call cublasSetStream), before enqueuing
    #: anything: it runs eagerly between the step's graphs.
    CaptureUnsupported = (NotImplementedError,)

    @on_compute
    def guard_nonfinite(self, x, code: int) -> None:
        """Set the capture's `diverged` flag to `code` if `x` is not finite and no earlier guarded tensor was."""
        self._launch(launches.nonfinite_flag(self.graph_scalars.diverged, x, code, self.limits))

    @on_compute
    def found_inf_flag(self, x) -> None:
        """fp16 inside a graph: set the capture's `found_inf` flag if gradient `x` is not finite (before it is
        unscaled, as `LossScaler.unscale` checks it)."""
        self._launch(launches.nonfinite_flag(self.graph_scalars.found_inf, x, 1, self.limits))

    def prepare_graph(self) -> None:
        """Load the graph kernels now, with the math mode's half forms: loading is not a stream operation, so not
        while capturing."""
        for name in self.GRAPH_KERNELS:
            self._kernel(name)
            form = halves.variant(name, self.filters.half)
            if form in ks.KERNELS:
                self._kernel(form)

    def begin_graph(self) -> None:
        """Capture the compute stream until `end_graph` (capture.py refuses a graph whose capture allocated)."""
        self.compute.begin_capture()

    def end_graph(self):
        """The recorded work as a `cupy.cuda.Graph`."""
        return self.compute.end_capture()

    def launch_graph(self, graph) -> None:
        graph.launch(stream=self.compute)

    def copy_in_async(self, dst, src: np.ndarray) -> None:
        """Pinned `src` -> `dst` on the compute stream (a graph's batch input)."""
        self._check_transfer(dst, src)
        self._upload(dst, src, self.compute)

    def copy_out_async(self, src, dst: np.ndarray) -> None:
        """`src` -> pinned `dst` on the compute stream (a graph's loss output)."""
        self._check_transfer(src, dst)
        self._download(src, dst, self.compute)

    def scalar_buffer(self, name: str, n: int, dtype):
        return self.side.get(name, (int(n),), dtype)

    def wait_compute(self) -> None:
        self.compute.synchronize()

    # -- helpers
    def _check(self, op: str, dtype: np.dtype = F32, **arrays) -> None:
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

    def _check_io(self, op: str, contiguous: bool = True, **arrays) -> str | None:
        """Check device arrays `arrays` (None: absent) as one kernel's I/O: C-contiguous (strided views where not
        `contiguous`: cuBLAS), all float32 or all the math mode's half storage. Returns None for float32, else
        'bf16' / 'fp16'."""
        half = self.filters.half
        allowed = (F32, halves.storage_dtype(HALF_DTYPES[half])) if half else (F32,)
        first = None
        for name, a in arrays.items():
            if a is None:
                continue
            if not isinstance(a, self.cp.ndarray):
                raise TypeError(f"{op}: {name} must be a cupy array on the device, got {type(a).__name__}")
            if a.dtype not in allowed:
                raise TypeError(f"{op}: {name} must be {' or '.join(map(str, allowed))} in --math {self.math}, "
                                f"got {a.dtype}")
            if first is None:
                first = name, a
            elif a.dtype != first[1].dtype:
                raise TypeError(f"{op}: {name} is {a.dtype} but {first[0]} is {first[1].dtype}: a kernel's "
                                f"arrays share one dtype")
            if contiguous and not a.flags.c_contiguous:
                raise ValueError(f"{op}: {name} must be C-contiguous")
        return None if first is None else halves.half_of(first[1])

    @staticmethod
    def _ptr(a) -> int:
        return int(a.data.ptr)

    def _kernel(self, name: str):
        k = self._kernels.get(name)
        if k is None:
            with startup.phase("kernels"):
                text = (ks.KERNELS[name].file, ks.module_half(name, self.filters.half))
                mod = self._modules.get(text)
                if mod is None:
                    mod = self._modules[text] = self.cp.RawModule(code=ks.module_source(*text))
                k = self._kernels[name] = mod.get_function(name)
        return k

    def _launch(self, launch: launches.KernelLaunch) -> None:
        self._kernel(launch.name)(launch.grid, launch.block, launch.args, stream=self.compute)

    def _norm_kernels(self) -> _NormKernels:
        if self._norm is None:
            self._norm = _NormKernels(self.cp)
        return self._norm

    def _graph(self, key: cudnn_specs.GraphKey, required: bool = False) -> BuiltGraph | None:
        """The built graph, or None when cuDNN cannot run it (reason recorded in `fallbacks`); `required`: the caller
        has no fallback (a half data gradient with a fused add), so GraphUnsupported instead of None."""
        if key not in self._unsupported:
            try:
                return self.graphs.get(key)
            except GraphUnsupported as e:
                self._unsupported.add(key)
                self.fallbacks[key.op] = one_line(str(e))
        if required:
            raise GraphUnsupported(f"{key.op} on {key.spec.dtype} data has no kernel but cuDNN's, which cannot run "
                                   f"it here ({self.fallbacks[key.op]}); use --math fp32")
        return None

    def _run_graph(self, built: BuiltGraph, arrays: dict[str, Any], scalars: dict[str, float] | None = None):
        """Run a graph's first plan (BN, ReLU, SDPA) with a side-buffer workspace."""
        plan = built.plans[0]
        pointers = {name: self._ptr(a) for name, a in arrays.items()}
        for name, value in (scalars or {}).items():
            pointers[name] = self._host_scalar(value).ctypes.data
        ws = self.side.get("graph_workspace", (plan.workspace_bytes,), np.uint8) if plan.workspace_bytes else None
        self.graphs.execute(built, pointers, self._ptr(ws) if ws is not None else 0, plan.index)

    def _host_scalar(self, value: float) -> np.ndarray:
        a = self._host_scalars.get(float(value))
        if a is None:
            a = self._host_scalars[float(value)] = np.full((1, 1, 1, 1), value, np.float32)
        return a

    def _constant(self, name: str, n: int, value: float, dtype=F32):
        """A cached device vector of `n` copies of `value` in device dtype `dtype` (bf16: its uint16 bits)."""
        dt = np.dtype(dtype)
        key = f"{name}{n}" if dt == F32 else f"{name}{n}_{dt.name}"
        buf = self.side.get(key, (n,), dt)
        if key not in self._filled:
            buf.fill(np.asarray(value, halves.host_dtype(dt)).view(dt)[()])
            self._filled.add(key)
        return buf
