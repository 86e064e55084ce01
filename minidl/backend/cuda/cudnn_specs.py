"""cuDNN graph parameters and convolution "algorithms", device-free (host-tested, no cuDNN needed).

`TensorDesc` is what `pygraph.tensor(...)` receives; `GraphKey` keys a built graph by op, shapes, dtypes, parameters
and engine filters, never a pointer. Half graphs (`--math bf16|fp16`) take and give half data (a bf16 tensor is its
uint16 bits: `halves`) and compute in float32: FLOAT compute and intermediates, float32 weight gradients, BN
parameters and statistics. Attention (`SDPASpec`) has half graphs only: cuDNN's SDPA, half q, k, v, o and their
gradients, float32 softmax statistics. Execution plans reach the planner as `cudnn:f<i>` (forward plan i) and
`cudnn:d<i>w<j>` (dgrad plan i, wgrad plan j, one workspace of max(ws_i, ws_j)). An accumulating backward runs
the `dgrad_add` graph under the same names, else `cudnn:d<i>w<j>+add`: dgrad into the workspace's head, added after.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ...core.vocab import WorkspaceOption
from ..common import conv_output_hw
from .halves import BF16_BITS, storage_dtype
from .views import CUDA_MALLOC_ALIGNMENT, contiguous_strides, element_strides, shape_tuple

_CUDNN_DTYPES = {
    np.dtype(np.float32): "FLOAT",
    np.dtype(np.float64): "DOUBLE",
    np.dtype(np.float16): "HALF",
    BF16_BITS: "BFLOAT16",   # a uint16 device array holds bf16 bits (`halves`)
    np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.int8): "INT8",
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.bool_): "BOOLEAN",
}


def cudnn_dtype_name(dtype) -> str:
    """The member name of `cudnn.data_type` for a numpy dtype (bfloat16 and its uint16 storage: BFLOAT16)."""
    dt = storage_dtype(dtype)
    try:
        return _CUDNN_DTYPES[dt]
    except KeyError:
        raise TypeError(f"no cuDNN data type for {dt}") from None


@dataclass(slots=True, frozen=True)
class TensorDesc:
    """The arguments of one `pygraph.tensor(...)`: `dim`/`stride` in elements; `by_value`: a scalar
    passed by host pointer (BN's epsilon and momentum)."""

    name: str
    dim: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str = "FLOAT"
    by_value: bool = False

    def inner(self) -> "TensorDesc":
        """This tensor as a float32 intermediate inside a graph (a virtual tensor: half graphs round only their
        outputs)."""
        return TensorDesc(self.name, self.dim, self.stride, "FLOAT", self.by_value)

    def kwargs(self) -> dict[str, Any]:
        """`pygraph.tensor`'s arguments but `data_type` (the adapter maps it)."""
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
    """A per-channel vector seen as (1, C, 1, 1), as cuDNN's BN parameters are."""
    c = int(channels)
    if c <= 0:
        raise ValueError(f"{name}: channel count must be positive, got {c}")
    return TensorDesc(name, (1, c, 1, 1), (c, 1, 1, 1), cudnn_dtype_name(dtype))


def scalar_desc(name: str, dtype=np.float32) -> TensorDesc:
    """A pass-by-value scalar (1, 1, 1, 1)."""
    return TensorDesc(name, (1, 1, 1, 1), (1, 1, 1, 1), cudnn_dtype_name(dtype), by_value=True)


@dataclass(slots=True, frozen=True)
class EngineFilters:
    """Which cuDNN engines a graph may use (part of its key): without `allow_tf32`, no DOWN_CONVERT_INPUTS
    (TF32: ~1e-3 off) and, but in a `half` mode ('bf16', 'fp16': tensor cores on half inputs, float32
    accumulation), no TENSOR_CORE; with `deterministic`, no NONDETERMINISTIC (atomics)."""

    allow_tf32: bool = False
    deterministic: bool = True
    half: str | None = None

    def numeric_notes(self) -> tuple[str, ...]:
        notes = []
        if not self.allow_tf32:
            notes += ["DOWN_CONVERT_INPUTS"] if self.half else ["TENSOR_CORE", "DOWN_CONVERT_INPUTS"]
        if self.deterministic:
            notes.append("NONDETERMINISTIC")
        return tuple(notes)


@dataclass(slots=True, frozen=True)
class GraphKey:
    """Cache key of a built cuDNN graph: shapes and parameters only."""

    op: str
    spec: Any          # ConvSpec | BNSpec | PointwiseSpec | SDPASpec (frozen dataclasses, hashable)
    filters: EngineFilters


def dtype_name(dtype) -> str:
    """A spec's dtype: the numpy name of the device storage ('float32', 'float16', 'uint16' for bf16)."""
    return storage_dtype(dtype).name


#: The layer kernels (`Layer.kernels()`) whose half forms run on cuDNN and cuBLAS (`Capabilities.half_kernels`):
#: conv.py's, dense.py's and norm.py's graphs, sequence.py's batched products. All of BatchNorm2d's kernels also have
#: the cupy fallback's half forms (`norm.HALF_KERNELS`), Conv2d's `accumulate` kernels of its own (`launches`).
HALF_KERNELS: frozenset[str] = frozenset({
    "conv2d_forward", "conv2d_backward", "linear_forward", "linear_backward", "matmul_forward", "matmul_backward",
    "batchnorm_forward_train", "batchnorm_forward_apply", "batchnorm_forward_eval", "batchnorm_backward"})


# -- convolution
CONV_OPS = ("fprop", "fprop_bias", "dgrad", "wgrad", "dgrad_add")


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
        return cls(x, w, y, stride, padding, dilation, groups, dtype_name(dtype))  # type: ignore[arg-type]

    def conv_kwargs(self) -> dict[str, list[int]]:
        """`padding=`, `stride=`, `dilation=` of the conv ops (padding symmetric, as PyTorch's)."""
        return {"padding": list(self.padding), "stride": list(self.stride), "dilation": list(self.dilation)}

    def descs(self) -> dict[str, TensorDesc]:
        """x (image), w (filter), y (output or its gradient), x_acc (the delta `dgrad_add` adds to), b (the bias
        `fprop_bias` adds, (1, Cout, 1, 1)), all in the spec's dtype; dw (wgrad's output) in float32, where
        weight gradients accumulate."""
        return {"x": nchw_desc("x", self.x, self.dtype), "w": nchw_desc("w", self.w, self.dtype),
                "y": nchw_desc("y", self.y, self.dtype), "x_acc": nchw_desc("x_acc", self.x, self.dtype),
                "b": channel_desc("b", self.w[0], self.dtype), "dw": nchw_desc("w", self.w, np.float32)}

    @property
    def half(self) -> bool:
        return self.dtype != "float32"

    def io(self, op: str) -> tuple[tuple[str, str], str]:
        """(graph inputs, output) of `op`: fprop (x, w) -> y, dgrad (y, w) -> x, wgrad (x, y) -> w;
        fprop_bias's y is conv + b, dgrad_add's x is dx + x_acc."""
        if op in ("fprop", "fprop_bias"):
            return ("x", "w"), "y"
        if op in ("dgrad", "dgrad_add"):
            return ("y", "w"), "x"
        if op == "wgrad":
            return ("x", "y"), "w"
        raise ValueError(f"unknown convolution op {op!r}; expected one of {CONV_OPS}")

    def key(self, op: str, filters: EngineFilters) -> GraphKey:
        self.io(op)  # validates op
        return GraphKey(f"conv_{op}", self, filters)


# -- batch normalization and pointwise
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
        return cls(x, dtype_name(dtype))  # type: ignore[arg-type]

    @property
    def channels(self) -> int:
        return self.x[1]

    @property
    def count(self) -> int:
        """Values per channel, N * H * W."""
        n, _, h, w = self.x
        return n * h * w

    def descs(self, op: str) -> dict[str, TensorDesc]:
        """The tensors of graph `op`, named as the backend's variant pack: x, y, dx, dy in the spec's dtype; the
        per-channel scale, bias, statistics and their gradients in float32."""
        c, dt = self.channels, self.dtype
        big = lambda name: nchw_desc(name, self.x, dt)  # noqa: E731
        vec = lambda name: channel_desc(name, c)        # noqa: E731
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
        return cls(shape_tuple(shape), dtype_name(dtype))  # type: ignore[arg-type]

    def dims4(self) -> tuple[int, int, int, int]:
        """The shape padded with trailing ones (or folded) to 4-D."""
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


SDPA_OPS = ("sdpa_fwd", "sdpa_bwd")


@dataclass(slots=True, frozen=True)
class SDPASpec:
    """Half scaled dot-product attention, (B, H, T, D) q, k, v -> o, with float32 softmax statistics (B, H, T, 1)
    packed. `qkv_stride`: the element strides of q, k, v and of their gradients (views of one (B, T, 3C) tensor
    and of its delta); `o_stride`: of o and dO (views of (B, T, C)). The key is the same for forward and for
    backward's recompute of o, so both run one graph and one plan."""

    b: int
    h: int
    t: int
    d: int
    causal: bool
    scale: float
    dtype: str
    qkv_stride: tuple[int, int, int, int]
    o_stride: tuple[int, int, int, int]

    @classmethod
    def from_views(cls, q, k, v, o, scale: float, causal: bool) -> "SDPASpec":
        """The spec of device views q, k, v, o (o: y in forward, dy in backward, whose layout o takes)."""
        shapes = {n: shape_tuple(a.shape) for n, a in (("q", q), ("k", k), ("v", v), ("o", o))}
        if len(shapes["q"]) != 4 or len(set(shapes.values())) != 1:
            raise ValueError(f"attention: q, k, v and the output must share one (B, H, T, D) shape, got {shapes}")
        strides = {n: element_strides(a) for n, a in (("q", q), ("k", k), ("v", v))}
        if len(set(strides.values())) != 1:
            raise ValueError(f"attention: q, k and v must be views of one (B, T, 3C) tensor (one layout), got "
                             f"element strides {strides}")
        b, h, t, d = shapes["q"]
        return cls(b, h, t, d, bool(causal), float(scale), dtype_name(q.dtype), strides["q"],  # type: ignore[arg-type]
                   element_strides(o))  # type: ignore[arg-type]

    @property
    def stats_shape(self) -> tuple[int, int, int, int]:
        return (self.b, self.h, self.t, 1)

    def descs(self, op: str) -> dict[str, TensorDesc]:
        """The tensors of graph `op`, named as the backend's variant pack: sdpa_fwd q, k, v -> o, stats;
        sdpa_bwd q, k, v, o, do, stats -> dq, dk, dv."""
        dims, dt = (self.b, self.h, self.t, self.d), cudnn_dtype_name(self.dtype)
        qkv = lambda name: TensorDesc(name, dims, self.qkv_stride, dt)   # noqa: E731
        out = lambda name: TensorDesc(name, dims, self.o_stride, dt)     # noqa: E731
        stats = TensorDesc("stats", self.stats_shape, contiguous_strides(self.stats_shape), "FLOAT")
        if op == "sdpa_fwd":
            return {"q": qkv("q"), "k": qkv("k"), "v": qkv("v"), "o": out("o"), "stats": stats}
        if op == "sdpa_bwd":
            return {"q": qkv("q"), "k": qkv("k"), "v": qkv("v"), "o": out("o"), "do": out("do"), "stats": stats,
                    "dq": qkv("dq"), "dk": qkv("dk"), "dv": qkv("dv")}
        raise ValueError(f"unknown attention op {op!r}; expected one of {SDPA_OPS}")

    def key(self, op: str, filters: EngineFilters) -> GraphKey:
        if op not in SDPA_OPS:
            raise ValueError(f"unknown attention op {op!r}; expected one of {SDPA_OPS}")
        return GraphKey(op, self, filters)


# -- execution plans as workspace options

@dataclass(slots=True, frozen=True)
class PlanInfo:
    """A built execution plan: its index in the engine-config list, engine name, workspace."""

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
    """Name of a backward with dgrad plan and wgrad plan; `add_after`: dgrad into the workspace, then added."""
    return f"{ALGO_PREFIX}d{int(dgrad_plan)}w{int(wgrad_plan)}" + (ADD_AFTER if add_after else "")


def adds_after(algo: str | None) -> bool:
    """Whether backward algorithm `algo` adds a dgrad written into its workspace."""
    return bool(algo) and algo.endswith(ADD_AFTER)


def dx_scratch_bytes(x_shape, dtype) -> int:
    """Bytes at the head of a `+add` workspace receiving dx, aligned for the plan's own workspace."""
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
    """Relative cost of the plan cuDNN's heuristics ranked `rank` (0: their first choice)."""
    return 1.0 + 0.1 * int(rank)


def pareto(cands: list[tuple[float, int, str]]) -> list[WorkspaceOption]:
    """Keep an option only if it needs less workspace than every faster one."""
    out: list[WorkspaceOption] = []
    best_ws = None
    for cost, ws, algo in sorted(cands, key=lambda c: (c[0], c[1], c[2])):
        if best_ws is None or ws < best_ws:
            out.append(WorkspaceOption(algo, ws, cost))
            best_ws = ws
    return out


def conv_options(phase: str, plans: Mapping[str, Sequence[PlanInfo]],
                 add_scratch: int | None = None) -> list[WorkspaceOption]:
    """A phase's workspace options, fastest first, from its built plans in heuristic order ('bwd' pairs
    dgrad with wgrad; `add_scratch`: the `+add` variants); dominated ones dropped."""
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
    """The simulator profile nearest GPU `name`; unknown: 'v100' (its slower link prefetches early)."""
    upper = (name or "").upper()
    for fragment, profile in _GPU_PROFILES:
        if fragment in upper:
            return profile
    return "v100"


def pick_plan(plans: Sequence[PlanInfo], limit: int) -> PlanInfo:
    """The first plan in heuristic order whose workspace fits `limit` bytes."""
    for p in plans:
        if p.workspace_bytes <= limit:
            return p
    sizes = ", ".join(f"{p.index}: {p.workspace_bytes}" for p in plans)
    raise ValueError(f"no cuDNN plan fits a workspace of {limit} bytes (plans: {sizes})")
