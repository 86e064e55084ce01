"""Device-free arithmetic of the CUDA backend: everything `cuda.py` computes before it touches a GPU.

Pure Python + numpy (no cupy, no cuDNN), so every number the CUDA backend hands to the driver, to cuDNN or to a
kernel launch is checked by host-only tests (`tests/backend/test_cuda_host.py`):

* **Arena views.** The device arena is one raw allocation; a tensor is a `cupy.ndarray` whose pointer is
  `arena base + offset`. `view_spec` turns (offset, shape, dtype) into the byte range, C-order byte strides and
  checks bounds and alignment, so a view can never reach past its block or the arena.
* **cuDNN graph parameters.** `TensorDesc` is exactly what `pygraph.tensor(name=, dim=, stride=, data_type=)`
  receives (NCHW dims and element strides; per-channel vectors as (1, C, 1, 1); pass-by-value scalars as
  (1, 1, 1, 1)); `ConvSpec.conv_kwargs()` is the `padding=/stride=/dilation=` lists of `conv_fprop`,
  `conv_dgrad` and `conv_wgrad`. `GraphKey` is the cache key of a built graph: op, shapes, parameters and the
  engine filters, never a pointer (pointers are bound per call through the variant pack).
* **Convolution "algorithms".** cuDNN offers several execution plans (engines) per convolution, each with its
  own workspace size. They are exposed to the memory planner as `WorkspaceOption`s named `cudnn:f<i>` (forward:
  plan i of the fprop graph) and `cudnn:d<i>w<j>` (backward: dgrad plan i then wgrad plan j, sharing one
  workspace, so it needs max(ws_i, ws_j)). The planner chooses among them exactly as among the CPU's
  im2col / im2col_chunked / gemm_1x1: the fastest option whose workspace fits. A backward that adds dx into the
  delta it is given (a fork's later consumer) runs the `dgrad_add` graph, the data gradient with a fused add of
  that delta, under the same names; where cuDNN cannot build it, `cudnn:d<i>w<j>+add` runs dgrad plan i into
  the head of the workspace (`dx_scratch_bytes`) and adds it after (`conv_options(..., add_scratch=)`).
* **Kernel launches.** `LAUNCHERS[name](...)` builds the full argument tuple of each `kernels/*.cu` entry point
  from the arrays' shapes (via `kernel_specs.coerce_scalars`) and its grid/block (via
  `kernel_specs.launch_config`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ...core.vocab import WorkspaceOption
from ..common import conv_output_hw, dropout_scale, dropout_threshold24
from . import kernel_specs as ks

__all__ = [
    "CUDA_MALLOC_ALIGNMENT", "VIEW_ALIGNMENT", "ViewSpec", "view_spec", "contiguous_strides", "check_base_alignment",
    "ranges_overlap", "cudnn_dtype_name", "TensorDesc", "nchw_desc", "channel_desc", "scalar_desc", "ConvSpec",
    "BNSpec", "PointwiseSpec", "GraphKey", "EngineFilters", "PlanInfo", "fwd_algo", "bwd_algo", "parse_conv_algo",
    "adds_after", "dx_scratch_bytes", "ADD_AFTER",
    "plan_cost", "conv_options", "pick_plan", "DeviceLimits", "KernelLaunch", "pack_launch", "LAUNCHERS",
    "ZERO_OUTPUT_FIRST", "NULLABLE_POINTERS",
]

CUDA_MALLOC_ALIGNMENT = 256
"""cudaMalloc returns 256-byte aligned pointers; the arena base must be at least that aligned."""

VIEW_ALIGNMENT = 16
"""Every tensor view must start on a multiple of this (cuDNN's vectorized loads). The tensor pool hands out
512-byte aligned offsets, so this holds for every planned tensor."""


# ---------------------------------------------------------------------------------------------------------
# Arena views
# ---------------------------------------------------------------------------------------------------------

def contiguous_strides(shape: Sequence[int], itemsize: int = 1) -> tuple[int, ...]:
    """C-order strides of `shape`: in elements with itemsize=1 (what cuDNN wants), in bytes otherwise (what
    numpy/cupy report). For a zero-size shape no element is ever addressed, so the values do not matter (numpy
    itself reports zeros there)."""
    strides = []
    acc = int(itemsize)
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(strides))


@dataclass(slots=True, frozen=True)
class ViewSpec:
    """A C-contiguous view of the arena: bytes [offset, offset + nbytes), `strides` in bytes."""

    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    strides: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _shape_tuple(shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    out = tuple(int(d) for d in shape)
    if any(d < 0 for d in out):
        raise ValueError(f"negative dimension in shape {out}")
    return out


def view_spec(offset: int, shape, dtype, capacity: int, alignment: int = VIEW_ALIGNMENT) -> ViewSpec:
    """Check and describe the view of `shape`/`dtype` at byte `offset` of an arena of `capacity` bytes.

    Raises ValueError if the view would start unaligned (to `alignment` and to the dtype's size), start
    outside the arena or end past it.
    """
    dt = np.dtype(dtype)
    shp = _shape_tuple(shape)
    offset = int(offset)
    nbytes = math.prod(shp) * dt.itemsize
    if offset < 0:
        raise ValueError(f"arena view at negative offset {offset}")
    align = max(int(alignment), dt.itemsize)
    if offset % align:
        raise ValueError(f"arena view of {shp} {dt} at offset {offset} is not aligned to {align} bytes")
    if offset + nbytes > capacity:
        raise ValueError(f"arena view of {shp} {dt} ({nbytes} bytes) at offset {offset} ends at byte "
                         f"{offset + nbytes}, past the arena's {capacity} bytes")
    return ViewSpec(offset, shp, dt, nbytes, contiguous_strides(shp, dt.itemsize))


def check_base_alignment(ptr: int, alignment: int = CUDA_MALLOC_ALIGNMENT) -> None:
    """The arena's base device address must be `alignment`-aligned (cudaMalloc guarantees 256)."""
    if int(ptr) % alignment:
        raise ValueError(f"arena base address {int(ptr):#x} is not aligned to {alignment} bytes")


def ranges_overlap(a: ViewSpec, b: ViewSpec) -> bool:
    """Whether two views share at least one byte (empty views overlap nothing)."""
    return a.nbytes > 0 and b.nbytes > 0 and a.offset < b.end and b.offset < a.end


# ---------------------------------------------------------------------------------------------------------
# cuDNN tensor descriptors
# ---------------------------------------------------------------------------------------------------------

_CUDNN_DTYPES = {
    np.dtype(np.float32): "FLOAT",
    np.dtype(np.float64): "DOUBLE",
    np.dtype(np.float16): "HALF",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.int8): "INT8",
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.bool_): "BOOLEAN",
}


def cudnn_dtype_name(dtype) -> str:
    """The member name of `cudnn.data_type` for a numpy dtype ("FLOAT" for float32, ...)."""
    dt = np.dtype(dtype)
    try:
        return _CUDNN_DTYPES[dt]
    except KeyError:
        raise TypeError(f"no cuDNN data type for {dt}") from None


@dataclass(slots=True, frozen=True)
class TensorDesc:
    """The arguments of one `pygraph.tensor(...)` call (or of `set_dim/set_stride/set_data_type` on an output).

    `dim`/`stride` are in elements; `dtype` is a `cudnn.data_type` member name; `by_value` marks a scalar that
    is passed by host pointer at execution (BN's epsilon and momentum)."""

    name: str
    dim: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str = "FLOAT"
    by_value: bool = False

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `pygraph.tensor` except `data_type` (the adapter maps the name to the enum)."""
        kw: dict[str, Any] = {"name": self.name, "dim": list(self.dim), "stride": list(self.stride)}
        if self.by_value:
            kw["is_pass_by_value"] = True
        return kw


def nchw_desc(name: str, shape: Sequence[int], dtype=np.float32) -> TensorDesc:
    """A C-contiguous NCHW tensor."""
    shp = _shape_tuple(shape)
    if len(shp) != 4:
        raise ValueError(f"{name}: expected a 4-D NCHW shape, got {shp}")
    if min(shp) <= 0:
        raise ValueError(f"{name}: cuDNN needs positive dimensions, got {shp}")
    return TensorDesc(name, shp, contiguous_strides(shp), cudnn_dtype_name(dtype))


def channel_desc(name: str, channels: int, dtype=np.float32) -> TensorDesc:
    """A per-channel vector of C values seen as (1, C, 1, 1), as cuDNN's BN scale/bias/statistics are."""
    c = int(channels)
    if c <= 0:
        raise ValueError(f"{name}: channel count must be positive, got {c}")
    return TensorDesc(name, (1, c, 1, 1), (c, 1, 1, 1), cudnn_dtype_name(dtype))


def scalar_desc(name: str, dtype=np.float32) -> TensorDesc:
    """A pass-by-value scalar (1, 1, 1, 1)."""
    return TensorDesc(name, (1, 1, 1, 1), (1, 1, 1, 1), cudnn_dtype_name(dtype), by_value=True)


@dataclass(slots=True, frozen=True)
class EngineFilters:
    """Which cuDNN engines a graph may use; part of every graph's cache key.

    `allow_tf32=False` deselects engines with the TENSOR_CORE / DOWN_CONVERT_INPUTS numerical notes, which
    compute float32 convolutions in TF32 (10-bit mantissa): results would then miss the CPU reference by ~1e-3.
    `deterministic=True` deselects NONDETERMINISTIC engines (atomics), so two runs give the same bits.
    """

    allow_tf32: bool = False
    deterministic: bool = True

    def numeric_notes(self) -> tuple[str, ...]:
        """Member names of `cudnn.numerical_note` to deselect."""
        notes = []
        if not self.allow_tf32:
            notes += ["TENSOR_CORE", "DOWN_CONVERT_INPUTS"]
        if self.deterministic:
            notes.append("NONDETERMINISTIC")
        return tuple(notes)


@dataclass(slots=True, frozen=True)
class GraphKey:
    """Cache key of a built cuDNN graph: shapes and parameters only (pointers are bound at execution)."""

    op: str
    spec: Any          # ConvSpec | BNSpec | PointwiseSpec (frozen dataclasses, hashable)
    filters: EngineFilters


# -- convolution -----------------------------------------------------------------------------------------------
CONV_OPS = ("fprop", "dgrad", "wgrad", "dgrad_add")


@dataclass(slots=True, frozen=True)
class ConvSpec:
    """One 2-D convolution: NCHW input x, weight (Cout, Cin/groups, kh, kw), output y."""

    x: tuple[int, int, int, int]
    w: tuple[int, int, int, int]
    y: tuple[int, int, int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    dtype: str  # numpy dtype name

    @classmethod
    def from_shapes(cls, x_shape, w_shape, y_shape, stride, padding, dilation, groups, dtype) -> "ConvSpec":
        x, w, y = _shape_tuple(x_shape), _shape_tuple(w_shape), _shape_tuple(y_shape)
        stride, padding, dilation = (tuple(int(v) for v in p) for p in (stride, padding, dilation))
        groups = int(groups)
        if len(x) != 4 or len(w) != 4 or len(y) != 4:
            raise ValueError(f"conv2d: x, w and y must be 4-D, got {x}, {w}, {y}")
        if len(stride) != 2 or len(padding) != 2 or len(dilation) != 2:
            raise ValueError(f"conv2d: stride, padding and dilation must be pairs, got {stride}, {padding}, "
                             f"{dilation}")
        if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or groups < 1:
            raise ValueError(f"conv2d: invalid stride {stride}, padding {padding}, dilation {dilation} or "
                             f"groups {groups}")
        n, cin, h, wd = x
        cout, cg, kh, kw = w
        if cg * groups != cin or cout % groups:
            raise ValueError(f"conv2d: x {x} and w {w} do not agree with groups={groups}")
        ho, wo = conv_output_hw((h, wd), (kh, kw), stride, padding, dilation)
        if y != (n, cout, ho, wo):
            raise ValueError(f"conv2d: output must be {(n, cout, ho, wo)} for x {x}, w {w}, stride {stride}, "
                             f"padding {padding}, dilation {dilation}; got {y}")
        return cls(x, w, y, stride, padding, dilation, groups, np.dtype(dtype).name)  # type: ignore[arg-type]

    def conv_kwargs(self) -> dict[str, list[int]]:
        """`padding=`, `stride=`, `dilation=` of `conv_fprop` / `conv_dgrad` / `conv_wgrad` (symmetric padding:
        cuDNN's `padding` is applied before and after each spatial axis, like PyTorch's)."""
        return {"padding": list(self.padding), "stride": list(self.stride), "dilation": list(self.dilation)}

    def descs(self) -> dict[str, TensorDesc]:
        """The tensors of the convolution: x (image), w (filter), y (output / its gradient), and x_acc (the delta
        `dgrad_add` adds dx to: dx's shape)."""
        return {"x": nchw_desc("x", self.x, self.dtype), "w": nchw_desc("w", self.w, self.dtype),
                "y": nchw_desc("y", self.y, self.dtype), "x_acc": nchw_desc("x_acc", self.x, self.dtype)}

    def io(self, op: str) -> tuple[tuple[str, str], str]:
        """(the two graph inputs, the output) of `op`, by tensor name: fprop (x, w) -> y, dgrad (y=dy, w) -> x=dx,
        wgrad (x, y=dy) -> w=dw; dgrad_add is dgrad whose x is dx + x_acc (its third input)."""
        if op == "fprop":
            return ("x", "w"), "y"
        if op in ("dgrad", "dgrad_add"):
            return ("y", "w"), "x"
        if op == "wgrad":
            return ("x", "y"), "w"
        raise ValueError(f"unknown convolution op {op!r}; expected one of {CONV_OPS}")

    def key(self, op: str, filters: EngineFilters) -> GraphKey:
        self.io(op)  # validates op
        return GraphKey(f"conv_{op}", self, filters)


# -- batch normalization and pointwise -------------------------------------------------------------------------
BN_OPS = ("bn_train", "bn_infer", "bn_backward")


@dataclass(slots=True, frozen=True)
class BNSpec:
    """Batch normalization of an NCHW input over (N, H, W), per channel."""

    x: tuple[int, int, int, int]
    dtype: str

    @classmethod
    def from_shape(cls, x_shape, dtype) -> "BNSpec":
        x = _shape_tuple(x_shape)
        if len(x) != 4:
            raise ValueError(f"batch norm: expected a 4-D NCHW input, got {x}")
        return cls(x, np.dtype(dtype).name)  # type: ignore[arg-type]

    @property
    def channels(self) -> int:
        return self.x[1]

    @property
    def count(self) -> int:
        """Values per channel, N * H * W."""
        n, _, h, w = self.x
        return n * h * w

    def descs(self, op: str) -> dict[str, TensorDesc]:
        """The tensors of graph `op`; their names are the keys of the variant pack the backend binds."""
        c, dt = self.channels, self.dtype
        big = lambda name: nchw_desc(name, self.x, dt)  # noqa: E731
        vec = lambda name: channel_desc(name, c, dt)    # noqa: E731
        if op == "bn_train":
            names = {"x": big, "y": big, "scale": vec, "bias": vec, "running_mean": vec, "running_var": vec,
                     "next_running_mean": vec, "next_running_var": vec, "mean": vec, "invstd": vec}
            out = {k: f(k) for k, f in names.items()}
            out["epsilon"] = scalar_desc("epsilon")
            out["momentum"] = scalar_desc("momentum")
            return out
        if op == "bn_infer":
            names = {"x": big, "y": big, "mean": vec, "invstd": vec, "scale": vec, "bias": vec}
            return {k: f(k) for k, f in names.items()}
        if op == "bn_backward":
            names = {"x": big, "dy": big, "dx": big, "scale": vec, "mean": vec, "invstd": vec, "dscale": vec,
                     "dbias": vec}
            return {k: f(k) for k, f in names.items()}
        raise ValueError(f"unknown batch-norm op {op!r}; expected one of {BN_OPS}")

    def key(self, op: str, filters: EngineFilters) -> GraphKey:
        if op not in BN_OPS:
            raise ValueError(f"unknown batch-norm op {op!r}; expected one of {BN_OPS}")
        return GraphKey(op, self, filters)


POINTWISE_OPS = ("relu_fwd", "relu_bwd")


@dataclass(slots=True, frozen=True)
class PointwiseSpec:
    """An elementwise graph (ReLU forward/backward) over a C-contiguous tensor, seen as 4-D for cuDNN."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def from_shape(cls, shape, dtype) -> "PointwiseSpec":
        return cls(_shape_tuple(shape), np.dtype(dtype).name)  # type: ignore[arg-type]

    def dims4(self) -> tuple[int, int, int, int]:
        """The shape padded with trailing ones to 4-D (or folded into 4-D): cuDNN graph tensors are >= 4-D here."""
        s = self.shape
        if len(s) <= 4:
            return tuple(s) + (1,) * (4 - len(s))  # type: ignore[return-value]
        return (s[0], s[1], s[2], math.prod(s[3:]))

    def descs(self, op: str) -> dict[str, TensorDesc]:
        d = lambda name: nchw_desc(name, self.dims4(), self.dtype)  # noqa: E731
        if op == "relu_fwd":
            return {"x": d("x"), "y": d("y")}
        if op == "relu_bwd":
            return {"y": d("y"), "dy": d("dy"), "dx": d("dx")}
        raise ValueError(f"unknown pointwise op {op!r}; expected one of {POINTWISE_OPS}")

    def key(self, op: str, filters: EngineFilters) -> GraphKey:
        if op not in POINTWISE_OPS:
            raise ValueError(f"unknown pointwise op {op!r}; expected one of {POINTWISE_OPS}")
        return GraphKey(op, self, filters)


# ---------------------------------------------------------------------------------------------------------
# Execution plans as workspace options
# ---------------------------------------------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class PlanInfo:
    """A built cuDNN execution plan: its index in the graph's engine-config list, engine name, workspace."""

    index: int
    name: str
    workspace_bytes: int


ALGO_PREFIX = "cudnn:"
ADD_AFTER = "+add"  # a backward option's suffix: dgrad into the workspace's head, then added to the delta
_FWD_RE = re.compile(r"^cudnn:f(\d+)$")
_BWD_RE = re.compile(r"^cudnn:d(\d+)w(\d+)(?:\+add)?$")


def fwd_algo(plan: int) -> str:
    """Algorithm name of forward plan `plan` of the fprop graph."""
    return f"{ALGO_PREFIX}f{int(plan)}"


def bwd_algo(dgrad_plan: int, wgrad_plan: int, add_after: bool = False) -> str:
    """Algorithm name of backward with dgrad plan `dgrad_plan` and wgrad plan `wgrad_plan`; `add_after`: an
    accumulating one whose dgrad runs into the workspace and is added after (`ADD_AFTER`)."""
    return f"{ALGO_PREFIX}d{int(dgrad_plan)}w{int(wgrad_plan)}" + (ADD_AFTER if add_after else "")


def adds_after(algo: str | None) -> bool:
    """Whether backward algorithm `algo` adds a dgrad written into its workspace (`bwd_algo(add_after=True)`)."""
    return bool(algo) and algo.endswith(ADD_AFTER)


def dx_scratch_bytes(x_shape, dtype) -> int:
    """Bytes at the head of a `+add` backward's workspace that receive dx, rounded up to `CUDA_MALLOC_ALIGNMENT`
    (the dgrad plan's own workspace follows, as aligned as a workspace of its own)."""
    n = math.prod(int(v) for v in x_shape) * np.dtype(dtype).itemsize
    return -(-n // CUDA_MALLOC_ALIGNMENT) * CUDA_MALLOC_ALIGNMENT


def parse_conv_algo(phase: str, algo: str) -> tuple[int, ...]:
    """(fprop plan,) for phase 'fwd', (dgrad plan, wgrad plan) for 'bwd'."""
    if phase == "fwd":
        m = _FWD_RE.match(algo or "")
    elif phase == "bwd":
        m = _BWD_RE.match(algo or "")
    else:
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
    if m is None:
        example = fwd_algo(0) if phase == "fwd" else bwd_algo(0, 0)
        raise ValueError(f"conv2d {phase}: {algo!r} is not a CUDA convolution algorithm (expected e.g. "
                         f"{example!r}; ask the backend's conv_workspace_options for the valid ones)")
    return tuple(int(g) for g in m.groups())


def plan_cost(rank: int) -> float:
    """Relative cost of the plan cuDNN's heuristics ranked `rank` (0 = their first choice). Heuristics order
    plans by expected speed; measured times can replace this later without changing the interface."""
    return 1.0 + 0.1 * int(rank)


def pareto(cands: list[tuple[float, int, str]]) -> list[WorkspaceOption]:
    """Keep an option only if it needs less workspace than every faster one (others are never chosen)."""
    out: list[WorkspaceOption] = []
    best_ws = None
    for cost, ws, algo in sorted(cands, key=lambda c: (c[0], c[1], c[2])):
        if best_ws is None or ws < best_ws:
            out.append(WorkspaceOption(algo, ws, cost))
            best_ws = ws
    return out


def conv_options(phase: str, plans: Mapping[str, Sequence[PlanInfo]],
                 add_scratch: int | None = None) -> list[WorkspaceOption]:
    """Workspace options of a convolution phase, fastest first, from the built plans of its graphs (each list in
    cuDNN's heuristic order). 'fwd' reads plans['fprop']; 'bwd' pairs plans['dgrad'] with plans['wgrad'].
    `add_scratch` (bytes, `dx_scratch_bytes`): the dgrad plans write into that much of the workspace's head
    before their own workspace, and are added after (`+add` names). Dominated options (slower and no smaller)
    are dropped."""
    if phase == "fwd":
        fp = plans["fprop"]
        if not fp:
            raise ValueError("conv2d fwd: cuDNN offers no execution plan")
        return pareto([(plan_cost(r), p.workspace_bytes, fwd_algo(p.index)) for r, p in enumerate(fp)])
    if phase == "bwd":
        dg, wg = plans["dgrad"], plans["wgrad"]
        if not dg or not wg:
            raise ValueError("conv2d bwd: cuDNN offers no execution plan for dgrad or wgrad")
        head = add_scratch or 0
        cands = [(plan_cost(rd) + plan_cost(rw), max(head + d.workspace_bytes, w.workspace_bytes),
                  bwd_algo(d.index, w.index, add_scratch is not None))
                 for rd, d in enumerate(dg) for rw, w in enumerate(wg)]
        return pareto(cands)
    raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")


#: GPU name fragments -> simulator profile (minidl.memory.simulate.PROFILES), most specific first.
_GPU_PROFILES = (("H100", "h100"), ("H200", "h100"), ("V100", "v100"), ("TITAN X", "titanx"),
                 ("K40", "k40c"))


def profile_for_gpu(name: str) -> str:
    """The simulator profile nearest the GPU called `name` (cudaDeviceProp.name). A plan's timing decisions
    (when to start a prefetch, which tensors can be offloaded without stalling) use the profile's compute and
    link speeds; an unknown GPU gets 'v100', whose slower link makes the offload planner start copies early
    rather than late (a late prefetch stalls, an early one only holds memory sooner)."""
    upper = (name or "").upper()
    for fragment, profile in _GPU_PROFILES:
        if fragment in upper:
            return profile
    return "v100"


def pick_plan(plans: Sequence[PlanInfo], limit: int) -> PlanInfo:
    """The first plan (heuristic order) whose workspace fits in `limit` bytes."""
    for p in plans:
        if p.workspace_bytes <= limit:
            return p
    sizes = ", ".join(f"{p.index}: {p.workspace_bytes}" for p in plans)
    raise ValueError(f"no cuDNN plan fits a workspace of {limit} bytes (plans: {sizes})")


# ---------------------------------------------------------------------------------------------------------
# Kernel launches
# ---------------------------------------------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class DeviceLimits:
    """What `launch_config` needs to know about the device."""

    max_threads_per_block: int = 1024
    sm_count: int = 132


@dataclass(slots=True, frozen=True)
class KernelLaunch:
    """Everything `RawKernel(grid, block, args, stream=...)` needs."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple


#: Pointer parameters that may be NULL (passed as None): SGD's momentum buffer when momentum == 0; layer norm's
#: weight and bias (and their gradients) where the layer has none or does not want them.
NULLABLE_POINTERS = frozenset({("sgd_update", "momentum_buf"), ("sgd_update_dev", "momentum_buf"),
                               ("layernorm_forward", "w"), ("layernorm_forward", "b"),
                               ("layernorm_forward_apply", "w"), ("layernorm_forward_apply", "b"),
                               ("layernorm_backward_dx", "w"), ("layernorm_backward_params", "dw"),
                               ("layernorm_backward_params", "db")})

#: Kernels whose first (output) argument the host must zero before the launch (they add into it).
ZERO_OUTPUT_FIRST = frozenset({"maxpool2d_backward", "embedding_backward"})


def pack_launch(name: str, args: Sequence, work, limits: DeviceLimits = DeviceLimits()) -> KernelLaunch:
    """Coerce `args` to kernel `name`'s C types and compute its launch configuration for `work`.

    Pointer parameters must be arrays (anything with a `shape`), or None where `NULLABLE_POINTERS` allows it;
    this catches a Python number passed where the kernel expects a pointer, which the driver would accept and
    dereference.
    """
    spec = ks.KERNELS[name]
    coerced = ks.coerce_scalars(name, args)
    for a, v in zip(spec.args, coerced):
        if not a.is_pointer:
            continue
        if v is None:
            if (name, a.name) not in NULLABLE_POINTERS:
                raise TypeError(f"{name}: pointer argument {a.name!r} ({a.ctype}) is None")
        elif not hasattr(v, "shape") or isinstance(v, np.generic):
            raise TypeError(f"{name}: pointer argument {a.name!r} ({a.ctype}) must be an array, got "
                            f"{type(v).__name__}")
    grid, block = ks.launch_config(name, work, limits.max_threads_per_block, limits.sm_count)
    return KernelLaunch(name, grid, block, coerced)


def _size(a) -> int:
    return math.prod(a.shape)


def _same_size(name: str, *arrays) -> int:
    n = _size(arrays[0])
    for a in arrays[1:]:
        if _size(a) != n:
            raise ValueError(f"{name}: arrays of sizes {[_size(x) for x in arrays]} must all have {n} elements")
    return n


def _pair(v) -> tuple[int, int]:
    t = tuple(int(a) for a in v)
    if len(t) != 2:
        raise ValueError(f"expected a pair, got {v!r}")
    return t  # type: ignore[return-value]


# -- elementwise.cu --------------------------------------------------------------------------------------------
def relu_forward(y, x, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("relu_forward", y, x)
    return pack_launch("relu_forward", (y, x, n), n, limits)


def relu_backward(dx, y, dy, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("relu_backward", dx, y, dy)
    return pack_launch("relu_backward", (dx, y, dy, n), n, limits)


def add_forward(out, a, b, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("add_forward", out, a, b)
    return pack_launch("add_forward", (out, a, b, n), n, limits)


def accumulate(dst, src, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("accumulate", dst, src)
    return pack_launch("accumulate", (dst, src, n), n, limits)


def scale_copy(out, x, scale: float, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("scale_copy", out, x)
    return pack_launch("scale_copy", (out, x, n, scale), n, limits)


def _dropout(name, out, x, p: float, key: int, limits) -> KernelLaunch:
    n = _same_size(name, out, x)
    return pack_launch(name, (out, x, n, int(key) & 0xFFFFFFFFFFFFFFFF, dropout_threshold24(p),
                              dropout_scale(p)), n, limits)


def dropout_forward(out, x, p: float, key: int, limits=DeviceLimits()) -> KernelLaunch:
    return _dropout("dropout_forward", out, x, p, key, limits)


def dropout_backward(dx, dy, p: float, key: int, limits=DeviceLimits()) -> KernelLaunch:
    return _dropout("dropout_backward", dx, dy, p, key, limits)


def _dropout_dev(name, out, x, p: float, key, limits) -> KernelLaunch:
    n = _same_size(name, out, x)
    if int(math.prod(key.shape)) != 1 or np.dtype(key.dtype) != np.uint64:
        raise ValueError(f"{name}: the key must be one uint64 in device memory, got {key.shape} {key.dtype}")
    return pack_launch(name, (out, x, n, key, dropout_threshold24(p), dropout_scale(p)), n, limits)


def dropout_forward_dev(out, x, p: float, key, limits=DeviceLimits()) -> KernelLaunch:
    """dropout_forward with `key` a one-element uint64 device array (read when the kernel runs)."""
    return _dropout_dev("dropout_forward_dev", out, x, p, key, limits)


def dropout_backward_dev(dx, dy, p: float, key, limits=DeviceLimits()) -> KernelLaunch:
    """dropout_backward with `key` a one-element uint64 device array (read when the kernel runs)."""
    return _dropout_dev("dropout_backward_dev", dx, dy, p, key, limits)


def _concat_dims(name, part, whole, c0: int) -> tuple[int, int, int, int]:
    ps, ws = tuple(part.shape), tuple(whole.shape)
    if len(ps) < 2 or len(ps) != len(ws) or ps[0] != ws[0] or ps[2:] != ws[2:]:
        raise ValueError(f"{name}: part {ps} and concatenation {ws} differ outside axis 1")
    if not 0 <= c0 <= ws[1] - ps[1]:
        raise ValueError(f"{name}: channels [{c0}, {c0 + ps[1]}) do not fit in {ws[1]}")
    return ps[0], ps[1], math.prod(ps[2:]), ws[1]


def concat_copy_forward(out, x, c0: int, limits=DeviceLimits()) -> KernelLaunch:
    n, ci, inner, ct = _concat_dims("concat_copy_forward", x, out, c0)
    return pack_launch("concat_copy_forward", (out, x, n, ci, inner, ct, c0), _size(x), limits)


def concat_copy_backward(dx, dout, c0: int, limits=DeviceLimits()) -> KernelLaunch:
    n, ci, inner, ct = _concat_dims("concat_copy_backward", dx, dout, c0)
    return pack_launch("concat_copy_backward", (dx, dout, n, ci, inner, ct, c0), _size(dx), limits)


def _ncl(name, x) -> tuple[int, int, int]:
    s = tuple(x.shape)
    if len(s) < 2:
        raise ValueError(f"{name}: expected (N, C, ...), got {s}")
    return s[0], s[1], math.prod(s[2:])


def lrn_forward(y, x, size: int, alpha: float, beta: float, k: float, limits=DeviceLimits()) -> KernelLaunch:
    _same_size("lrn_forward", y, x)
    n, c, inner = _ncl("lrn_forward", x)
    return pack_launch("lrn_forward", (y, x, n, c, inner, size, alpha, beta, k), _size(x), limits)


def lrn_backward(dx, x, y, dy, size: int, alpha: float, beta: float, k: float,
                 limits=DeviceLimits()) -> KernelLaunch:
    _same_size("lrn_backward", dx, x, y, dy)
    n, c, inner = _ncl("lrn_backward", x)
    return pack_launch("lrn_backward", (dx, x, y, dy, n, c, inner, size, alpha, beta, k), _size(x), limits)


# -- loss.cu ---------------------------------------------------------------------------------------------------
def _logits_dims(name, logits, labels) -> tuple[int, int]:
    s = tuple(logits.shape)
    if len(s) != 2 or tuple(labels.shape) != (s[0],):
        raise ValueError(f"{name}: logits must be (N, K) and labels (N,), got {s} and {tuple(labels.shape)}")
    return s


def softmax_xent_forward(loss_rows, logits, labels, limits=DeviceLimits()) -> KernelLaunch:
    """Per-row losses into `loss_rows` (at least N floats of scratch)."""
    n, k = _logits_dims("softmax_xent_forward", logits, labels)
    if _size(loss_rows) < n:
        raise ValueError(f"softmax_xent_forward: the row-loss buffer holds {_size(loss_rows)} < {n} values")
    return pack_launch("softmax_xent_forward", (loss_rows, logits, labels, n, k), (n, k), limits)


def softmax_xent_mean(out, loss_rows, n: int, limits=DeviceLimits()) -> KernelLaunch:
    if _size(out) != 1 or _size(loss_rows) < n:
        raise ValueError(f"softmax_xent_mean: out must hold 1 value and the rows {n}")
    return pack_launch("softmax_xent_mean", (out, loss_rows, n), n, limits)


def softmax_xent_backward(dlogits, logits, labels, scale: float, limits=DeviceLimits()) -> KernelLaunch:
    n, k = _logits_dims("softmax_xent_backward", logits, labels)
    _same_size("softmax_xent_backward", dlogits, logits)
    return pack_launch("softmax_xent_backward", (dlogits, logits, labels, n, k, scale), (n, k), limits)


def softmax_xent_ignore_forward(loss_rows, logits, labels, ignore_index: int,
                                limits=DeviceLimits()) -> KernelLaunch:
    """Per-row losses into `loss_rows` (at least N floats of scratch), 0 for the rows whose label is
    `ignore_index`."""
    n, k = _logits_dims("softmax_xent_ignore_forward", logits, labels)
    if _size(loss_rows) < n:
        raise ValueError(f"softmax_xent_ignore_forward: the row-loss buffer holds {_size(loss_rows)} < {n} values")
    return pack_launch("softmax_xent_ignore_forward", (loss_rows, logits, labels, n, k, ignore_index), (n, k),
                       limits)


def softmax_xent_ignore_mean(out, loss_rows, labels, ignore_index: int, limits=DeviceLimits()) -> KernelLaunch:
    n = _size(labels)
    if _size(out) != 1 or _size(loss_rows) < n:
        raise ValueError(f"softmax_xent_ignore_mean: out must hold 1 value and the rows {n}")
    return pack_launch("softmax_xent_ignore_mean", (out, loss_rows, labels, n, ignore_index), n, limits)


def softmax_xent_ignore_scale(scale, dloss, labels, ignore_index: int, limits=DeviceLimits()) -> KernelLaunch:
    n = _size(labels)
    if _size(scale) != 1 or _size(dloss) != 1:
        raise ValueError("softmax_xent_ignore_scale: scale and dloss must hold 1 value each")
    return pack_launch("softmax_xent_ignore_scale", (scale, dloss, labels, n, ignore_index), n, limits)


def softmax_xent_ignore_backward(dlogits, logits, labels, scale, ignore_index: int,
                                 limits=DeviceLimits()) -> KernelLaunch:
    n, k = _logits_dims("softmax_xent_ignore_backward", logits, labels)
    _same_size("softmax_xent_ignore_backward", dlogits, logits)
    if _size(scale) != 1:
        raise ValueError("softmax_xent_ignore_backward: scale must hold 1 value (softmax_xent_ignore_scale's)")
    return pack_launch("softmax_xent_ignore_backward", (dlogits, logits, labels, scale, n, k, ignore_index),
                       (n, k), limits)


# -- optim.cu --------------------------------------------------------------------------------------------------
def sgd_update(p, g, buf, lr, momentum, dampening, weight_decay, nesterov, first_step,
               limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("sgd_update", p, g)
    if momentum:
        if buf is None:
            raise ValueError("sgd_update: momentum != 0 needs a momentum buffer")
        _same_size("sgd_update", p, buf)
    else:
        buf = None  # never touched by the kernel
    return pack_launch("sgd_update", (p, g, buf, n, lr, momentum, dampening, weight_decay, int(bool(nesterov)),
                                      int(bool(first_step))), n, limits)


def _device_doubles(name, a, count: int) -> None:
    if int(math.prod(a.shape)) != count or np.dtype(a.dtype) != np.float64:
        raise ValueError(f"{name}: expects {count} float64 value(s) in device memory, got {a.shape} {a.dtype}")


def _device_flag(name, a) -> None:
    if int(math.prod(a.shape)) != 1 or np.dtype(a.dtype) != np.int32:
        raise ValueError(f"{name}: the divergence flag must be one int32 in device memory, got {a.shape} {a.dtype}")


def nonfinite_flag(flag, x, code: int, limits=DeviceLimits()) -> KernelLaunch:
    """Set `flag` (one int32 on the device) to `code` if `x` holds a NaN or an infinity and it is still 0."""
    _device_flag("nonfinite_flag", flag)
    if int(code) == 0:
        raise ValueError("nonfinite_flag: code 0 means 'finite'; give a non-zero code")
    n = _size(x)
    return pack_launch("nonfinite_flag", (flag, x, n, int(code)), n, limits)


def sgd_update_dev(p, g, buf, lr, momentum, dampening, weight_decay, nesterov, first_step, diverged,
                   limits=DeviceLimits()) -> KernelLaunch:
    """sgd_update with `lr` a one-element float64 device array (read when the kernel runs), skipped while the
    int32 `diverged` flag is set."""
    n = _same_size("sgd_update_dev", p, g)
    _device_doubles("sgd_update_dev", lr, 1)
    _device_flag("sgd_update_dev", diverged)
    if momentum:
        if buf is None:
            raise ValueError("sgd_update_dev: momentum != 0 needs a momentum buffer")
        _same_size("sgd_update_dev", p, buf)
    else:
        buf = None
    return pack_launch("sgd_update_dev", (p, g, buf, n, lr, momentum, dampening, weight_decay,
                                          int(bool(nesterov)), int(bool(first_step)), diverged), n, limits)


def adam_update_dev(p, g, m, v, scalars, beta1, beta2, eps, weight_decay, diverged,
                    limits=DeviceLimits()) -> KernelLaunch:
    """adam_update with `scalars` = [lr, step] a two-element float64 device array (read when the kernel runs),
    skipped while the int32 `diverged` flag is set."""
    n = _same_size("adam_update_dev", p, g, m, v)
    _device_doubles("adam_update_dev", scalars, 2)
    _device_flag("adam_update_dev", diverged)
    return pack_launch("adam_update_dev", (p, g, m, v, n, scalars, beta1, beta2, eps, weight_decay, diverged), n,
                       limits)


def adam_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("adam_update", p, g, m, v)
    if int(step) < 1:
        raise ValueError(f"adam_update: step is 1-based, got {step}")
    return pack_launch("adam_update", (p, g, m, v, n, lr, beta1, beta2, eps, weight_decay, int(step)), n, limits)


# -- pool.cu ---------------------------------------------------------------------------------------------------
def _pool_dims(name, x_shape, y_shape) -> tuple[int, ...]:
    xs, ys = tuple(x_shape), tuple(y_shape)
    if len(xs) != 4 or len(ys) != 4 or xs[:2] != ys[:2]:
        raise ValueError(f"{name}: input {xs} and output {ys} must be NCHW with the same N and C")
    return xs + ys[2:]


def maxpool2d_forward(y, x, kernel, stride, padding, dilation, limits=DeviceLimits()) -> KernelLaunch:
    dims = _pool_dims("maxpool2d_forward", x.shape, y.shape)
    return pack_launch("maxpool2d_forward", (y, x, *dims, *_pair(kernel), *_pair(stride), *_pair(padding),
                                             *_pair(dilation)), _size(y), limits)


def maxpool2d_backward(dx, dy, x, kernel, stride, padding, dilation, limits=DeviceLimits()) -> KernelLaunch:
    """The host must zero `dx` first (ZERO_OUTPUT_FIRST): the kernel adds into it atomically."""
    if tuple(dx.shape) != tuple(x.shape):
        raise ValueError(f"maxpool2d_backward: dx {tuple(dx.shape)} must match x {tuple(x.shape)}")
    dims = _pool_dims("maxpool2d_backward", x.shape, dy.shape)
    return pack_launch("maxpool2d_backward", (dx, dy, x, *dims, *_pair(kernel), *_pair(stride), *_pair(padding),
                                              *_pair(dilation)), _size(dy), limits)


def avgpool2d_forward(y, x, kernel, stride, padding, count_include_pad: bool, divisor_override: int = 0,
                      limits=DeviceLimits()) -> KernelLaunch:
    dims = _pool_dims("avgpool2d_forward", x.shape, y.shape)
    return pack_launch("avgpool2d_forward", (y, x, *dims, *_pair(kernel), *_pair(stride), *_pair(padding),
                                             int(bool(count_include_pad)), int(divisor_override)), _size(y), limits)


def avgpool2d_backward(dx, dy, kernel, stride, padding, count_include_pad: bool, divisor_override: int = 0,
                       limits=DeviceLimits()) -> KernelLaunch:
    dims = _pool_dims("avgpool2d_backward", dx.shape, dy.shape)
    return pack_launch("avgpool2d_backward", (dx, dy, *dims, *_pair(kernel), *_pair(stride), *_pair(padding),
                                              int(bool(count_include_pad)), int(divisor_override)), _size(dx),
                       limits)


def _gap_dims(name, x_shape, y_shape) -> tuple[int, int]:
    xs, ys = tuple(x_shape), tuple(y_shape)
    if len(xs) != 4 or ys != xs[:2]:
        raise ValueError(f"{name}: input must be (N, C, H, W) and output (N, C), got {xs} and {ys}")
    return xs[0] * xs[1], xs[2] * xs[3]


def global_avgpool_forward(y, x, limits=DeviceLimits()) -> KernelLaunch:
    nc, hw = _gap_dims("global_avgpool_forward", x.shape, y.shape)
    return pack_launch("global_avgpool_forward", (y, x, nc, hw), (nc, hw), limits)


def global_avgpool_backward(dx, dy, limits=DeviceLimits()) -> KernelLaunch:
    nc, hw = _gap_dims("global_avgpool_backward", dx.shape, dy.shape)
    return pack_launch("global_avgpool_backward", (dx, dy, nc, hw), _size(dx), limits)


# -- compress.cu (the SZ codec; layout as in minidl/codec/sz.py) -----------------------------------------------------
SZ_BLOCK = 256          # codes per block (one thread block of 256 threads)
SZ_PLANE_WORDS = 8      # 32-bit words per bit-plane of a block (SZ_BLOCK / 32)
SZ_MAX_PLANES = 64      # fixed plane slots per block before compaction


def _sz_blocks(name: str, n: int, nblocks: int) -> None:
    if nblocks != -(-n // SZ_BLOCK):
        raise ValueError(f"{name}: {n} codes need {-(-n // SZ_BLOCK)} blocks of {SZ_BLOCK}, got {nblocks}")


def sz_quantize(bins, outlier, x, eb, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("sz_quantize", bins, outlier, x)
    return pack_launch("sz_quantize", (bins, outlier, x, n, eb), n, limits)


def sz_encode_blocks(planes, widths, anchors, bins, limits=DeviceLimits()) -> KernelLaunch:
    n, nblocks = _size(bins), _same_size("sz_encode_blocks", widths, anchors)
    _sz_blocks("sz_encode_blocks", n, nblocks)
    if _size(planes) != nblocks * SZ_MAX_PLANES * SZ_PLANE_WORDS:
        raise ValueError(f"sz_encode_blocks: planes has {_size(planes)} words, expected "
                         f"{nblocks * SZ_MAX_PLANES * SZ_PLANE_WORDS} for {nblocks} blocks")
    return pack_launch("sz_encode_blocks", (planes, widths, anchors, bins, n, nblocks), (nblocks, SZ_BLOCK), limits)


def sz_gather_planes(body, planes, widths, starts, limits=DeviceLimits()) -> KernelLaunch:
    nblocks = _same_size("sz_gather_planes", widths, starts)
    work = nblocks * SZ_MAX_PLANES * SZ_PLANE_WORDS
    if _size(planes) != work:
        raise ValueError(f"sz_gather_planes: planes has {_size(planes)} words, expected {work}")
    return pack_launch("sz_gather_planes", (body, planes, widths, starts, nblocks), work, limits)


def sz_decode_blocks(y, body, widths, starts, anchors, eb, limits=DeviceLimits()) -> KernelLaunch:
    n, nblocks = _size(y), _same_size("sz_decode_blocks", widths, starts, anchors)
    _sz_blocks("sz_decode_blocks", n, nblocks)
    return pack_launch("sz_decode_blocks", (y, body, widths, starts, anchors, n, nblocks, eb), (nblocks, SZ_BLOCK),
                       limits)


def sz_scatter_outliers(y, idx, vals, limits=DeviceLimits()) -> KernelLaunch:
    n_out = _same_size("sz_scatter_outliers", idx, vals)
    return pack_launch("sz_scatter_outliers", (y, idx, vals, n_out), n_out, limits)


# -- seq.cu ----------------------------------------------------------------------------------------------------
def _rows_cols(name, x) -> tuple[int, int]:
    """(R, C) of a tensor read as rows of its last axis."""
    if len(x.shape) < 1:
        raise ValueError(f"{name}: a tensor of at least one axis is needed, got shape {tuple(x.shape)}")
    c = int(x.shape[-1])
    return (_size(x) // c if c else 0), c


def _vectors(name, c: int, **vectors) -> None:
    for label, v in vectors.items():
        if v is not None and _size(v) != c:
            raise ValueError(f"{name}: {label} holds {_size(v)} values, the rows have {c}")


def _row_stats(name, r: int, **stats) -> None:
    for label, v in stats.items():
        if _size(v) != r:
            raise ValueError(f"{name}: {label} holds {_size(v)} values for {r} rows")


def layernorm_forward(y, mean, rstd, x, w, b, eps: float, limits=DeviceLimits()) -> KernelLaunch:
    r, c = _rows_cols("layernorm_forward", x)
    _same_size("layernorm_forward", y, x)
    _vectors("layernorm_forward", c, w=w, b=b)
    _row_stats("layernorm_forward", r, mean=mean, rstd=rstd)
    return pack_launch("layernorm_forward", (y, mean, rstd, x, w, b, r, c, eps), (r, c), limits)


def layernorm_forward_apply(y, x, w, b, mean, rstd, limits=DeviceLimits()) -> KernelLaunch:
    r, c = _rows_cols("layernorm_forward_apply", x)
    _same_size("layernorm_forward_apply", y, x)
    _vectors("layernorm_forward_apply", c, w=w, b=b)
    _row_stats("layernorm_forward_apply", r, mean=mean, rstd=rstd)
    return pack_launch("layernorm_forward_apply", (y, x, w, b, mean, rstd, r, c), r * c, limits)


def layernorm_backward_dx(dx, x, w, dy, mean, rstd, limits=DeviceLimits()) -> KernelLaunch:
    r, c = _rows_cols("layernorm_backward_dx", x)
    _same_size("layernorm_backward_dx", dx, x, dy)
    _vectors("layernorm_backward_dx", c, w=w)
    _row_stats("layernorm_backward_dx", r, mean=mean, rstd=rstd)
    return pack_launch("layernorm_backward_dx", (dx, x, w, dy, mean, rstd, r, c), (r, c), limits)


#: Layer norm's weight and bias sums run in at most this many chunks of rows (a partial sum per chunk and column,
#: in float64: LN_CHUNKS x C x 16 bytes of scratch), each of at least LN_MIN_CHUNK rows.
LN_CHUNKS = 64
LN_MIN_CHUNK = 32


def layernorm_chunks(rows: int) -> tuple[int, int]:
    """(rows per chunk, chunks) of layer norm's weight and bias sums over `rows` rows."""
    chunk = max(LN_MIN_CHUNK, -(-rows // LN_CHUNKS))
    return chunk, max(1, -(-rows // chunk))


def layernorm_backward_partials(pw, pb, x, dy, mean, rstd, limits=DeviceLimits()) -> KernelLaunch:
    r, c = _rows_cols("layernorm_backward_partials", x)
    _same_size("layernorm_backward_partials", x, dy)
    _row_stats("layernorm_backward_partials", r, mean=mean, rstd=rstd)
    chunk, n = layernorm_chunks(r)
    for label, buf in (("pw", pw), ("pb", pb)):
        if _size(buf) < n * c or np.dtype(buf.dtype) != np.float64:
            raise ValueError(f"layernorm_backward_partials: {label} must hold {n} x {c} float64 partial sums, "
                             f"got {_size(buf)} {buf.dtype}")
    return pack_launch("layernorm_backward_partials", (pw, pb, x, dy, mean, rstd, r, c, chunk), n * c, limits)


def layernorm_backward_params(dw, db, pw, pb, rows: int, limits=DeviceLimits()) -> KernelLaunch:
    """dw, db from the partial sums `layernorm_backward_partials` left for `rows` rows."""
    c = _size(dw if dw is not None else db)
    _vectors("layernorm_backward_params", c, dw=dw, db=db)
    _, n = layernorm_chunks(rows)
    return pack_launch("layernorm_backward_params", (dw, db, pw, pb, n, c), c, limits)


def _exact(approximate: str) -> int:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return int(approximate == "none")


def gelu_forward(y, x, approximate: str, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("gelu_forward", y, x)
    return pack_launch("gelu_forward", (y, x, n, _exact(approximate)), n, limits)


def gelu_backward(dx, x, dy, approximate: str, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("gelu_backward", dx, x, dy)
    return pack_launch("gelu_backward", (dx, x, dy, n, _exact(approximate)), n, limits)


def softmax_forward(y, x, scale: float = 1.0, causal_t: int = 0, limits=DeviceLimits()) -> KernelLaunch:
    """Rows of x's last axis; `causal_t` > 0: x holds (T, T) score matrices (last axis T = causal_t) whose row
    r attends to keys 0..r mod T."""
    r, c = _rows_cols("softmax_forward", x)
    _same_size("softmax_forward", y, x)
    if causal_t and c != causal_t:
        raise ValueError(f"softmax_forward: a causal mask over {causal_t} keys needs rows of {causal_t}, got {c}")
    return pack_launch("softmax_forward", (y, x, r, c, scale, causal_t), (r, c), limits)


def softmax_backward(dx, y, dy, scale: float = 1.0, limits=DeviceLimits()) -> KernelLaunch:
    r, c = _rows_cols("softmax_backward", y)
    _same_size("softmax_backward", dx, y, dy)
    return pack_launch("softmax_backward", (dx, y, dy, r, c, scale), (r, c), limits)


def _table(name, idx, w, rows) -> tuple[int, int, int]:
    if len(w.shape) != 2:
        raise ValueError(f"{name}: the table must be (V, C), got shape {tuple(w.shape)}")
    v, c = (int(d) for d in w.shape)
    r = _size(idx)
    if _size(rows) != r * c:
        raise ValueError(f"{name}: {r} indices of rows of {c} values need {r * c} values, got {_size(rows)}")
    return r, c, v


def embedding_forward(y, w, idx, limits=DeviceLimits()) -> KernelLaunch:
    r, c, v = _table("embedding_forward", idx, w, y)
    return pack_launch("embedding_forward", (y, w, idx, r, c, v), r * c, limits)


#: embedding_backward runs about this many threads (vocabulary ranges x columns), at most one range per row of
#: the table: enough to fill a GPU, where one thread per column (C of them) would not.
EMBEDDING_THREADS = 1 << 16


def embedding_groups(c: int, v: int) -> int:
    """How many vocabulary ranges embedding_backward splits a (V, C) table's gradient into."""
    return max(1, min(v, -(-EMBEDDING_THREADS // max(1, c))))


def embedding_backward(dw, dy, idx, limits=DeviceLimits()) -> KernelLaunch:
    """dw must be zeroed first (`ZERO_OUTPUT_FIRST`): the kernel adds into it."""
    r, c, v = _table("embedding_backward", idx, dw, dy)
    groups = embedding_groups(c, v)
    return pack_launch("embedding_backward", (dw, dy, idx, r, c, v, groups), groups * c, limits)


#: kernel name -> the function that packs its launch (one per entry point of kernels/*.cu).
LAUNCHERS: dict[str, Callable[..., KernelLaunch]] = {
    f.__name__: f for f in (
        relu_forward, relu_backward, add_forward, accumulate, scale_copy, dropout_forward, dropout_backward,
        dropout_forward_dev, dropout_backward_dev, sgd_update_dev, adam_update_dev, nonfinite_flag,
        concat_copy_forward, concat_copy_backward, lrn_forward, lrn_backward, softmax_xent_forward,
        softmax_xent_mean, softmax_xent_backward, sgd_update, adam_update, maxpool2d_forward, maxpool2d_backward,
        avgpool2d_forward, avgpool2d_backward, global_avgpool_forward, global_avgpool_backward,
        sz_quantize, sz_encode_blocks, sz_gather_planes, sz_decode_blocks, sz_scatter_outliers,
        softmax_xent_ignore_forward, softmax_xent_ignore_mean, softmax_xent_ignore_scale,
        softmax_xent_ignore_backward, layernorm_forward, layernorm_forward_apply, layernorm_backward_dx,
        layernorm_backward_partials, layernorm_backward_params, gelu_forward, gelu_backward, softmax_forward,
        softmax_backward, embedding_forward, embedding_backward)
}
