"""Convolution kernels of the CPU backend (NCHW; weight (Cout, Cin/groups, kh, kw) as in PyTorch).

With K = Cin/groups * kh * kw, P = Ho * Wo and cols[n, g] the (K, P) column matrix of sample n and group g:

    y[n, g]     = W[g] @ cols[n, g]                        one GEMM per sample and group
    dW[g]       = sum over n = 0 .. N-1 (in order) of dy[n, g] @ cols[n, g].T
    dcols[n, g] = W[g].T @ dy[n, g]; col2im: dx = sum over the kh*kw taps in row-major order

Rules: the im2col family (`im2col`, `im2col_chunked`, `gemm_1x1`) runs the same GEMMs on the same operands and
differs only in workspace; the other formulations (`_RowShift`, `_Grouped`, `cpu.winograd`) are chosen by the
shapes alone, one per layer's menu: a layer's sums never depend on its workspace. A one-thread BLAS
(`cpu.lanes.blas_pinned`) and blocks fixed by the shapes: no bits depend on the threads. An accumulating
backward gives exactly delta + (a plain call's dx). `conv_workspace_bytes` is the one source of the workspace.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...core.vocab import WorkspaceOption
from ..common import conv_output_hw
from . import lanes
from . import winograd as cpu_winograd
from .jit import gemm_kernels, lazy, workers_for
from .workspace import align, view

rows_jit = lazy("rows_jit")


def _compiled_rows() -> bool:
    """Whether the row-shift pair runs compiled (`cpu.rows_jit`): decided once per process."""
    return rows_jit() is not None and gemm_kernels().available()


IM2COL_ALGOS = ("im2col", "im2col_chunked", "gemm_1x1")
ROW_ALGOS = ("rows", "rows_chunked")
GROUPED = "im2col_grouped"
WINOGRAD = "winograd"
WINOGRAD_BY_POSITION = "winograd_by_position"
WINOGRAD_ALGOS = (WINOGRAD, WINOGRAD_BY_POSITION)
OBJECT_ALGOS = ROW_ALGOS + (GROUPED,) + WINOGRAD_ALGOS  # run by the layer's own algorithm object
ALGOS = IM2COL_ALGOS + OBJECT_ALGOS
_CHUNK = 1  # samples per chunk of `im2col_chunked` / `rows_chunked`
_SUB = 4  # samples per product of the row-shift forward (its scratch holds this many outputs)
_GROUP_COLS = 512  # `im2col_grouped`: columns per GEMM at least
_GROUPED_MAX_P = 196  # `im2col_grouped`: output pixels at most (14x14)
_GROUPED_MIN_K = 1024  # `im2col_grouped`: column rows at least (smaller strided 1x1s gained nothing, measured)
_WINOGRAD_OVER_GROUPED_P = 196
_GROUPED_MAX_P_OVER_ROWS = 64  # stride-2 3x3, ResNet-50 b1: 28->14 rows 6.2 / grouped 7.3 ms, 14->7 18.6 / 8.6
_DW_PIECE_MIN_MACS = 1 << 21  # multiply-adds per sample of each weight-gradient row block
# Rough relative costs (the planner measures real ones): the family differs only in im2col traffic.
EST_COST = {"gemm_1x1": 0.9, "im2col": 1.0, "im2col_chunked": 1.1, "rows": 0.7, "rows_chunked": 0.75,
            "im2col_grouped": 0.7, "winograd": 0.5, "winograd_by_position": 1.25}


@dataclass(slots=True, frozen=True)
class ConvGeometry:
    """Shapes of one convolution (all ints), derived from the input and weight shapes."""

    n: int
    cin: int
    h: int
    w: int
    cout: int
    kh: int
    kw: int
    ho: int
    wo: int
    groups: int
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)

    @property
    def k(self) -> int:
        """Rows of one group's column matrix."""
        return self.cin // self.groups * self.kh * self.kw

    @property
    def p(self) -> int:
        return self.ho * self.wo


def is_1x1(kernel, stride, padding, dilation) -> bool:
    """Whether `gemm_1x1` applies: the input itself is the column matrix."""
    return tuple(kernel) == (1, 1) and tuple(stride) == (1, 1) and tuple(padding) == (0, 0) \
        and tuple(dilation) == (1, 1)


def _chunk(algo: str, n: int) -> int:
    return n if algo == "im2col" else min(n, _CHUNK)


def _layout(algo: str, phase: str, g: ConvGeometry, itemsize: int, accumulate: bool = False) -> tuple[int, int, int]:
    """(column bytes, dW product offset, total bytes) of `algo`'s workspace in `phase`."""
    cols = 0 if algo == "gemm_1x1" else _chunk(algo, g.n) * g.groups * g.k * g.p * itemsize
    if phase == "fwd":
        return cols, 0, cols
    # backward: columns (then dcols in the same memory) + a weight-sized dW product when N > 1
    prod = g.cout * g.k * itemsize if g.n > 1 else 0
    off = align(cols) if prod else cols
    tile = _accumulate_tile(algo, g, itemsize) if accumulate else 0
    return cols, off, max(off + prod, align(cols) + tile if tile else 0)


def _taps_overlap(g: ConvGeometry) -> bool:
    """Whether two kernel taps reach one input value (else col2im adds each dcol once)."""
    return (g.kh - 1) * g.dilation[0] >= g.stride[0] or (g.kw - 1) * g.dilation[1] >= g.stride[1]


def _accumulate_tile(algo: str, g: ConvGeometry, itemsize: int) -> int:
    """Bytes of the one-sample dx tile an accumulating im2col-family backward needs: where a GEMM
    (gemm_1x1) or overlapping taps sum into dx."""
    if algo == "gemm_1x1" or (algo in IM2COL_ALGOS + (GROUPED,) and _taps_overlap(g)):
        return g.cin * g.h * g.w * itemsize
    return 0


def uses_rows(kernel, stride, groups: int = 1) -> bool:
    """Whether the row-shift formulation runs: one group, stride 1 with kh > 1, or stride 2 with kh = 3
    (a stride-2 7x7 stem keeps im2col: K = Cin*kw is too short for the BLAS)."""
    sh, kh = int(stride[0]), int(kernel[0])
    return int(groups) == 1 and ((sh == 1 and kh > 1) or (sh == 2 and kh == 3))


def uses_grouped(g: ConvGeometry) -> bool:
    """Whether `im2col_grouped` runs: one group, not a plain 1x1, P <= `_GROUPED_MAX_P`, K >=
    `_GROUPED_MIN_K` (a 49-column GEMM: ~115 GFLOPS, 8 samples side by side ~155); a stride-2 3x3 only up to
    `_GROUPED_MAX_P_OVER_ROWS` pixels."""
    if g.stride[0] == 2 and uses_rows((g.kh, g.kw), g.stride, g.groups) and g.p > _GROUPED_MAX_P_OVER_ROWS:
        return False
    return (g.groups == 1 and g.p <= _GROUPED_MAX_P and g.k >= _GROUPED_MIN_K
            and not is_1x1((g.kh, g.kw), g.stride, g.padding, g.dilation))


def _blas_scope(g: ConvGeometry):
    """The BLAS threads a convolution runs with: one, always (`cpu.lanes.blas_pinned`)."""
    return lanes.blas_pinned()


def _winograd_over_grouped(g: ConvGeometry) -> bool:
    """Winograd over `im2col_grouped` on planes of at least 14x14 with at most
    `cpu.winograd.MAX_SPLIT_CHANNELS` channels (measured, 2-core EPYC: (8, 256, 14, 14) 24.8 against 39.5 ms)."""
    return g.p >= _WINOGRAD_OVER_GROUPED_P and max(g.cin, g.cout) <= cpu_winograd.MAX_SPLIT_CHANNELS


def _compiled_weight_grad(g: ConvGeometry, dtype) -> bool:
    """Whether the im2col family's weight gradient runs compiled: one group, float32/64, numba
    and a bound GEMM (never the algorithm, so the family sums alike)."""
    k = gemm_kernels()
    return g.groups == 1 and dtype in (np.float32, np.float64) and k is not None and k.available()


def weight_grad_pieces(g: ConvGeometry) -> int:
    """Fixed row blocks of a compiled weight gradient: two from `_DW_PIECE_MIN_MACS` a block."""
    return 2 if g.cout >= 32 and g.cout * g.k * g.p >= 2 * _DW_PIECE_MIN_MACS else 1


def _sum_weight_grad(g: ConvGeometry, dy3: np.ndarray, cols3: np.ndarray, dw2: np.ndarray,
                     accumulate: bool) -> None:
    """dW (+)= sum over samples in order of dy3[s] @ cols3[s].T, accumulated in the BLAS (beta 1:
    ResNet-50's (2048, 512) 1x1, batch 8: 9.7 -> 6.4 ms), in `weight_grad_pieces` row blocks."""
    k = gemm_kernels()
    pieces = weight_grad_pieces(g)
    workers = min(pieces, k.workers())
    if workers > 1:
        with lanes.blas_pinned():
            k.sum_products_nt_pieces(dy3, cols3, dw2, accumulate, pieces, workers)
        return
    m = dw2.shape[0]
    for q in range(pieces):
        k.sum_products_nt(dy3, cols3, dw2, accumulate, m * q // pieces, m * (q + 1) // pieces)


def conv_algorithms(kernel, stride, padding, dilation, groups: int = 1, geom: ConvGeometry | None = None,
                    winograd: bool = True) -> list[str]:
    """The algorithms a configuration runs: Winograd or `im2col_grouped` (shapes in `geom`), else
    the row-shift pair, else the im2col family."""
    if geom is not None and winograd and cpu_winograd.applies(geom) and (
            not uses_grouped(geom) or _winograd_over_grouped(geom)):
        return list(WINOGRAD_ALGOS)
    if geom is not None and uses_grouped(geom):
        return [GROUPED]
    if uses_rows(kernel, stride, groups):
        return list(ROW_ALGOS)
    ok_1x1 = is_1x1(kernel, stride, padding, dilation)
    return [a for a in IM2COL_ALGOS if a != "gemm_1x1" or ok_1x1]


def conv_options(phase: str, geom: ConvGeometry, itemsize: int, stride, padding, dilation, winograd: bool = True,
                 accumulate: bool = False):
    """list[WorkspaceOption] for `phase`, by EST_COST then workspace."""

    if phase not in ("fwd", "bwd"):
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
    opts = [WorkspaceOption(a, conv_workspace_bytes(a, phase, geom, itemsize, accumulate), EST_COST[a])
            for a in conv_algorithms((geom.kh, geom.kw), stride, padding, dilation, geom.groups, geom, winograd)]
    return sorted(opts, key=lambda o: (o.est_cost, o.workspace_bytes))


def conv_workspace_bytes(algo: str, phase: str, geom: ConvGeometry, itemsize: int, accumulate: bool = False) -> int:
    """Exact workspace bytes of `algo` in `phase` ('fwd' or 'bwd')."""
    if algo not in ALGOS:
        raise ValueError(f"unknown convolution algorithm {algo!r}; expected one of {ALGOS}")
    if phase not in ("fwd", "bwd"):
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
    if accumulate and phase != "bwd":
        raise ValueError(f"conv2d {phase}: only the backward accumulates (into dx)")
    if algo in ROW_ALGOS:
        return _RowShift(geom, algo, itemsize).total(phase, accumulate)
    if algo == GROUPED:
        return _Grouped(geom, itemsize).total(phase, accumulate)
    if algo in WINOGRAD_ALGOS:
        return cpu_winograd._Winograd(geom, itemsize, by_position=algo == WINOGRAD_BY_POSITION).total(phase,
                                                                                                      accumulate)
    return _layout(algo, phase, geom, itemsize, accumulate)[2]


# -- kernel taps
@dataclass(slots=True, frozen=True)
class _Tap:
    """Kernel offset (i, j): outputs [oh0, oh0+nh) x [ow0, ow0+nw) read inputs from (ih0, iw0) by the stride;
    its other outputs read padding."""

    i: int
    j: int
    oh0: int
    nh: int
    ih0: int
    ow0: int
    nw: int
    iw0: int


def _axis_range(i: int, size_in: int, size_out: int, stride: int, pad: int, dil: int) -> tuple[int, int, int]:
    off = i * dil - pad
    lo = max(0, -(off // stride))  # first output whose input is >= 0
    hi = min(size_out, (size_in - 1 - off) // stride + 1)
    n = max(0, hi - lo)
    return lo, n, lo * stride + off


def _taps(g: ConvGeometry, stride, padding, dilation) -> list[_Tap]:
    """All kh*kw taps in row-major order (nh or nw 0: entirely in the padding)."""
    rows = [_axis_range(i, g.h, g.ho, stride[0], padding[0], dilation[0]) for i in range(g.kh)]
    cols = [_axis_range(j, g.w, g.wo, stride[1], padding[1], dilation[1]) for j in range(g.kw)]
    return [_Tap(i, j, *rows[i], *cols[j]) for i in range(g.kh) for j in range(g.kw)]


def _src(x: np.ndarray, t: _Tap, stride) -> np.ndarray:
    sh, sw = stride
    return x[:, :, t.ih0:t.ih0 + (t.nh - 1) * sh + 1:sh, t.iw0:t.iw0 + (t.nw - 1) * sw + 1:sw]


def _flat_rows(x: np.ndarray, stride, out_w: int) -> bool:
    """Whether a tap is one flat run per plane (stride 1, 'same' width); positions wrapped to the next
    row read padding and are zeroed."""
    return tuple(stride) == (1, 1) and x.shape[3] == out_w


def _run(t: _Tap, width: int) -> tuple[int, int, int]:
    """Flat (first output, end output, first input) of tap t's run."""
    q0 = t.oh0 * width + t.ow0
    q1 = (t.oh0 + t.nh - 1) * width + t.ow0 + t.nw
    return q0, q1, t.ih0 * width + t.iw0


def _zero_wrapped(dst: np.ndarray, t: _Tap) -> None:
    """Zero the columns of tap t's rows that read padding (dst (c, C, Ho, Wo))."""
    band = dst[:, :, t.oh0:t.oh0 + t.nh]
    if t.ow0 > 0:
        band[..., :t.ow0].fill(0)
    if t.ow0 + t.nw < dst.shape[3]:
        band[..., t.ow0 + t.nw:].fill(0)


_IM2COL_SPLIT_MIN = 1 << 20  # column elements from which a multi-sample im2col is split over the lanes


def _im2col(x: np.ndarray, cols6: np.ndarray, taps: list[_Tap], stride) -> None:
    """cols6 (c, C, kh, kw, Ho, Wo) <- the taps of x, zeros in the padding; samples split over the lanes."""
    _by_samples(_im2col_part, cols6.size, (x, cols6), (taps, stride))


def _by_samples(part, size: int, arrays: tuple, rest: tuple) -> None:
    """part(*arrays, *rest), the first axis split over the lanes from `_IM2COL_SPLIT_MIN` elements."""
    n = arrays[0].shape[0]
    lanes_n = min(lanes.count(), n)
    if lanes_n > 1 and size >= _IM2COL_SPLIT_MIN:
        lanes.run([lambda a=a, b=b: part(*(v[a:b] for v in arrays), *rest) for a, b in lanes.split(n, lanes_n)])
        return
    part(*arrays, *rest)


def _im2col_part(x: np.ndarray, cols6: np.ndarray, taps: list[_Tap], stride) -> None:
    c, ch, _, _, ho, wo = cols6.shape
    flat = _flat_rows(x, stride, wo)
    if flat:
        xf = _as(x, (c, ch, -1))
    for t in taps:
        dst = cols6[:, :, t.i, t.j]
        if t.nh == 0 or t.nw == 0:
            dst.fill(0)
            continue
        if flat:
            df = _as(dst, (c, ch, ho * wo))
            q0, q1, x0 = _run(t, wo)
            np.copyto(df[..., q0:q1], xf[..., x0:x0 + q1 - q0])
            df[..., :q0].fill(0)
            df[..., q1:].fill(0)
            _zero_wrapped(dst, t)
            continue
        if t.oh0 > 0:
            dst[:, :, :t.oh0].fill(0)
        if t.oh0 + t.nh < ho:
            dst[:, :, t.oh0 + t.nh:].fill(0)
        _zero_wrapped(dst, t)
        np.copyto(dst[:, :, t.oh0:t.oh0 + t.nh, t.ow0:t.ow0 + t.nw], _src(x, t, stride))


def _col2im(dcols6: np.ndarray, dx: np.ndarray, taps: list[_Tap], stride, accumulate: bool = False,
            tile: np.ndarray | None = None) -> None:
    """dx (+)= the sum, tap by tap in row-major order, of dcols6 scattered back; accumulating over
    overlapping taps, each sample is finished in `tile` and then added. dcols6 is scratch."""
    if accumulate and tile is not None:
        for k in range(dx.shape[0]):
            _col2im_part(dcols6[k:k + 1], tile[None], taps, stride, False)
            np.add(dx[k], tile, out=dx[k])
        return
    _by_samples(_col2im_part, dcols6.size, (dcols6, dx), (taps, stride, accumulate))


def _col2im_part(dcols6: np.ndarray, dx: np.ndarray, taps: list[_Tap], stride, accumulate: bool) -> None:
    c, ch, _, _, ho, wo = dcols6.shape
    if len(taps) == 1 and taps[0].nh == dx.shape[2] and taps[0].nw == dx.shape[3] and tuple(stride) == (1, 1):
        t = taps[0]  # one tap covering the input: a copy, the bits of 0 + v
        src = dcols6[:, :, t.i, t.j, t.oh0:t.oh0 + t.nh, t.ow0:t.ow0 + t.nw]
        if accumulate:
            np.add(dx, src, out=dx)
        else:
            np.copyto(dx, src)
        return
    if not accumulate:
        dx.fill(0)
    flat = _flat_rows(dx, stride, wo)
    if flat:
        dxf = _as(dx, (c, ch, -1))
    for t in taps:
        if t.nh == 0 or t.nw == 0:
            continue
        src = dcols6[:, :, t.i, t.j]
        if flat:
            _zero_wrapped(src, t)
            q0, q1, x0 = _run(t, wo)
            dst = dxf[..., x0:x0 + q1 - q0]
            np.add(dst, _as(src, (c, ch, ho * wo))[..., q0:q1], out=dst)
            continue
        dst = _src(dx, t, stride)
        np.add(dst, src[:, :, t.oh0:t.oh0 + t.nh, t.ow0:t.ow0 + t.nw], out=dst)


def _as(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Reshape without copying (raises where no view exists)."""
    return np.reshape(a, shape, copy=False)


def _zero_outside(mid: np.ndarray, lo: int, n: int) -> None:
    """Zero the columns of mid (..., Wo) outside [lo, lo + n)."""
    if lo > 0:
        mid[..., :lo].fill(0)
    if lo + n < mid.shape[-1]:
        mid[..., lo + n:].fill(0)


_TAPWISE = 4096  # weights with more (Cout, Cin) pairs than this are reordered one kernel tap at a time


def _kernel_rows(w: np.ndarray, wr: np.ndarray) -> None:
    """wr (kh, Cout, Cin, kw) <- w (Cout, Cin, kh, kw), a copy; tap by tap above `_TAPWISE` (~3x faster
    for large weights; a 64x64x3x3 strided copy took ~60 us)."""
    if w.shape[0] * w.shape[1] < _TAPWISE:
        np.copyto(wr, w.transpose(2, 0, 1, 3))
        return
    for i, j in np.ndindex(*w.shape[2:]):
        np.copyto(wr[i, :, :, j], w[:, :, i, j])


def _kernel_grad_rows(acc: np.ndarray, dw: np.ndarray) -> None:
    """dw (Cout, Cin, kh, kw) <- acc (kh, Cin, kw, Cout), as `_kernel_rows`."""
    if dw.shape[0] * dw.shape[1] < _TAPWISE:
        np.copyto(dw, acc.transpose(3, 1, 0, 2))
        return
    for i, j in np.ndindex(*dw.shape[2:]):
        np.copyto(dw[:, :, i, j], acc[i, :, j, :].T)


class _RowShift:
    """`rows` / `rows_chunked`: im2col builds only the kw column taps on rows padded top and bottom; kernel row
    i reads a window of whole rows (stride 2: rows stored by phase, see `wins`). With Wr[i] (Cout, Cin*kw):

        y[n]        = sum over i in order of Wr[i] @ window_i(rows[n])
        dW[:, :, i] = sum over n in order of dy[n] @ window_i(rows[n]).T

    `rows` holds the batch's buffer, `rows_chunked` one sample's; the same sums. Compiled (`cpu.rows_jit`) or
    numpy lanes that split samples or kernel rows, never a sum."""

    def __init__(self, g: ConvGeometry, algo: str, itemsize: int, forward_only: bool = False):
        self.g, self.algo, self.isz = g, algo, itemsize
        self.c = g.n if algo == "rows" else min(g.n, _CHUNK)
        self.k3 = g.cin * g.kw
        self.hp = g.h + 2 * g.padding[0]
        self.plane = self.hp * g.wo
        cols = self.c * self.k3 * self.plane * itemsize
        wrow = g.kh * g.cout * self.k3 * itemsize
        # forward: rows | weight rows | accumulators; backward dW: rows | (kh, Cout, K3) | a product when N > 1
        self.off_w = align(cols)
        self.off_t = self.off_w + align(wrow)
        self.sub = min(self.c, _SUB)
        self.fwd_tmp = self.sub * g.cout * g.p * itemsize
        self.off_acc = align(cols)
        self.off_prod = self.off_acc + align(wrow)
        self.dw_total = self.off_prod + (g.cout * self.k3 * itemsize if g.n > 1 else 0)
        # backward dx: `_dgrad`, else rows | weight rows | one sample's (K3, P) product
        self.dgrad = None if forward_only else self._dgrad()
        self.off_d = self.off_t
        self.bwd_dx = self.k3 * g.p * itemsize
        self.dx_total = self.dgrad.total("fwd") if self.dgrad is not None else self.off_d + self.bwd_dx
        # Stride s: padded rows stored by phase (q, q+s, ...); kernel row i's window starts at row (i*d)//s of
        # phase (i*d) % s, again a run of whole rows.
        sh, dh = g.stride[0], g.dilation[0]
        self.phase_rows = [len(range(q, self.hp, sh)) for q in range(sh)]
        starts = [sum(self.phase_rows[:q]) for q in range(sh)]
        self.phase_start = starts
        self.wins = [(starts[(i * dh) % sh] + (i * dh) // sh) * g.wo for i in range(g.kh)]  # kernel rows' windows
        self.cols = [(j, *_axis_range(j, g.w, g.wo, g.stride[1], g.padding[1], g.dilation[1])) for j in range(g.kw)]
        # for the compiled path: each stored row's input row (-1: padding), column taps' (lo, n, iw0), windows
        src = [q + k * sh - g.padding[0] for q in range(sh) for k in range(self.phase_rows[q])]
        self.row_src = np.array([r if 0 <= r < g.h else -1 for r in src], np.int64)
        self.col_runs = np.array([c[1:] for c in self.cols], np.int64).reshape(g.kw, 3)
        self.win_offsets = np.array(self.wins, np.int64)

    def _dgrad(self) -> _RowShift | None:
        """dx of a stride-1 convolution as the row-shift forward of dy, kernel flipped, Cin/Cout swapped,
        padding (k - 1) * d - p (no scatter); None where that padding is negative."""
        g = self.g
        pad = ((g.kh - 1) * g.dilation[0] - g.padding[0], (g.kw - 1) * g.dilation[1] - g.padding[1])
        if tuple(g.stride) != (1, 1) or min(pad) < 0:
            return None
        t = ConvGeometry(g.n, g.cout, g.ho, g.wo, g.cin, g.kh, g.kw, g.h, g.w, 1, (1, 1), pad, g.dilation)
        return _RowShift(t, self.algo, self.isz, forward_only=True)

    def total(self, phase: str, accumulate: bool = False) -> int:
        if phase == "fwd":
            return self.off_t + self.fwd_tmp
        if not accumulate:
            return max(self.dw_total, self.dx_total)
        return max(self.dw_total, align(self.dx_total) + self.g.cin * self.g.h * self.g.w * self.isz)

    def accumulate_tile(self, ws: np.ndarray, dt: np.dtype) -> np.ndarray:
        """An accumulating backward's one-sample dx tile (1, Cin, H, W), numpy path only."""
        g = self.g
        return view(ws, align(self.dx_total), (1, g.cin, g.h, g.w), dt)

    def _buffers(self, ws: np.ndarray, w: np.ndarray):
        g, dt = self.g, w.dtype
        buf = view(ws, 0, (self.c, g.cin, g.kw, self.hp, g.wo), dt)
        wr = view(ws, self.off_w, (g.kh, g.cout, g.cin, g.kw), dt)
        _kernel_rows(w, wr)
        return buf, _as(wr, (g.kh, g.cout, self.k3))

    def im2rows(self, x: np.ndarray, b: np.ndarray) -> None:
        """b (c, C, kw, Hp, Wo) <- the column taps of x, zeros in the padding."""
        g = self.g
        ph = g.padding[0]
        if g.stride[0] > 1:
            for block, k0, k1, lo, n, rows, cols in self._phase_rects(b):
                if n == 0 or k1 <= k0:
                    block.fill(0)
                    continue
                block[:, :, :k0].fill(0)
                block[:, :, k1:].fill(0)
                mid = block[:, :, k0:k1]
                np.copyto(mid[..., lo:lo + n], x[:, :, rows, cols])
                _zero_outside(mid, lo, n)
            return
        flat = g.stride[1] == 1 and g.wo == g.w
        for j, lo, n, iw0 in self.cols:
            dst = b[:, :, j]
            if ph:
                dst[:, :, :ph].fill(0)
                dst[:, :, ph + g.h:].fill(0)
            mid = dst[:, :, ph:ph + g.h]
            if n == 0:
                mid.fill(0)
                continue
            if flat:  # one long run per plane; the positions that wrap to the next row are zeroed below
                shift = iw0 - lo
                q0, q1 = lo, (g.h - 1) * g.w + lo + n
                mf, xf = _as(mid, mid.shape[:2] + (-1,)), _as(x, x.shape[:2] + (-1,))
                np.copyto(mf[..., q0:q1], xf[..., q0 + shift:q1 + shift])
            else:
                sw = g.stride[1]
                np.copyto(mid[..., lo:lo + n], x[..., iw0:iw0 + (n - 1) * sw + 1:sw])
            _zero_outside(mid, lo, n)

    def rows2im(self, b: np.ndarray, dx: np.ndarray) -> None:
        """dx = the sum over the column taps in order of b's rows scattered back; b is scratch."""
        g = self.g
        ph = g.padding[0]
        dx.fill(0)
        if g.stride[0] > 1:
            for block, k0, k1, lo, n, rows, cols in self._phase_rects(b):
                if n and k1 > k0:
                    tgt = dx[:, :, rows, cols]
                    np.add(tgt, block[:, :, k0:k1, lo:lo + n], out=tgt)
            return
        flat = g.stride[1] == 1 and g.wo == g.w
        for j, lo, n, iw0 in self.cols:
            if n == 0:
                continue
            mid = b[:, :, j, ph:ph + g.h]
            if flat:
                _zero_outside(mid, lo, n)
                shift = iw0 - lo
                q0, q1 = lo, (g.h - 1) * g.w + lo + n
                mf, xf = _as(mid, mid.shape[:2] + (-1,)), _as(dx, dx.shape[:2] + (-1,))
                dst = xf[..., q0 + shift:q1 + shift]
                np.add(dst, mf[..., q0:q1], out=dst)
            else:
                sw = g.stride[1]
                dst = dx[..., iw0:iw0 + (n - 1) * sw + 1:sw]
                np.add(dst, mid[..., lo:lo + n], out=dst)

    def _phase_rects(self, b: np.ndarray):
        """Per column tap and row phase (stride > 1): (block, k0, k1, lo, n, rows, cols), block's
        rows [k0, k1), columns [lo, lo + n) lying in the image at input `rows`, `cols`."""
        g = self.g
        ph, sh, sw = g.padding[0], g.stride[0], g.stride[1]
        for j, lo, n, iw0 in self.cols:
            for q in range(sh):
                r0, count = self.phase_start[q], self.phase_rows[q]
                k0 = max(0, -((q - ph) // sh))                  # first k with q + k*s - pad >= 0
                k1 = min(count, (ph + g.h - 1 - q) // sh + 1)   # one past the last inside the image
                i0 = q + k0 * sh - ph
                yield (b[:, :, j, r0:r0 + count], k0, k1, lo, n, slice(i0, i0 + (k1 - k0 - 1) * sh + 1, sh),
                       slice(iw0, iw0 + (n - 1) * sw + 1, sw))

    def lanes(self, most: int) -> int:
        """Lanes of the sample loops, at most `most`: `rows` only (its buffer holds every sample)."""
        if self.algo != "rows":
            return 1
        return max(1, min(lanes.count(), most, self.g.n))

    def forward(self, x, w, y, ws, tile: np.ndarray | None = None) -> None:
        """y[n] (+= with `tile`) = sum over kernel rows in order of Wr[i] @ window_i(rows[n])."""
        g = self.g
        buf, wr = self._buffers(ws, w)
        y3 = _as(y, (g.n, g.cout, g.p))
        tmp = view(ws, self.off_t, (self.sub, g.cout, g.p), w.dtype)
        acc = tile is not None
        if _compiled_rows():
            self._compiled_call("forward", (x, wr, y3, buf), self.sub if acc else self.c, (tmp if acc else y3, acc))
            return
        if acc:
            self._forward_samples(x, y3, buf, wr, tmp[:1], 0, g.n, tile)
            return
        n_lanes = self.lanes(self.sub)
        if n_lanes == 1:
            self._forward_samples(x, y3, buf, wr, tmp, 0, g.n)
            return
        lanes.run([lambda a=a, b=b, s0=s0, s1=s1: self._forward_samples(x, y3, buf, wr, tmp[s0:s1], a, b)
                   for (a, b), (s0, s1) in zip(lanes.split(g.n, n_lanes), lanes.split(self.sub, n_lanes))])

    def _compiled_call(self, name: str, arrays: tuple, slots: int, extra: tuple = ()) -> None:
        """`cpu.rows_jit.<name>` on as many workers as slots, samples and size allow."""
        k, g = rows_jit(), self.g
        args = arrays + (self.row_src, self.col_runs, g.stride[1], self.win_offsets, g.p) + extra
        workers = min(slots, g.n, workers_for(g.n * max(g.cin, g.cout) * g.h * g.w))
        if workers > 1:
            with lanes.blas_pinned():
                getattr(k, name + "_parallel")(*args, workers)
        else:
            getattr(k, name)(*args)

    def _block(self, buf: np.ndarray, s: int, e: int) -> np.ndarray:
        """The rows buffer's part for samples [s, e)."""
        return buf[s:e] if self.c == self.g.n else buf[:e - s]

    def _forward_samples(self, x, y3, buf, wr, tmp, a: int, b: int, tiles=None) -> None:
        """Samples [a, b), len(tmp) at a time: one stacked GEMM per kernel row, summed in
        order (into `tiles` and then added, with tiles)."""
        g, wins, sub = self.g, self.wins, len(tmp)
        for s in range(a, b, self.c):
            e = min(b, s + self.c)
            blk = self._block(buf, s, e)
            self.im2rows(x[s:e], blk)
            bf = _as(blk, (e - s, self.k3, self.plane))
            for s2 in range(s, e, sub):
                e2 = min(e, s2 + sub)
                out, t = y3[s2:e2], tmp[:e2 - s2]
                if tiles is not None:
                    out = _as(tiles[:e2 - s2], t.shape)
                for i, o in enumerate(wins):
                    src = bf[s2 - s:e2 - s, :, o:o + g.p]
                    if i == 0:
                        np.matmul(wr[0], src, out=out)
                    else:
                        np.matmul(wr[i], src, out=t)
                        np.add(out, t, out=out)
                if tiles is not None:
                    np.add(y3[s2:e2], out, out=y3[s2:e2])

    def backward(self, x, w, dy, dx, dw, ws, accumulate: bool = False) -> None:
        """dW first (then the rows are spent), then dx in the same workspace."""
        dy3 = _as(dy, (self.g.n, self.g.cout, self.g.p))
        if dw is not None:
            self._weight_grad(x, dy3, dw, ws)
        if dx is not None:
            tile = self.accumulate_tile(ws, dy.dtype) if accumulate else None
            if self.dgrad is not None:
                flat = None if tile is None else _as(tile, (1, self.g.cin, self.g.h * self.g.w))
                self.dgrad.forward(dy, w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3), dx, ws, flat)
            else:
                self._input_grad_scatter(w, dy3, dx, ws, tile)

    def _weight_grad(self, x, dy3, dw, ws) -> None:
        """dW[:, :, i] summed transposed in a (kh, K3, Cout) buffer (OpenBLAS packs it 10-25%
        faster, measured), written into dW at the end; the compiled second half-batch and numpy's extra lanes use
        dW's own memory meanwhile."""
        g, c, dt = self.g, self.c, dy3.dtype
        buf = view(ws, 0, (c, g.cin, g.kw, self.hp, g.wo), dt)
        acc = view(ws, self.off_acc, (g.kh, self.k3, g.cout), dt)
        if _compiled_rows():
            if not (dw.flags.c_contiguous and dw.dtype == dt):
                raise ValueError(f"conv2d backward ({self.algo}): dw must be a C-contiguous {dt} array (its memory "
                                 f"holds the second half-batch's sum), got {dw.dtype} with strides {dw.strides}")
            self._compiled_call("weight_grad", (x, dy3, acc, _as(dw, acc.shape), buf), min(c, 2))  # two halves
            _kernel_grad_rows(_as(acc, (g.kh, g.cin, g.kw, g.cout)), dw)
            return
        prod = view(ws, self.off_prod, (self.k3, g.cout), dt) if g.n > 1 else None
        n_lanes = self.lanes(g.kh) if dw.flags.c_contiguous else 1
        if n_lanes == 1:
            for s in range(0, g.n, c):
                e = min(g.n, s + c)
                self.im2rows(x[s:e], buf[:e - s])
                self._weight_grad_rows(dy3, _as(buf[:e - s], (e - s, self.k3, self.plane)), acc, prod, s, e,
                                       0, g.kh)
        else:
            lanes.run([lambda a=a, b=b: self.im2rows(x[a:b], buf[a:b]) for a, b in lanes.split(g.n, n_lanes)])
            bf = _as(buf, (g.n, self.k3, self.plane))
            spare = _as(dw, (-1,))
            prods = [prod] + [_as(spare[j * prod.size:(j + 1) * prod.size], prod.shape) for j in range(n_lanes - 1)]
            lanes.run([lambda j=j, r0=r0, r1=r1: self._weight_grad_rows(dy3, bf, acc, prods[j], 0, g.n, r0, r1)
                       for j, (r0, r1) in enumerate(lanes.split(g.kh, n_lanes))])
        _kernel_grad_rows(_as(acc, (g.kh, g.cin, g.kw, g.cout)), dw)

    def _weight_grad_rows(self, dy3, bf, acc, prod, s: int, e: int, r0: int, r1: int) -> None:
        """acc[i] (+)= window_i(rows[k]) @ dy[k].T for samples s..e-1 in order, rows r0..r1-1."""
        p = self.g.p
        for k in range(s, e):
            for i in range(r0, r1):
                o = self.wins[i]
                win_t = bf[k - s, :, o:o + p].T
                if k == 0:
                    np.matmul(dy3[k], win_t, out=acc[i].T)
                else:
                    np.matmul(dy3[k], win_t, out=prod.T)
                    np.add(acc[i], prod, out=acc[i])

    def _input_grad_scatter(self, w, dy3, dx, ws, tile=None) -> None:
        """dx where `_dgrad` does not apply: kernel rows' Wr[i].T @ dy[n] summed at their
        windows, then the column taps scattered back (through `tile` when accumulating)."""
        g, c = self.g, self.c
        buf, wr = self._buffers(ws, w)
        if _compiled_rows():
            self._compiled_call("input_grad", (wr, dy3, dx, buf), c, (tile is not None,))
            return
        t = view(ws, self.off_d, (self.k3, g.p), w.dtype)
        for s in range(0, g.n, c):
            e = min(g.n, s + c)
            b = buf[:e - s]
            bf = _as(b, (e - s, self.k3, self.plane))
            for k in range(s, e):
                d = bf[k - s]
                d.fill(0)
                for o_i, wri in zip(self.wins, wr):
                    np.matmul(wri.T, dy3[k], out=t)
                    win = d[:, o_i:o_i + g.p]
                    np.add(win, t, out=win)
            if tile is None:
                self.rows2im(b, dx[s:e])
                continue
            for k in range(s, e):
                self.rows2im(b[k - s:k - s + 1], tile)
                np.add(dx[k], tile[0], out=dx[k])


class _Grouped:
    """`im2col_grouped`: one GEMM over `size` samples' columns side by side, (K, size*P); dW sums the groups
    in order. The size is fixed by the shapes (`_GROUP_COLS`) and no other algorithm shares the menu."""

    def __init__(self, g: ConvGeometry, itemsize: int):
        self.g, self.isz = g, itemsize
        self.taps = _taps(g, g.stride, g.padding, g.dilation)
        self.size = min(g.n, max(1, -(-_GROUP_COLS // g.p)))
        self.groups = -(-g.n // self.size)
        self.cols = g.k * self.size * g.p * itemsize
        self.off_y = align(self.cols)
        self.fwd_total = self.off_y + g.cout * self.size * g.p * itemsize
        self.off_prod = align(self.fwd_total)
        self.bwd_total = self.off_prod + g.cout * g.k * itemsize if self.groups > 1 else self.fwd_total

    def total(self, phase: str, accumulate: bool = False) -> int:
        if phase == "fwd":
            return self.fwd_total
        tile = _accumulate_tile(GROUPED, self.g, self.isz) if accumulate else 0
        return max(self.bwd_total, self.off_prod + tile) if tile else self.bwd_total

    def _groups(self, ws: np.ndarray, dt: np.dtype):
        """(n0, n1, cols (K, m*P), its cols6 view, the (Cout, m*P) block) per group."""
        g, size = self.g, self.size
        cols_all = view(ws, 0, (g.k, size * g.p), dt)
        blk_all = view(ws, self.off_y, (g.cout, size * g.p), dt)
        for n0 in range(0, g.n, size):
            n1 = min(g.n, n0 + size)
            m = n1 - n0
            cols = cols_all[:, :m * g.p]
            cols6 = _as(cols, (g.cin, g.kh, g.kw, m, g.ho, g.wo)).transpose(3, 0, 1, 2, 4, 5)
            yield n0, n1, cols, cols6, blk_all[:, :m * g.p]

    def forward(self, x, w, y, ws) -> None:
        g = self.g
        w2 = _as(w, (g.cout, g.k))
        y3 = _as(y, (g.n, g.cout, g.p))
        for n0, n1, cols, cols6, blk in self._groups(ws, w.dtype):
            _im2col(x[n0:n1], cols6, self.taps, g.stride)
            lanes.matmul(w2, cols, blk)
            np.copyto(y3[n0:n1].transpose(1, 0, 2), _as(blk, (g.cout, n1 - n0, g.p)))

    def backward(self, x, w, dy, dx, dw, ws, accumulate: bool = False) -> None:
        g = self.g
        dy3 = _as(dy, (g.n, g.cout, g.p))
        dw2 = _as(dw, (g.cout, g.k)) if dw is not None else None
        prod = view(ws, self.off_prod, (g.cout, g.k), dy.dtype) if dw is not None and self.groups > 1 else None
        tile = (view(ws, self.off_prod, (g.cin, g.h, g.w), dy.dtype)
                if accumulate and _accumulate_tile(GROUPED, g, self.isz) else None)  # prod is spent by then
        w2t = _as(w, (g.cout, g.k)).T
        for n0, n1, cols, cols6, blk in self._groups(ws, dy.dtype):
            np.copyto(_as(blk, (g.cout, n1 - n0, g.p)), dy3[n0:n1].transpose(1, 0, 2))
            if dw2 is not None:
                _im2col(x[n0:n1], cols6, self.taps, g.stride)
                if n0 == 0:
                    lanes.matmul(blk, cols.T, dw2)
                else:
                    lanes.matmul(blk, cols.T, prod)
                    np.add(dw2, prod, out=dw2)
            if dx is not None:  # the columns are spent: the same memory now receives dcols
                lanes.matmul(w2t, blk, cols)
                _col2im(cols6, dx[n0:n1], self.taps, g.stride, accumulate, tile)


class ConvOps:
    """2-D convolution kernels (mixed into CPUBackend)."""

    def conv2d_forward(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, y: np.ndarray,
                       stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int], groups: int,
                       algo: str, workspace: np.ndarray | None) -> None:
        """y = conv2d(x, w) + b, written into y (N, Cout, Ho, Wo)."""
        stride = tuple(stride)
        g, taps, ws = self._conv_setup(x, w, y, stride, padding, dilation, groups, algo, "fwd", workspace)
        with _blas_scope(g):
            self._conv_forward(g, taps, ws, x, w, b, y, stride, algo)

    def _conv_forward(self, g, taps, ws, x, w, b, y, stride, algo) -> None:
        if algo in OBJECT_ALGOS:
            taps.forward(x, w, y, ws)  # the layer's _RowShift, _Grouped or _Winograd
            if b is not None:
                y += b.reshape(-1, 1, 1)
            return
        n, G, cg_out = g.n, g.groups, g.cout // g.groups
        w3 = _as(w, (G, cg_out, g.k))
        y4 = _as(y, (n, G, cg_out, g.p))
        if algo == "gemm_1x1":
            lanes.matmul(w3, _as(x, (n, G, g.k, g.p)), y4)
        else:
            c = _chunk(algo, n)
            buf = view(ws, 0, (c, g.cin, g.kh, g.kw, g.ho, g.wo), x.dtype)
            for s in range(0, n, c):
                e = min(n, s + c)
                cols6 = buf[:e - s]
                _im2col(x[s:e], cols6, taps, stride)
                lanes.matmul(w3, _as(cols6, (e - s, G, g.k, g.p)), y4[s:e])
        if b is not None:
            y += b.reshape(-1, 1, 1)

    def conv2d_backward(self, x: np.ndarray, w: np.ndarray, dy: np.ndarray, dx: np.ndarray | None,
                        dw: np.ndarray | None, db: np.ndarray | None, stride: tuple[int, int],
                        padding: tuple[int, int], dilation: tuple[int, int], groups: int, algo: str,
                        workspace: np.ndarray | None, accumulate: bool = False) -> None:
        """dx, dw, db given dy (None: not wanted); `accumulate`: dx += the input gradient."""
        stride, accumulate = tuple(stride), accumulate and dx is not None
        g, taps, ws = self._conv_setup(x, w, dy, stride, padding, dilation, groups, algo, "bwd", workspace,
                                       accumulate)
        with _blas_scope(g):
            self._conv_backward(g, taps, ws, x, w, dy, dx, dw, db, stride, algo, accumulate)

    def _conv_backward(self, g, taps, ws, x, w, dy, dx, dw, db, stride, algo, accumulate) -> None:
        if algo in OBJECT_ALGOS:
            if dx is not None or dw is not None:
                taps.backward(x, w, dy, dx, dw, ws, accumulate)  # the layer's _RowShift, _Grouped or _Winograd
            if db is not None:
                np.sum(np.sum(_as(dy, (g.n, g.cout, g.p)), axis=2), axis=0, out=db)
            return
        n, G, cg_out = g.n, g.groups, g.cout // g.groups
        w3 = _as(w, (G, cg_out, g.k))
        w3t = w3.transpose(0, 2, 1)
        dy4 = _as(dy, (n, G, cg_out, g.p))
        dw3 = _as(dw, (G, cg_out, g.k)) if dw is not None else None
        cols_bytes, prod_off, _ = _layout(algo, "bwd", g, x.dtype.itemsize)
        prod = view(ws, prod_off, (G, cg_out, g.k), x.dtype) if dw3 is not None and n > 1 else None
        tile = (view(ws, align(cols_bytes), (g.cin, g.h, g.w), x.dtype)
                if accumulate and _accumulate_tile(algo, g, x.dtype.itemsize) else None)  # prod is spent by then

        def accumulate_dw(sample: int, cols4: np.ndarray) -> None:
            """dW += dy[sample] @ cols.T; sample 0 straight into dW."""
            cols_t = cols4.transpose(0, 2, 1)
            if sample == 0:
                lanes.matmul(dy4[sample], cols_t, dw3)
            else:
                lanes.matmul(dy4[sample], cols_t, prod)
                np.add(dw3, prod, out=dw3)

        compiled_dw = dw3 is not None and _compiled_weight_grad(g, x.dtype)
        if algo == "gemm_1x1":
            x4 = _as(x, (n, G, g.k, g.p))
            if compiled_dw:
                _sum_weight_grad(g, dy4[:, 0], x4[:, 0], dw3[0], accumulate=False)
            elif dw3 is not None:
                for s in range(n):
                    accumulate_dw(s, x4[s])
            if dx is not None and accumulate:  # each sample's product in the tile, then added
                tile4 = _as(tile, (G, g.k, g.p))
                for s in range(n):
                    lanes.matmul(w3t, dy4[s], tile4)
                    np.add(dx[s], tile, out=dx[s])
            elif dx is not None:
                lanes.matmul(w3t, dy4, _as(dx, (n, G, g.k, g.p)))
        elif dw3 is not None or dx is not None:
            c = _chunk(algo, n)
            buf = view(ws, 0, (c, g.cin, g.kh, g.kw, g.ho, g.wo), x.dtype)
            for s in range(0, n, c):
                e = min(n, s + c)
                buf6 = buf[:e - s]
                buf4 = _as(buf6, (e - s, G, g.k, g.p))
                if dw3 is not None:
                    _im2col(x[s:e], buf6, taps, stride)
                    if compiled_dw:
                        _sum_weight_grad(g, dy4[s:e, 0], buf4[:, 0], dw3[0], accumulate=s > 0)
                    else:
                        for k in range(s, e):
                            accumulate_dw(k, buf4[k - s])
                if dx is not None:  # the columns are spent: the same memory now receives dcols
                    lanes.matmul(w3t, dy4[s:e], buf4)
                    _col2im(buf6, dx[s:e], taps, stride, accumulate, tile)
        if db is not None:
            np.sum(np.sum(_as(dy, (n, g.cout, g.p)), axis=2), axis=0, out=db)

    def conv_workspace_options(self, phase: str, x_shape, w_shape, y_shape, stride, padding, dilation,
                               groups: int, dtype=np.float32, accumulate: bool = False):
        """This backend's menu for `phase` (`cpu.menu.CPUMenu`)."""
        return self.menu.conv_workspace_options(phase, x_shape, w_shape, y_shape, stride, padding, dilation, groups,
                                                dtype, accumulate)

    # -- shared checks
    def _conv_setup(self, x, w, y, stride, padding, dilation, groups, algo, phase, workspace, accumulate=False):
        """(geometry, taps or the algorithm object, workspace) after the checks; all but the
        workspace check cached per call (~100 us, more than a batch-1 CIFAR convolution)."""
        key = (x.shape, w.shape, y.shape, x.dtype, tuple(stride), tuple(padding), tuple(dilation), groups, algo,
               phase, accumulate)
        cache = self.__dict__.setdefault("_conv_calls", {})
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = self._conv_check(x, w, y, stride, padding, dilation, groups, algo, phase, accumulate)
        g, taps, need = hit
        if need:
            what = f"conv2d {phase}{' accumulating into dx' if accumulate else ''}: algorithm {algo!r} needs"
            if workspace is None:
                raise ValueError(f"{what} a workspace of {need} bytes, none was given")
            if workspace.dtype != np.uint8 or workspace.ndim != 1 or workspace.nbytes < need:
                raise ValueError(f"{what} a flat uint8 workspace of at least {need} bytes, got {workspace.dtype} "
                                 f"{workspace.shape}")
        return g, taps, workspace

    def _conv_check(self, x, w, y, stride, padding, dilation, groups, algo, phase, accumulate):
        stride, padding, dilation = tuple(stride), tuple(padding), tuple(dilation)
        n, cin, h, wd = x.shape
        cout, cg_in, kh, kw = w.shape
        if cg_in * groups != cin or y.shape[:2] != (n, cout):
            raise ValueError(f"conv2d: shapes do not agree: x {x.shape}, w {w.shape}, groups {groups}, "
                             f"y/dy {y.shape}")
        ho, wo = conv_output_hw((h, wd), (kh, kw), stride, padding, dilation)
        if y.shape[2:] != (ho, wo):
            raise ValueError(f"conv2d: output must be {(n, cout, ho, wo)}, got {y.shape}")
        g = ConvGeometry(n, cin, h, wd, cout, kh, kw, ho, wo, groups, stride, padding, dilation)
        if algo not in ALGOS:
            raise ValueError(f"conv2d: unknown algorithm {algo!r}; expected one of {ALGOS}")
        if algo == "gemm_1x1" and not is_1x1((kh, kw), stride, padding, dilation):
            raise ValueError(f"conv2d: algorithm 'gemm_1x1' needs a 1x1 kernel with stride 1, no padding and "
                             f"no dilation; got kernel {(kh, kw)}, stride {stride}, padding {padding}, "
                             f"dilation {dilation}")
        have = conv_algorithms((kh, kw), stride, padding, dilation, groups, g, self.menu.winograd)
        if algo not in have:
            raise ValueError(f"conv2d: algorithm {algo!r} does not apply to kernel {(kh, kw)}, stride {stride}, "
                             f"groups {groups}, input {x.shape}, output {y.shape}; have {have}")
        need = conv_workspace_bytes(algo, phase, g, x.dtype.itemsize, accumulate)
        if algo in ROW_ALGOS:
            return g, _RowShift(g, algo, x.dtype.itemsize), need
        if algo == GROUPED:
            return g, _Grouped(g, x.dtype.itemsize), need
        if algo in WINOGRAD_ALGOS:
            return g, cpu_winograd._Winograd(g, x.dtype.itemsize, by_position=algo == WINOGRAD_BY_POSITION), need
        return g, _taps(g, stride, padding, dilation), need
