"""A model of cuDNN's convolution algorithms, for plans made for a GPU that is not here.

A plan for a simulated GPU must size its convolution workspaces the way cuDNN would on that GPU, not with the
CPU's menu (`minidl.backend.cpu.conv`): the CPU's im2col/Winograd table needs different scratch than cuDNN's
families, and a depth or batch claimed "for a K40c" is only as good as those sizes. `CudnnModel` stands in for
the CUDA backend when the route is built (it answers `conv_workspace_options`, as `CUDABackend` does from real
cuDNN execution plans): for each phase it lists cuDNN's algorithm families that apply to the shapes, each with

- a **workspace** from the shapes (the formulas below; float32 unless the dtype says otherwise), and
- a **time** from a roofline: max(FLOPs / (device FLOP/s x the family's efficiency), bytes / bandwidth), the
  FLOPs and bytes those of the family's method (a Winograd or FFT convolution does fewer multiplies than the
  direct sum and moves its workspace twice).

Families, per cuDNN's `cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t` (cuDNN developer guide, "Convolution
algorithms"), with the restrictions its documentation states (stride 1 for FFT and Winograd, 3x3 for fused
Winograd, padded image <= 256 for FFT, kernel <= 32 for FFT tiling, one group for the transform families):

=====================  ==========================================================================================
implicit_gemm          the GEMM done on the fly from the input: no workspace (vDNN's "memory-optimal" choice).
                       fwd IMPLICIT_GEMM, bwd-data ALGO_0, bwd-filter ALGO_0.
precomp_gemm           the same with a precomputed table of input offsets: int32 per (channel, tap) of the
                       filter and per output row/column (docs: "needs some workspace to store a precomputed set
                       of indices"; sizes here are an estimate of that table, a few KiB to a few MiB).
                       fwd IMPLICIT_PRECOMP_GEMM, bwd-data ALGO_1, bwd-filter ALGO_3.
gemm                   im2col of the whole batch, then one GEMM: C/g*kh*kw * Ho*Wo * N elements (the column
                       matrix Caffe builds per image, for the batch at once; SuperNeurons and vDNN describe it as
                       the large-workspace fast path). fwd GEMM, bwd-filter ALGO_1 (its column matrix).
fft                    transforms of the padded input, the filters and the output, each (H+2p) x ((W+2p)/2+1)
                       complex64 values: 8 B * Hf*(Wf/2+1) * (N*C + K*C + N*K) (the method of Vasilache et al.,
                       which cuDNN's FFT follows; the largest workspace of all, the one vDNN cites).
fft_tiling             the same on 32x32 tiles: the filters' transforms (K*C) plus one tile position of input and
                       output across the batch (N*C + N*K), 32 x 17 complex64 each: an estimate (cuDNN does not
                       document its tiling), kept below `fft` as the documentation says it is.
winograd               fused F(2x2, 3x3): transformed filters only, 16 * K*C values (estimate: the fused kernel
                       keeps its tiles in shared memory).
winograd_nonfused      F(4x4, 3x3) for 3x3, F(2x2, 5x5) for 5x5, every transform in global memory: 6x6 values
                       per tile per channel for input and output, per (k, c) for the filters:
                       4 B * 36 * (K*C + N*C*T + N*K*T), T the number of output tiles.
=====================  ==========================================================================================

Every size is an estimate from the method's data, not cuDNN's exact figure (cuDNN rounds, pads and versions
differ), not yet checked against a GPU: on one, the CUDA backend's `conv_workspace_options` (cuDNN's execution plans
and their exact workspaces) and an `--autotune` cache (their measured seconds) are what to compare with. The
per-family efficiencies are estimates too, chosen so that the ranking
matches what cuDNN's heuristics typically pick on large convolutions (Winograd and FFT ahead of the GEMMs for 3x3
and large 1-channel-heavy layers, implicit GEMM last), and are the first thing a measurement would correct.

The backward phase of a layer runs backward-data then backward-filter in one workspace (as the CUDA backend
does), so each backward option is a pair: workspace the larger of the two, time their sum; pairs slower than a
pair with no more workspace are dropped (`backend.cuda.cudnn_specs.pareto`, the CUDA backend's own rule).
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

NAME = "cudnn-model"
"""The backend name of plans made with this model: their algorithm names are the model's, so no real backend
runs them (the executor refuses a plan whose menu is another backend's)."""

#: Share of the device's peak FLOP/s each family reaches (estimates; see the module docstring).
EFFICIENCY = {"implicit_gemm": 0.35, "precomp_gemm": 0.5, "gemm": 0.6, "fft": 0.5, "fft_tiling": 0.45,
              "winograd": 0.55, "winograd_nonfused": 0.6}

FFT_MAX_SIZE = 256      # cuDNN: the padded image must be at most 256 x 256 for the (untiled) FFT algorithms
FFT_TILE = 32           # FFT tiling's tile side; kernels up to 32 fit a tile
COMPLEX = 8             # bytes of one complex64 value
INDEX = 4               # bytes of one int32 offset


@dataclass(slots=True, frozen=True)
class ConvShape:
    """One convolution's shapes and configuration: input (n, c, h, w), filters (k, c/g, kh, kw), output ho x wo."""

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
        """Multiply-adds of the direct sum, counted as 2 FLOPs: what a GEMM formulation computes."""
        return 2 * self.n * self.k * self.ho * self.wo * (self.c // self.groups) * self.kh * self.kw

    @property
    def tensor_bytes(self) -> int:
        """Input, filters and output, read or written once each."""
        return self.itemsize * (self.n * self.c * self.h * self.w + self.k * (self.c // self.groups) * self.kh
                                * self.kw + self.n * self.k * self.ho * self.wo)

    @property
    def unit_stride(self) -> bool:
        return self.stride == (1, 1) and self.dilation == (1, 1)


# -- workspace formulas ------------------------------------------------------------------------------------------
def precomp_bytes(s: ConvShape) -> int:
    """The offset table: one int32 per filter tap and channel, plus one per output row and column."""
    return INDEX * ((s.c // s.groups) * s.kh * s.kw + s.ho + s.wo)


def gemm_bytes(s: ConvShape) -> int:
    """im2col of the whole batch: (C/g * kh * kw) x (Ho * Wo) per sample, N samples."""
    return s.itemsize * s.n * (s.c // s.groups) * s.kh * s.kw * s.ho * s.wo


def fft_size(s: ConvShape) -> tuple[int, int]:
    """The transform's size: the padded input."""
    return s.h + 2 * s.padding[0], s.w + 2 * s.padding[1]


def fft_bytes(s: ConvShape) -> int:
    """Input, filter and output transforms of the padded image, half-spectrum complex64."""
    hf, wf = fft_size(s)
    return COMPLEX * hf * (wf // 2 + 1) * (s.n * s.c + s.k * s.c + s.n * s.k)


def fft_tiling_bytes(s: ConvShape) -> int:
    """The filters' transforms plus one tile position's input and output transforms across the batch."""
    return COMPLEX * FFT_TILE * (FFT_TILE // 2 + 1) * (s.k * s.c + s.n * s.c + s.n * s.k)


def winograd_bytes(s: ConvShape) -> int:
    """Fused F(2x2, 3x3): the transformed filters, 4x4 per (k, c)."""
    return s.itemsize * 16 * s.k * s.c


def winograd_tiles(s: ConvShape) -> tuple[int, int]:
    """(output tile side m, tile count): F(4x4, 3x3) for 3x3 kernels, F(2x2, 5x5) for 5x5; input tiles are
    (m + r - 1) = 6 on a side in both cases."""
    m = 4 if s.kh == 3 else 2
    return m, math.ceil(s.ho / m) * math.ceil(s.wo / m)


def winograd_nonfused_bytes(s: ConvShape) -> int:
    """Every transform in global memory: 6x6 values per tile per channel of input and output, per (k, c) filter."""
    _, t = winograd_tiles(s)
    return s.itemsize * 36 * (s.k * s.c + s.n * s.c * t + s.n * s.k * t)


# -- which families apply ----------------------------------------------------------------------------------------
def families(s: ConvShape, phase: str) -> list[str]:
    """The families cuDNN offers for `s` in `phase` ('fwd', 'dgrad' or 'wgrad'), by its documented limits."""
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


# -- time ---------------------------------------------------------------------------------------------------------
def family_flops(family: str, s: ConvShape) -> float:
    """FLOPs the family's method performs: the direct count for the GEMMs, fewer multiplies for Winograd
    (2.25x fewer for F(2x2,3x3), 4x for F(4x4,3x3), plus the transforms), and for FFT the transforms
    (5 n log2 n per complex transform) plus the pointwise complex products (8 FLOPs per multiply-add)."""
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
    """Roofline time of one phase with `family` on `device`: its FLOPs at the family's share of peak, or its
    bytes (tensors once, workspace written and read) at the memory bandwidth, whichever is longer."""
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
    """The CUDA backend's planning interface (`capabilities`, `conv_workspace_options`) answered by the model for
    `device`, so that a route built for a simulated GPU lists cuDNN's families with their modeled workspaces."""

    capabilities = Capabilities(name=NAME, device="gpu")  # what `backend_name` reads: plans made from the model

    def __init__(self, device: "DeviceProfile"):
        self.device = device
        self._options: dict[tuple, list[WorkspaceOption]] = {}   # per distinct convolution: a deep net has few

    def __repr__(self) -> str:
        return f"CudnnModel({self.device.name})"

    def __eq__(self, other) -> bool:   # routes are cached by backend: one model per device profile
        return isinstance(other, CudnnModel) and other.device == self.device

    def __hash__(self) -> int:
        return hash((NAME, self.device))

    def conv_workspace_options(self, phase: str, x_shape, w_shape, y_shape, stride, padding, dilation,
                               groups: int, dtype=np.float32) -> list[WorkspaceOption]:
        """The modeled options for `phase` ('fwd' or 'bwd'), fastest first; same signature as the backends'."""
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

