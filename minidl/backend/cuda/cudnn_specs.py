"""cuDNN graph parameters and convolution "algorithms", device-free (host-tested, no cuDNN needed).

`TensorDesc` is exactly what `pygraph.tensor(name=, dim=, stride=, data_type=)` receives; `ConvSpec.conv_kwargs()` the
`padding=/stride=/dilation=` lists of `conv_fprop`, `conv_dgrad`, `conv_wgrad`. `GraphKey` keys a built graph: op,
shapes, parameters and engine filters, never a pointer (pointers are bound per call). cuDNN's execution plans per
convolution reach the memory planner as `WorkspaceOption`s named `cudnn:f<i>` (forward plan i) and `cudnn:d<i>w<j>`
(dgrad plan i then wgrad plan j, sharing one workspace of max(ws_i, ws_j)): the fastest whose workspace fits wins.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ...core.vocab import WorkspaceOption
from ..common import conv_output_hw
from .views import contiguous_strides, shape_tuple

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
    shp = shape_tuple(shape)
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
CONV_OPS = ("fprop", "dgrad", "wgrad")


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
        x, w, y = shape_tuple(x_shape), shape_tuple(w_shape), shape_tuple(y_shape)
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
        """The three tensors of the convolution: x (image), w (filter), y (output / its gradient)."""
        return {"x": nchw_desc("x", self.x, self.dtype), "w": nchw_desc("w", self.w, self.dtype),
                "y": nchw_desc("y", self.y, self.dtype)}

    def io(self, op: str) -> tuple[tuple[str, str], str]:
        """(the two graph inputs, the output) of `op`, by tensor name: fprop (x, w) -> y, dgrad (y=dy, w) -> x=dx,
        wgrad (x, y=dy) -> w=dw."""
        if op == "fprop":
            return ("x", "w"), "y"
        if op == "dgrad":
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
        x = shape_tuple(x_shape)
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
        return cls(shape_tuple(shape), np.dtype(dtype).name)  # type: ignore[arg-type]

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
_FWD_RE = re.compile(r"^cudnn:f(\d+)$")
_BWD_RE = re.compile(r"^cudnn:d(\d+)w(\d+)$")


def fwd_algo(plan: int) -> str:
    """Algorithm name of forward plan `plan` of the fprop graph."""
    return f"{ALGO_PREFIX}f{int(plan)}"


def bwd_algo(dgrad_plan: int, wgrad_plan: int) -> str:
    """Algorithm name of backward with dgrad plan `dgrad_plan` and wgrad plan `wgrad_plan`."""
    return f"{ALGO_PREFIX}d{int(dgrad_plan)}w{int(wgrad_plan)}"


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


def conv_options(phase: str, plans: Mapping[str, Sequence[PlanInfo]]) -> list[WorkspaceOption]:
    """Workspace options of a convolution phase, fastest first, from the built plans of its graphs (each list in
    cuDNN's heuristic order). 'fwd' reads plans['fprop']; 'bwd' pairs plans['dgrad'] with plans['wgrad'].
    Dominated options (slower and no smaller) are dropped."""
    if phase == "fwd":
        fp = plans["fprop"]
        if not fp:
            raise ValueError("conv2d fwd: cuDNN offers no execution plan")
        return pareto([(plan_cost(r), p.workspace_bytes, fwd_algo(p.index)) for r, p in enumerate(fp)])
    if phase == "bwd":
        dg, wg = plans["dgrad"], plans["wgrad"]
        if not dg or not wg:
            raise ValueError("conv2d bwd: cuDNN offers no execution plan for dgrad or wgrad")
        cands = [(plan_cost(rd) + plan_cost(rw), max(d.workspace_bytes, w.workspace_bytes), bwd_algo(d.index, w.index))
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
