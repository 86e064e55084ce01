"""A model of cuDNN's convolution algorithms, for plans made for a GPU that is not here.

`CudnnModel` answers `conv_workspace_options` as `CUDABackend` does: per phase, the cuDNN families
(`cudnnConvolution*Algo_t`, with the documented limits) with a workspace from the method's data and a roofline
time, max(FLOPs / (peak x `EFFICIENCY`), bytes / bandwidth). Sizes and efficiencies are estimates, not yet
checked on a GPU. A backward option is a (dgrad, wgrad) pair in one workspace, times summed, Pareto-filtered.
Enums: implicit_gemm = fwd IMPLICIT_GEMM, data ALGO_0, filter ALGO_0; precomp_gemm = IMPLICIT_PRECOMP_GEMM,
data ALGO_1, filter ALGO_3; gemm = GEMM, filter ALGO_1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..backend.base import Capabilities
from ..backend.cuda.cudnn_specs import pareto
from ..core.vocab import WorkspaceOption

if TYPE_CHECKING:  # pragma: no cover
    from .simulate import DeviceProfile

NAME = "cudnn-model"  # a plan's backend name: no real backend runs the model's algorithm names

#: Share of the device's peak FLOP/s each family reaches (estimates ranked as cuDNN's heuristics pick).
EFFICIENCY = {"implicit_gemm": 0.35, "precomp_gemm": 0.5, "gemm": 0.6, "fft": 0.5, "fft_tiling": 0.45,
              "winograd": 0.55, "winograd_nonfused": 0.6}

FFT_MAX_SIZE = 256      # pixels a side of the padded image for the untiled FFT (cuDNN's limit)
FFT_TILE = 32           # FFT tiling's tile side, pixels
COMPLEX = 8             # bytes of one complex64 value
INDEX = 4               # bytes of one int32 offset


@dataclass(slots=True, frozen=True)
class ConvShape:
    """One convolution: input (n, c, h, w), filters (k, c/g, kh, kw), output ho x wo."""

    n: int
    c: int
    h: int
    w: int
    k: int
    kh: int
    kw: int
    ho: int
    wo: int
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    itemsize: int = 4

    @property
    def direct_flops(self) -> int:
        """2 x the direct sum's multiply-adds: what a GEMM formulation computes."""
        return 2 * self.n * self.k * self.ho * self.wo * (self.c // self.groups) * self.kh * self.kw

    @property
    def tensor_bytes(self) -> int:
        """Input, filters and output, read or written once each."""
        return self.itemsize * (self.n * self.c * self.h * self.w + self.k * (self.c // self.groups) * self.kh
                                * self.kw + self.n * self.k * self.ho * self.wo)

    @property
    def unit_stride(self) -> bool:
        return self.stride == (1, 1) and self.dilation == (1, 1)


# -- workspace formulas
def precomp_bytes(s: ConvShape) -> int:
    """The offset table: int32 per filter tap and channel, and per output row and column."""
    return INDEX * ((s.c // s.groups) * s.kh * s.kw + s.ho + s.wo)


def gemm_bytes(s: ConvShape) -> int:
    """im2col of the whole batch: (C/g * kh * kw) x (Ho * Wo) per sample, N samples."""
    return s.itemsize * s.n * (s.c // s.groups) * s.kh * s.kw * s.ho * s.wo


def fft_size(s: ConvShape) -> tuple[int, int]:
    return s.h + 2 * s.padding[0], s.w + 2 * s.padding[1]


def fft_bytes(s: ConvShape) -> int:
    """Input, filter and output transforms of the padded image, half-spectrum complex64 (Vasilache et al.)."""
    hf, wf = fft_size(s)
    return COMPLEX * hf * (wf // 2 + 1) * (s.n * s.c + s.k * s.c + s.n * s.k)


def fft_tiling_bytes(s: ConvShape) -> int:
    """Filters' transforms plus one 32x32 tile position's input and output across the batch."""
    return COMPLEX * FFT_TILE * (FFT_TILE // 2 + 1) * (s.k * s.c + s.n * s.c + s.n * s.k)


def winograd_bytes(s: ConvShape) -> int:
    """Fused F(2x2, 3x3): the transformed filters only (tiles stay in shared memory)."""
    return s.itemsize * 16 * s.k * s.c


def winograd_tiles(s: ConvShape) -> tuple[int, int]:
    """(output tile side m, tile count): F(4x4, 3x3) for 3x3, F(2x2, 5x5) for 5x5."""
    m = 4 if s.kh == 3 else 2
    return m, math.ceil(s.ho / m) * math.ceil(s.wo / m)


def winograd_nonfused_bytes(s: ConvShape) -> int:
    """Every transform in global memory: 6x6 values per tile and channel, per filter."""
    _, t = winograd_tiles(s)
    return s.itemsize * 36 * (s.k * s.c + s.n * s.c * t + s.n * s.k * t)


# -- which families apply
def families(s: ConvShape, phase: str) -> list[str]:
    """The families cuDNN offers for `s` in `phase` ('fwd', 'dgrad' or 'wgrad')."""
    out = ["implicit_gemm", "precomp_gemm"]
    if phase in ("fwd", "wgrad"):
        out.append("gemm")           # backward data has no explicit-GEMM algorithm
    if s.groups != 1 or not s.unit_stride:
        return out
    hf, wf = fft_size(s)
    if hf <= FFT_MAX_SIZE and wf <= FFT_MAX_SIZE and s.kh <= hf and s.kw <= wf and s.padding[0] < s.kh \
            and s.padding[1] < s.kw:
        out.append("fft")
    if s.kh <= FFT_TILE and s.kw <= FFT_TILE and s.padding[0] < s.kh and s.padding[1] < s.kw:
        out.append("fft_tiling")
    if (s.kh, s.kw) == (3, 3) and phase != "wgrad":
        out.append("winograd")       # fused Winograd: forward and backward data only
    if (s.kh, s.kw) in ((3, 3), (5, 5)):
        out.append("winograd_nonfused")
    return out


WORKSPACE = {"implicit_gemm": lambda s: 0, "precomp_gemm": precomp_bytes, "gemm": gemm_bytes, "fft": fft_bytes,
             "fft_tiling": fft_tiling_bytes, "winograd": winograd_bytes,
             "winograd_nonfused": winograd_nonfused_bytes}


def workspace_bytes(family: str, s: ConvShape) -> int:
    return int(WORKSPACE[family](s))


# -- time
def family_flops(family: str, s: ConvShape) -> float:
    """FLOPs of the family's method: direct for the GEMMs; Winograd's fewer products plus transforms;
    FFT's transforms (5 n log2 n each) plus pointwise complex products (8 FLOPs a multiply-add)."""
    if family in ("implicit_gemm", "precomp_gemm", "gemm"):
        return float(s.direct_flops)
    if family in ("winograd", "winograd_nonfused"):
        if family == "winograd":
            m, t = 2, math.ceil(s.ho / 2) * math.ceil(s.wo / 2)
        else:
            m, t = winograd_tiles(s)
        a = m + s.kh - 1
        products = 2 * s.n * s.k * s.c * t * a * a
        transforms = 2 * a * a * a * t * s.n * (s.c + s.k)   # B^T d B and A^T m A per tile and channel
        return float(products + transforms)
    if family == "fft":
        hf, wf = fft_size(s)
        n_pts, tiles = hf * wf, 1
    else:
        n_pts = FFT_TILE * FFT_TILE
        tiles = math.ceil(s.ho / (FFT_TILE - s.kh + 1)) * math.ceil(s.wo / (FFT_TILE - s.kw + 1))
    per_transform = 5 * n_pts * math.log2(max(n_pts, 2))
    transforms = per_transform * (tiles * s.n * (s.c + s.k) + s.k * s.c)
    pointwise = 8 * s.n * s.k * s.c * tiles * (n_pts // 2 + n_pts % 2 + 1)
    return float(transforms + pointwise)


def family_seconds(family: str, s: ConvShape, device: "DeviceProfile") -> float:
    """Roofline time of one phase: FLOPs at the family's share of peak, or bytes (workspace written
    and read) at the bandwidth, whichever is longer."""
    flops = family_flops(family, s)
    nbytes = s.tensor_bytes + 2 * workspace_bytes(family, s)
    return max(flops / (device.flops * EFFICIENCY[family]), nbytes / device.mem_bw)


def options(s: ConvShape, phase: str, device: "DeviceProfile") -> list[WorkspaceOption]:
    """One phase's options ('fwd', 'dgrad' or 'wgrad'), est_cost in modeled seconds, fastest first."""
    opts = [WorkspaceOption(f, workspace_bytes(f, s), family_seconds(f, s, device)) for f in families(s, phase)]
    return sorted(opts, key=lambda o: (o.est_cost, o.workspace_bytes, o.algo))


def fwd_algo(family: str) -> str:
    return f"cudnn:{family}"


def bwd_algo(dgrad: str, wgrad: str) -> str:
    return f"cudnn:d:{dgrad}+w:{wgrad}"


class CudnnModel:
    """The CUDA backend's planning interface answered by the model for `device`."""

    capabilities = Capabilities(name=NAME, device="gpu")

    def __init__(self, device: "DeviceProfile"):
        self.device = device
        self._options: dict[tuple, list[WorkspaceOption]] = {}   # per distinct convolution

    def __repr__(self) -> str:
        return f"CudnnModel({self.device.name})"

    def __eq__(self, other) -> bool:   # routes are cached by backend: one model per device profile
        return isinstance(other, CudnnModel) and other.device == self.device

    def __hash__(self) -> int:
        return hash((NAME, self.device))

    def conv_workspace_options(self, phase: str, x_shape, w_shape, y_shape, stride, padding, dilation,
                               groups: int, dtype=np.float32, accumulate: bool = False) -> list[WorkspaceOption]:
        """The modeled options for `phase`, fastest first; an accumulating backward is
        the plain one (the add runs in dgrad's epilogue, no workspace)."""
        key = (phase, tuple(x_shape), tuple(w_shape), tuple(y_shape), tuple(stride), tuple(padding), tuple(dilation),
               groups, np.dtype(dtype).str)
        if key not in self._options:
            self._options[key] = self._modeled(phase, x_shape, w_shape, y_shape, stride, padding, dilation, groups,
                                               dtype)
        return [WorkspaceOption(o.algo, o.workspace_bytes, o.est_cost) for o in self._options[key]]

    def _modeled(self, phase: str, x_shape, w_shape, y_shape, stride, padding, dilation, groups: int,
                 dtype) -> list[WorkspaceOption]:
        n, c, h, w = x_shape
        k, _, kh, kw = w_shape
        s = ConvShape(n, c, h, w, k, kh, kw, y_shape[2], y_shape[3], tuple(stride), tuple(padding),
                      tuple(dilation), groups, np.dtype(dtype).itemsize)
        if phase == "fwd":
            return pareto([(o.est_cost, o.workspace_bytes, fwd_algo(o.algo)) for o in options(s, "fwd", self.device)])
        if phase == "bwd":
            dg, wg = options(s, "dgrad", self.device), options(s, "wgrad", self.device)
            return pareto([(d.est_cost + g.est_cost, max(d.workspace_bytes, g.workspace_bytes),
                            bwd_algo(d.algo, g.algo)) for d in dg for g in wg])
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")

