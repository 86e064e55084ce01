"""Convolution kernels of the CPU backend: im2col + GEMM, whole-batch or sample by sample, and direct 1x1 GEMM.

Layout is NCHW; the weight is (Cout, Cin/groups, kh, kw) as in PyTorch. With K = Cin/groups * kh * kw and
P = Ho * Wo, the column matrix of sample n and group g is cols[n, g] (K x P), and every algorithm computes

    y[n, g]     = W[g] @ cols[n, g]                       one GEMM per sample and group
    dW[g]       = sum over n = 0, 1, ... N-1 (in order) of dy[n, g] @ cols[n, g].T
    dcols[n, g] = W[g].T @ dy[n, g], then col2im: dx = sum over the kh*kw taps (in row-major order)

with the same operand shapes and strides whatever the algorithm, so all algorithms give bit-identical results
by construction (`np.matmul` on a stacked array calls one GEMM per matrix, exactly like a loop would). They differ
only in how much of the column matrix exists at once, which is what the memory planner chooses between:

- ``im2col``: the columns of the whole batch (N * Cin*kh*kw * P elements) in the workspace.
- ``im2col_chunked``: the columns of one sample at a time (Cin*kh*kw * P elements).
- ``gemm_1x1``: 1x1 kernel, stride 1, no padding, no dilation: x[n] seen as (Cin, H*W) *is* the column matrix,
  so no columns are built at all.

Two other formulations replace that family where it runs slowly, each chosen by the configuration and shapes
alone and never mixed with another in one layer's menu (so a layer's sums never depend on its workspace):
- ``rows`` / ``rows_chunked`` (`_RowShift`): kernels with several rows at stride 1 or 2 down the rows build
  only the kw column taps and read the kh row taps as shifted views.
- ``im2col_grouped`` (`_Grouped`): small output planes with long column matrices (ResNet-50's 14x14 and 7x7
  3x3 convolutions) run one GEMM over several samples side by side, not one per sample.
- ``winograd`` / ``winograd_by_position`` (`cpu_winograd`): 3x3 kernels at stride 1 with at least 32 channels
  in and out: Winograd's F(2x2, 3x3), 2.25x fewer multiplications; the second variant transforms one of the
  tile's 16 positions at a time, in a sixteenth of the memory, with the same bits.

im2col never materializes a zero-padded copy of the input: for each kernel tap the outputs whose input falls
inside the image form a rectangle (see `_taps`), which is copied with one strided `np.copyto` vectorized over the
chunk's samples and channels; the border strips that fall in the padding are zero-filled. col2im is the mirror
image: one strided in-place add per tap. For stride-1 convolutions whose output rows are as long as the input's
(the usual 'same' 3x3), a tap is a single flat shift of each plane, so it is copied/added as one long contiguous
run per plane instead of one short run per row (see `_flat_rows`).

Threads. OpenBLAS threads the small per-sample GEMMs of CIFAR-sized layers poorly, its threads, once woken,
spin on the cores the other kernels need, and they would cut a large product by their count; so every call runs
with a one-thread BLAS (`_blas_scope`), the row-shift pair runs compiled, its samples (and its weight gradient's
two fixed halves of the batch) split over OpenMP workers (`cpu_rows_jit`; over Python threads on its numpy path,
`cpu_lanes`), and products go out in blocks fixed by their shapes (`cpu_lanes.matmul`), with results that do not
depend on the thread count.

Backward reuses the column buffer: the columns serve dW, then the same memory receives dcols for col2im. The only
other scratch is one weight-sized product buffer, into which the dW contribution of sample n >= 1 is computed
before being added (sample 0 is computed straight into dW).

All scratch lives in the workspace the executor hands in; `conv_workspace_bytes` is the single source of truth
for its size and layout, and the layer declares exactly these sizes to the planner.
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
    """Whether the row-shift pair runs its compiled path (`cpu_rows_jit`): numba loads and numpy's GEMM is bound
    for compiled code. Decided once per process (the import is cached), so every call, algorithm and thread
    count of a layer sums the same way; where it does not hold, the numpy path below runs (other bits, the same
    guarantees)."""
    return rows_jit() is not None and gemm_kernels().available()


IM2COL_ALGOS = ("im2col", "im2col_chunked", "gemm_1x1")
ROW_ALGOS = ("rows", "rows_chunked")
GROUPED = "im2col_grouped"
WINOGRAD = "winograd"
WINOGRAD_BY_POSITION = "winograd_by_position"
WINOGRAD_ALGOS = (WINOGRAD, WINOGRAD_BY_POSITION)
OBJECT_ALGOS = ROW_ALGOS + (GROUPED,) + WINOGRAD_ALGOS  # run by the layer's own object (_RowShift, _Grouped, _Winograd)
ALGOS = IM2COL_ALGOS + OBJECT_ALGOS
_CHUNK = 1  # samples per chunk of `im2col_chunked` / `rows_chunked`
_SUB = 4  # samples per product of the row-shift forward: its scratch holds this many samples' outputs, not N
_GROUP_COLS = 512  # `im2col_grouped`: samples per GEMM so that it has at least this many columns (see `_Grouped`)
_GROUPED_MAX_P = 196  # ... used for output planes of at most this many pixels (14x14) ...
_GROUPED_MIN_K = 1024  # ... and column matrices of at least this many rows (ResNet-50's strided 1x1 on 1024
#                        channels; 3x3s from 114 channels)
_WINOGRAD_OVER_GROUPED_P = 196  # see `_winograd_over_grouped`
_GROUPED_MAX_P_OVER_ROWS = 64  # where the row-shift applies (a stride-2 3x3), the grouped GEMM takes planes up to
#                                this many pixels only (see `uses_grouped`)
_DW_PIECE_MIN_MACS = 1 << 21  # an im2col-family weight gradient is cut in two row blocks where each block's
#                               per-sample product has at least this many multiply-adds (see `_sum_weight_grad`)
_LANE_MAX_MACS = 12_000_000  # layers with at most this many multiply-adds per sample run their sample loops in
# lanes with a one-thread BLAS (`cpu_lanes`); larger per-sample GEMMs OpenBLAS threads well by itself
# Rough relative costs (the planner measures real times later). Every algorithm runs the same per-sample GEMMs,
# so they differ only in im2col traffic: none for gemm_1x1; whole-batch im2col streams the batch's columns
# through memory once, the per-sample variant keeps one sample's columns warm in cache between im2col and GEMM.
# The row-shift pair builds a third of im2col's columns (kw taps, not kh*kw) and reads the rest as views.
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
        """Rows of one group's column matrix: Cin/groups * kh * kw."""
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


def _layout(algo: str, phase: str, g: ConvGeometry, itemsize: int) -> tuple[int, int, int]:
    """(column buffer bytes, dW product buffer offset, total bytes) of the workspace of `algo` in `phase`."""
    cols = 0 if algo == "gemm_1x1" else _chunk(algo, g.n) * g.groups * g.k * g.p * itemsize
    if phase == "fwd":
        return cols, 0, cols
    # backward: the column buffer (then dcols in the same memory) + the weight-sized dW product buffer,
    # needed only when there is more than one sample to accumulate.
    prod = g.cout * g.k * itemsize if g.n > 1 else 0
    off = align(cols) if prod else cols
    return cols, off, off + prod


def uses_rows(kernel, stride, groups: int = 1) -> bool:
    """Whether a configuration runs the row-shift formulation (see `_RowShift`): stride 1 down the rows with more
    than one kernel row, or stride 2 down the rows with a 3-row kernel (the downsampling 3x3 of ResNets); one
    group. Larger kernels at stride 2 (a 7x7 stem on 3 channels) keep im2col: their GEMMs would have K = Cin*kw,
    too short to keep the BLAS busy. Decided by the configuration alone, never by the workspace, so every
    algorithm the planner may pick for a layer sums in the same order (bit-identical results)."""
    sh, kh = int(stride[0]), int(kernel[0])
    return int(groups) == 1 and ((sh == 1 and kh > 1) or (sh == 2 and kh == 3))


def uses_grouped(g: ConvGeometry) -> bool:
    """Whether a convolution may run `im2col_grouped` (see `_Grouped`; `conv_algorithms` gives some 14x14 stride-1
    3x3s to Winograd instead, `_winograd_over_grouped`): small output planes (at most
    `_GROUPED_MAX_P` pixels) with long column matrices (K = Cin*kh*kw at least `_GROUPED_MIN_K`), one group, not
    a plain 1x1 (which needs no columns at all). There a per-sample GEMM has only P columns (49 at 7x7), which
    OpenBLAS runs at ~115 GFLOPS on this machine, against ~155 for the same product over 8 samples side by side
    (measured, (512, 4608) x (4608, 49 or 392)); its weight gradient, a sum over only P, is worse. A strided
    1x1 with a large weight is the extreme case: ResNet-50's (2048, 1024) at stride 2, 14x14 -> 7x7, re-packed its
    8 MB weight for each sample's 49 columns (33 GFLOPS on one thread): forward 20.2 -> 9.6 ms, backward 40.3 ->
    20.9 at two threads as grouped (PyTorch 10.0 / ~26). The smaller strided 1x1s and the plain ones gain
    nothing there (measured), so K starts at 1024. A stride-2 3x3, which the row-shift pair runs otherwise,
    goes grouped only on planes of at most `_GROUPED_MAX_P_OVER_ROWS` pixels: ResNet-50's (256, 28 -> 14) ran
    faster on the rows (two threads, forward + backward: 6.2 against 7.3 ms at batch 1, 34.9 against 46.0 at
    8, 124 against 213 at 32), its (512, 14 -> 7) slower (18.6 against 8.6 at batch 1, 48.9 against 39.2 at 8).
    Decided by the shapes, never by the workspace: it is the layer's only algorithm, so its summation order is
    fixed."""
    if g.stride[0] == 2 and uses_rows((g.kh, g.kw), g.stride, g.groups) and g.p > _GROUPED_MAX_P_OVER_ROWS:
        return False
    return (g.groups == 1 and g.p <= _GROUPED_MAX_P and g.k >= _GROUPED_MIN_K
            and not is_1x1((g.kh, g.kw), g.stride, g.padding, g.dilation))


def small_gemms(g: ConvGeometry) -> bool:
    """Whether a convolution's per-sample GEMMs are small (at most `_LANE_MAX_MACS` multiply-adds a sample).
    It no longer decides anything: since large products split over the lanes (`cpu_lanes.matmul`), every layer
    pins the BLAS and runs its sample loops in lanes alike."""
    return g.cout * g.k * g.p // g.groups <= _LANE_MAX_MACS


def _blas_scope(g: ConvGeometry):
    """The BLAS threads a convolution call runs with: one, always (`cpu_lanes.blas_pinned`; nothing to do inside a
    step, which pinned it already): large products are split over the lanes instead, in blocks fixed by the
    shapes (`cpu_lanes.matmul`), so the thread count never reaches OpenBLAS's own partitioning of a product."""
    return lanes.blas_pinned()


def _winograd_over_grouped(g: ConvGeometry) -> bool:
    """Where both Winograd and `im2col_grouped` apply: Winograd for output planes of at least
    `_WINOGRAD_OVER_GROUPED_P` pixels (14x14) with at most `cpu_winograd.MAX_SPLIT_CHANNELS` channels in and out.
    Measured on the 2-core EPYC VM (forward + dW + dx): (8, 256, 14, 14) -> 256 24.8 ms against the grouped GEMM's
    39.5 at two threads, 43.5 against 65 at one; (8, 128, 14, 14) -> 128 9.4 against 12.8. Wider layers run
    Winograd's forward on one thread and are slower: (2, 512, 14, 14) -> 512 62 against 34. On 7x7 planes its
    4x4 tiles waste a quarter of the outputs: (8, 512, 7, 7) 105 against 38, (8, 256, 7, 7) 18.7 against 16.6.
    Shapes alone decide, so a layer's menu, and its summation order, never depend on the machine."""
    return g.p >= _WINOGRAD_OVER_GROUPED_P and max(g.cin, g.cout) <= cpu_winograd.MAX_SPLIT_CHANNELS


def _compiled_weight_grad(g: ConvGeometry, dtype) -> bool:
    """Whether the im2col family's weight gradient runs compiled (`_sum_weight_grad`): one group, float32 or
    float64, numba loads and numpy's GEMM is bound for compiled code. Decided by the configuration and the
    process, never the algorithm, so gemm_1x1, im2col and im2col_chunked of a layer sum the same way."""
    k = gemm_kernels()
    return g.groups == 1 and dtype in (np.float32, np.float64) and k is not None and k.available()


def weight_grad_pieces(g: ConvGeometry) -> int:
    """The fixed row blocks of a compiled im2col-family weight gradient: two where each block's per-sample
    product has at least `_DW_PIECE_MIN_MACS` multiply-adds, else one. Shapes alone decide (not the threads)."""
    return 2 if g.cout >= 32 and g.cout * g.k * g.p >= 2 * _DW_PIECE_MIN_MACS else 1


def _sum_weight_grad(g: ConvGeometry, dy3: np.ndarray, cols3: np.ndarray, dw2: np.ndarray,
                     accumulate: bool) -> None:
    """dW (+)= sum over the samples of dy3[s] @ cols3[s].T, in sample order, compiled
    (`cpu_gemm_jit.sum_products_nt`): the BLAS adds each sample's product to dW as it sums it (beta 1), so there
    is no product scratch and no pass that adds it (measured on ResNet-50's 1x1s at batch 8, two threads, the
    weight gradient: (2048, 512) at 7x7 9.7 -> 6.4 ms, the stride-2 (2048, 1024) 23.0 -> 17.0). dW's rows are cut
    into `weight_grad_pieces` fixed blocks, one per worker where there are two."""
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
    """The algorithms a configuration can run with: `im2col_grouped` alone or the Winograd pair (with `winograd`)
    where the shapes call for it (only known with `geom`, see `uses_grouped` and `cpu_winograd.applies`), else the
    row-shift pair where it applies (`uses_rows`), else im2col and its per-sample variant, plus gemm_1x1 where the
    input is the column matrix. Where both Winograd and `im2col_grouped` could run, Winograd takes planes of at
    least `_WINOGRAD_OVER_GROUPED_P` output pixels (see there), the grouped GEMM smaller ones."""
    if geom is not None and winograd and cpu_winograd.applies(geom) and (
            not uses_grouped(geom) or _winograd_over_grouped(geom)):
        return list(WINOGRAD_ALGOS)
    if geom is not None and uses_grouped(geom):
        return [GROUPED]
    if uses_rows(kernel, stride, groups):
        return list(ROW_ALGOS)
    ok_1x1 = is_1x1(kernel, stride, padding, dilation)
    return [a for a in IM2COL_ALGOS if a != "gemm_1x1" or ok_1x1]


def conv_options(phase: str, geom: ConvGeometry, itemsize: int, stride, padding, dilation, winograd: bool = True):
    """list[WorkspaceOption] for `phase`, fastest (by EST_COST) first, then smallest workspace first."""

    if phase not in ("fwd", "bwd"):
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
    opts = [WorkspaceOption(a, conv_workspace_bytes(a, phase, geom, itemsize), EST_COST[a])
            for a in conv_algorithms((geom.kh, geom.kw), stride, padding, dilation, geom.groups, geom, winograd)]
    return sorted(opts, key=lambda o: (o.est_cost, o.workspace_bytes))


def conv_workspace_bytes(algo: str, phase: str, geom: ConvGeometry, itemsize: int) -> int:
    """Exact workspace bytes `algo` needs for `phase` ('fwd' or 'bwd')."""
    if algo not in ALGOS:
        raise ValueError(f"unknown convolution algorithm {algo!r}; expected one of {ALGOS}")
    if phase not in ("fwd", "bwd"):
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
    if algo in ROW_ALGOS:
        return _RowShift(geom, algo, itemsize).total(phase)
    if algo == GROUPED:
        return _Grouped(geom, itemsize).total(phase)
    if algo in WINOGRAD_ALGOS:
        return cpu_winograd._Winograd(geom, itemsize, by_position=algo == WINOGRAD_BY_POSITION).total(phase)
    return _layout(algo, phase, geom, itemsize)[2]


# -- kernel taps ------------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class _Tap:
    """Kernel offset (i, j): outputs [oh0, oh0+nh) x [ow0, ow0+nw) read inputs from (ih0, iw0) by the stride;
    every other output of this tap reads padding (zero)."""

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
    lo = max(0, -(off // stride))  # first output whose input o*stride + off is >= 0
    hi = min(size_out, (size_in - 1 - off) // stride + 1)
    n = max(0, hi - lo)
    return lo, n, lo * stride + off


def _taps(g: ConvGeometry, stride, padding, dilation) -> list[_Tap]:
    """All kh*kw taps in row-major order (a tap entirely in the padding has nh == 0 or nw == 0)."""
    rows = [_axis_range(i, g.h, g.ho, stride[0], padding[0], dilation[0]) for i in range(g.kh)]
    cols = [_axis_range(j, g.w, g.wo, stride[1], padding[1], dilation[1]) for j in range(g.kw)]
    return [_Tap(i, j, *rows[i], *cols[j]) for i in range(g.kh) for j in range(g.kw)]


def _src(x: np.ndarray, t: _Tap, stride) -> np.ndarray:
    """The strided (c, C, nh, nw) rectangle of input read by tap t."""
    sh, sw = stride
    return x[:, :, t.ih0:t.ih0 + (t.nh - 1) * sh + 1:sh, t.iw0:t.iw0 + (t.nw - 1) * sw + 1:sw]


def _flat_rows(x: np.ndarray, stride, out_w: int) -> bool:
    """Whether the flat-run path applies: stride 1 and output rows as long as input rows ('same' width).

    Then tap (i, j) maps output pixel q = oh*W + ow to input pixel q + shift with one shift for the whole plane,
    so the tap is one contiguous run per plane (long inner loops instead of one short loop per row). The run also
    covers the few positions whose column falls in the padding (they wrap to the neighbouring row); those are
    zeroed in the column matrix, after the copy in im2col and before the add in col2im.
    """
    return tuple(stride) == (1, 1) and x.shape[3] == out_w


def _run(t: _Tap, width: int) -> tuple[int, int, int]:
    """Flat (first output, end output, first input) of tap t's run on the flat-run path."""
    q0 = t.oh0 * width + t.ow0
    q1 = (t.oh0 + t.nh - 1) * width + t.ow0 + t.nw
    return q0, q1, t.ih0 * width + t.iw0


def _zero_wrapped(dst: np.ndarray, t: _Tap) -> None:
    """Zero the columns of tap t's rows [oh0, oh0+nh) that read padding (dst is (c, C, Ho, Wo))."""
    band = dst[:, :, t.oh0:t.oh0 + t.nh]
    if t.ow0 > 0:
        band[..., :t.ow0].fill(0)
    if t.ow0 + t.nw < dst.shape[3]:
        band[..., t.ow0 + t.nw:].fill(0)


_IM2COL_SPLIT_MIN = 1 << 20  # column elements from which a multi-sample im2col is split over the lanes


def _im2col(x: np.ndarray, cols6: np.ndarray, taps: list[_Tap], stride) -> None:
    """cols6 (c, C, kh, kw, Ho, Wo) <- the kernel taps of x (c, C, H, W), zeros where a tap reads padding.
    Several samples of at least `_IM2COL_SPLIT_MIN` column elements are split over the lanes, a share of the
    samples each (copies: no bits move; ResNet-50's 7x7 stem at batch 8, two threads: 8.6 -> ~5 ms)."""
    _by_samples(_im2col_part, cols6.size, (x, cols6), (taps, stride))


def _by_samples(part, size: int, arrays: tuple, rest: tuple) -> None:
    """part(*arrays, *rest), the samples (the arrays' first axis) split over the lanes, a contiguous share each,
    where there are several lanes and samples and the columns have at least `_IM2COL_SPLIT_MIN` elements."""
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


def _col2im(dcols6: np.ndarray, dx: np.ndarray, taps: list[_Tap], stride) -> None:
    """dx (c, C, H, W) = the sum, tap by tap in row-major order, of dcols6 (c, C, kh, kw, Ho, Wo) scattered back.

    dcols6 is scratch: on the flat-run path its padding-reading positions are zeroed in place. Split over the
    lanes as `_im2col` is: a sample's dx sums only its own columns, in the same tap order, so no bits move."""
    _by_samples(_col2im_part, dcols6.size, (dcols6, dx), (taps, stride))


def _col2im_part(dcols6: np.ndarray, dx: np.ndarray, taps: list[_Tap], stride) -> None:
    c, ch, _, _, ho, wo = dcols6.shape
    if len(taps) == 1 and taps[0].nh == dx.shape[2] and taps[0].nw == dx.shape[3] and tuple(stride) == (1, 1):
        t = taps[0]  # one tap covering the whole input (1x1 kernel): a copy, exactly as 0 + v would give
        np.copyto(dx, dcols6[:, :, t.i, t.j, t.oh0:t.oh0 + t.nh, t.ow0:t.ow0 + t.nw])
        return
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
    """Reshape without copying (raises if `a` is laid out so that a view is impossible)."""
    return np.reshape(a, shape, copy=False)


def _zero_outside(mid: np.ndarray, lo: int, n: int) -> None:
    """Zero the columns of mid (..., Wo) outside [lo, lo + n): where a column tap reads padding."""
    if lo > 0:
        mid[..., :lo].fill(0)
    if lo + n < mid.shape[-1]:
        mid[..., lo + n:].fill(0)


_TAPWISE = 4096  # weights with more (Cout, Cin) pairs than this are reordered one kernel tap at a time


def _kernel_rows(w: np.ndarray, wr: np.ndarray) -> None:
    """wr (kh, Cout, Cin, kw) <- w (Cout, Cin, kh, kw) (any strides: the input gradient passes a flipped view).

    One strided copy moves runs of kw (3) elements, which numpy does slowly: for a 64x64x3x3 weight it took
    ~60 us, half a batch-1 convolution. Copying tap by tap (kh*kw copies of a (Cout, Cin) plane) is ~3x faster
    for large weights and slower for small ones (more calls), hence the threshold. Either way a pure copy."""
    if w.shape[0] * w.shape[1] < _TAPWISE:
        np.copyto(wr, w.transpose(2, 0, 1, 3))
        return
    for i, j in np.ndindex(*w.shape[2:]):
        np.copyto(wr[i, :, :, j], w[:, :, i, j])


def _kernel_grad_rows(acc: np.ndarray, dw: np.ndarray) -> None:
    """dw (Cout, Cin, kh, kw) <- acc (kh, Cin, kw, Cout), tap by tap when large (see `_kernel_rows`)."""
    if dw.shape[0] * dw.shape[1] < _TAPWISE:
        np.copyto(dw, acc.transpose(3, 1, 0, 2))
        return
    for i, j in np.ndindex(*dw.shape[2:]):
        np.copyto(dw[:, :, i, j], acc[i, :, j, :].T)


class _RowShift:
    """The row-shift formulation of a convolution with stride 1 (or 2, see `uses_rows`) down the rows: im2col
    builds only the kw column taps, on the input's rows padded top and bottom, and the kh row taps are views of
    that buffer shifted by whole rows (with stride 2 the rows are stored even ones first, then odd ones, so that
    every kernel row's window is still a run of whole rows: see `wins`). With K3 = Cin * kw and the padded plane
    Hp x Wo (Hp = H + 2 * pad_h), for sample n and stride 1:

        rows[n]      (K3, Hp*Wo)   tap j of channel c: x[n, c] shifted by column tap j, zero rows/columns outside
        y[n]       = sum over i = 0, 1, ... kh-1 (in order) of Wr[i] @ rows[n][:, i*dh*Wo : i*dh*Wo + Ho*Wo]
        dW[:, :, i] = sum over n (in order) of dy[n] @ rows[n][:, i-th window].T
        drows[n]   = Wr[i].T @ dy[n] placed at the i-th window, summed over i in order; then the kw column taps
                     are scattered back (col2im over kw taps only)

    where Wr[i] (Cout, K3) is the weight's kernel row i. Each window is a plain strided matrix (row stride
    Hp*Wo, unit column stride), which BLAS reads in place: a third of im2col's copies for a 3x3 kernel, GEMMs
    with K = Cin*kw instead of Cin*kh*kw. `rows` holds the whole batch's buffer, `rows_chunked` one sample's;
    both run the same per-sample GEMMs and sums in the same order, so they agree bit for bit (and a layer's
    menu holds only these two, see `uses_rows`).

    Compiled (`cpu_rows_jit`, where numba and numpy's 64-bit OpenBLAS load: the default). Per sample, its rows
    in its own slot of the buffer, then its kh GEMMs accumulating in the BLAS; the samples split over OpenMP
    workers (`rows` only: `rows_chunked` has one slot). The weight gradient sums two fixed halves of the batch
    apart and then adds them, so one or two workers give the same bits; both algorithms run this formulation.

    Numpy path (lanes, `cpu_lanes`). With more than one sample, `rows` splits its loops over threads: the
    forward's samples (each lane with its own slots of the accumulator; the input gradient is such a forward
    too), and the weight gradient's kernel rows (each row's sum over the samples stays one sequence). No sum is
    split, so the bits are those of one thread, and `rows_chunked` (one sample's buffer, one thread) still agrees
    with `rows` bit for bit. (Other bits than the compiled path's: the formulations differ.)
    """

    def __init__(self, g: ConvGeometry, algo: str, itemsize: int, forward_only: bool = False):
        self.g, self.algo, self.isz = g, algo, itemsize
        self.c = g.n if algo == "rows" else min(g.n, _CHUNK)
        self.k3 = g.cin * g.kw
        self.hp = g.h + 2 * g.padding[0]
        self.plane = self.hp * g.wo
        cols = self.c * self.k3 * self.plane * itemsize
        wrow = g.kh * g.cout * self.k3 * itemsize
        # forward: rows | weight rows | an output-sized accumulator per sample of the chunk
        self.off_w = align(cols)
        self.off_t = self.off_w + align(wrow)
        self.sub = min(self.c, _SUB)
        self.fwd_tmp = self.sub * g.cout * g.p * itemsize
        # backward, weight gradient: rows | dW accumulator (kh, Cout, K3) | one (Cout, K3) product when N > 1
        self.off_acc = align(cols)
        self.off_prod = self.off_acc + align(wrow)
        self.dw_total = self.off_prod + (g.cout * self.k3 * itemsize if g.n > 1 else 0)
        # backward, input gradient: see `_dgrad`; without it, rows | weight rows | one sample's (K3, P) product
        self.dgrad = None if forward_only else self._dgrad()
        self.off_d = self.off_t
        self.bwd_dx = self.k3 * g.p * itemsize
        self.dx_total = self.dgrad.total("fwd") if self.dgrad is not None else self.off_d + self.bwd_dx
        # With stride s down the rows, the padded rows are stored phase by phase (rows r = q, q+s, q+2s, ... for
        # q = 0 .. s-1): output row oh of kernel row i reads padded row oh*s + i*d, which is row oh + (i*d)//s of
        # phase (i*d) % s, so each kernel row's window is again a run of whole rows (for s = 1 it is just
        # shifted by i*d rows).
        sh, dh = g.stride[0], g.dilation[0]
        self.phase_rows = [len(range(q, self.hp, sh)) for q in range(sh)]
        starts = [sum(self.phase_rows[:q]) for q in range(sh)]
        self.phase_start = starts
        self.wins = [(starts[(i * dh) % sh] + (i * dh) // sh) * g.wo for i in range(g.kh)]  # kernel rows' windows
        self.cols = [(j, *_axis_range(j, g.w, g.wo, g.stride[1], g.padding[1], g.dilation[1])) for j in range(g.kw)]
        # the same geometry as arrays, for the compiled path: the input row each stored row holds (-1: padding),
        # each column tap's (lo, n, iw0), the kernel rows' window offsets
        src = [q + k * sh - g.padding[0] for q in range(sh) for k in range(self.phase_rows[q])]
        self.row_src = np.array([r if 0 <= r < g.h else -1 for r in src], np.int64)
        self.col_runs = np.array([c[1:] for c in self.cols], np.int64).reshape(g.kw, 3)
        self.win_offsets = np.array(self.wins, np.int64)

    def _dgrad(self) -> _RowShift | None:
        """The input gradient of a stride-1 convolution is itself a stride-1 convolution: of dy with the kernel
        flipped in both axes and Cin/Cout swapped, padded by (k - 1) * d - p. Run as the row-shift *forward* of
        that convolution it sums kh products of (Cin, P) per sample into dx directly, instead of kh products of
        (Cin*kw, P) into a rows-shaped buffer that must then be scattered back (three times the additions and
        a col2im pass). Not when a column stride is > 1 or the padding exceeds the kernel's reach (the flipped
        convolution would need negative padding): those keep the scatter path."""
        g = self.g
        pad = ((g.kh - 1) * g.dilation[0] - g.padding[0], (g.kw - 1) * g.dilation[1] - g.padding[1])
        if tuple(g.stride) != (1, 1) or min(pad) < 0:
            return None
        t = ConvGeometry(g.n, g.cout, g.ho, g.wo, g.cin, g.kh, g.kw, g.h, g.w, 1, (1, 1), pad, g.dilation)
        return _RowShift(t, self.algo, self.isz, forward_only=True)

    def total(self, phase: str) -> int:
        return self.off_t + self.fwd_tmp if phase == "fwd" else max(self.dw_total, self.dx_total)

    def _buffers(self, ws: np.ndarray, w: np.ndarray):
        g, dt = self.g, w.dtype
        buf = view(ws, 0, (self.c, g.cin, g.kw, self.hp, g.wo), dt)
        wr = view(ws, self.off_w, (g.kh, g.cout, g.cin, g.kw), dt)
        _kernel_rows(w, wr)
        return buf, _as(wr, (g.kh, g.cout, self.k3))

    def im2rows(self, x: np.ndarray, b: np.ndarray) -> None:
        """b (c, C, kw, Hp, Wo) <- the column taps of x (c, C, H, W), zeros where a tap reads padding."""
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
        """dx (c, C, H, W) = the sum over the column taps (in order) of b's rows scattered back; b is scratch."""
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
        """The rectangles of a stride s > 1 down the rows, per column tap j and phase q (phase q holds the padded
        rows q, q+s, ...): (block, k0, k1, lo, n, rows, cols), where block is b's rows of phase q for tap j, its rows
        [k0, k1) and columns [lo, lo + n) lie inside the image, at input rows `rows` and columns `cols` (strided
        slices); everything else of the block reads padding. im2rows copies along them, rows2im adds back."""
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
        """How many lanes (threads) this layer's sample loops use, at most `most`: only `rows` (its buffer holds
        every sample, so lanes build and read disjoint parts of it), large GEMMs too (OpenBLAS's own threads
        would spin on the cores the other kernels need)."""
        if self.algo != "rows":
            return 1
        return max(1, min(lanes.count(), most, self.g.n))

    def forward(self, x, w, y, ws) -> None:
        """y[n] = sum over kernel rows (in order) of Wr[i] @ window_i(rows[n]); the samples split over lanes,
        each with its own slots of the accumulator (the bits of y[n] do not depend on the split)."""
        g = self.g
        buf, wr = self._buffers(ws, w)
        y3 = _as(y, (g.n, g.cout, g.p))
        if _compiled_rows():
            self._compiled_call("forward", (x, wr, y3, buf), self.c)
            return
        tmp = view(ws, self.off_t, (self.sub, g.cout, g.p), w.dtype)
        n_lanes = self.lanes(self.sub)
        if n_lanes == 1:  # no task list to build on the dispatch-bound path (batch 1, one thread)
            self._forward_samples(x, y3, buf, wr, tmp, 0, g.n)
            return
        lanes.run([lambda a=a, b=b, s0=s0, s1=s1: self._forward_samples(x, y3, buf, wr, tmp[s0:s1], a, b)
                   for (a, b), (s0, s1) in zip(lanes.split(g.n, n_lanes), lanes.split(self.sub, n_lanes))])

    def _compiled_call(self, name: str, arrays: tuple, slots: int) -> None:
        """Run `cpu_rows_jit.<name>` (forward, input_grad: samples split over workers; weight_grad: its two
        halves; each worker with its own slot of the rows buffer) on as many threads as the compiled kernels may
        use, the buffer has slots (`slots`) and the layer is large enough for (`cpu_jit.workers_for`)."""
        k, g = rows_jit(), self.g
        args = arrays + (self.row_src, self.col_runs, g.stride[1], self.win_offsets, g.p)
        workers = min(slots, g.n, workers_for(g.n * max(g.cin, g.cout) * g.h * g.w))
        if workers > 1:
            with lanes.blas_pinned():
                getattr(k, name + "_parallel")(*args, workers)
        else:
            getattr(k, name)(*args)

    def _block(self, buf: np.ndarray, s: int, e: int) -> np.ndarray:
        """The part of the rows buffer that receives samples [s, e): their own place in `rows` (which holds the
        batch), the start of the buffer in `rows_chunked` (which holds one chunk)."""
        return buf[s:e] if self.c == self.g.n else buf[:e - s]

    def _forward_samples(self, x, y3, buf, wr, tmp, a: int, b: int) -> None:
        """Samples [a, b), len(tmp) at a time: their column taps, then one stacked GEMM per kernel row (one GEMM
        per sample inside np.matmul) summed in order."""
        g, wins, sub = self.g, self.wins, len(tmp)
        for s in range(a, b, self.c):  # the whole range at once in `rows` (fewer, longer copies)
            e = min(b, s + self.c)
            blk = self._block(buf, s, e)
            self.im2rows(x[s:e], blk)
            bf = _as(blk, (e - s, self.k3, self.plane))
            for s2 in range(s, e, sub):
                e2 = min(e, s2 + sub)
                out, t = y3[s2:e2], tmp[:e2 - s2]
                for i, o in enumerate(wins):
                    src = bf[s2 - s:e2 - s, :, o:o + g.p]
                    if i == 0:
                        np.matmul(wr[0], src, out=out)
                    else:
                        np.matmul(wr[i], src, out=t)
                        np.add(out, t, out=out)

    def backward(self, x, w, dy, dx, dw, ws) -> None:
        """dW first (the rows of x, then nothing of it is needed again), then dx in the same workspace."""
        dy3 = _as(dy, (self.g.n, self.g.cout, self.g.p))
        if dw is not None:
            self._weight_grad(x, dy3, dw, ws)
        if dx is not None:
            if self.dgrad is not None:
                self.dgrad.forward(dy, w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3), dx, ws)
            else:
                self._input_grad_scatter(w, dy3, dx, ws)

    def _weight_grad(self, x, dy3, dw, ws) -> None:
        """dW[:, :, i] = sum over samples n (in order) of dy[n] @ window_i(rows[n]).T, accumulated transposed in
        a contiguous (kh, K3, Cout) buffer and written into dW's strided kernel rows once at the end.

        Compiled (`cpu_rows_jit.weight_grad`): the sum runs in two fixed halves of the batch, the second in dW's
        own memory (written only at the end, hence a C-contiguous dW), then added. On the numpy path, in lanes
        (see `lanes`), the batch's rows are built by sample ranges, then the kernel rows are split over
        the lanes: each kernel row's sum is the same sequence of GEMMs and additions whichever lane runs it, so
        the bits are those of one thread. Each lane needs its own (K3, Cout) product buffer: the first uses the
        workspace's, the others borrow dW's own memory (kh of them fit), which is not written until the end.

        Why transposed: numpy hands BLAS the product into a transposed output as the transposed problem
        (window_i @ dy[n].T), whose operands OpenBLAS packs faster here: 10-25% off these GEMMs, measured."""
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
        """acc[i] (+)= window_i(rows[k]) @ dy[k].T for samples k = s .. e-1 (rows[k] is bf[k - s]) in order and
        kernel rows i = r0 .. r1-1; sample 0 is written, later ones added through `prod`."""
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

    def _input_grad_scatter(self, w, dy3, dx, ws) -> None:
        """dx when `_dgrad` does not apply: drows[n] = the sum over kernel rows of Wr[i].T @ dy[n] placed at the
        i-th window, then the kw column taps scattered back (rows2im)."""
        g, c = self.g, self.c
        buf, wr = self._buffers(ws, w)
        if _compiled_rows():
            self._compiled_call("input_grad", (wr, dy3, dx, buf), c)
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
            self.rows2im(b, dx[s:e])


class _Grouped:
    """`im2col_grouped`: im2col + GEMM over a group of `size` samples at once, their columns side by side.

    With K = Cin*kh*kw, P = Ho*Wo and the group's samples n0 .. n0+g-1, the column buffer is (K, g*P), sample
    j's columns at [j*P, (j+1)*P), and

        Y (Cout, g*P)  = W (Cout, K) @ cols                 then copied into y[n0:n0+g] (N, Cout, P)
        dW             = sum over the groups (in order) of dY (Cout, g*P) @ cols.T   (dY: dy's group, copied)
        dcols (K, g*P) = W.T @ dY, then col2im sample by sample (in the column buffer's memory)

    The group size is fixed by the shapes (`_GROUP_COLS` columns per GEMM, see `uses_grouped`) and the layer has
    no other algorithm, so the sums are the same on every run, whatever the budget. The workspace holds one
    group's columns and one output-sized (Cout, g*P) block; backward adds a weight-sized product buffer when
    there is more than one group to accumulate."""

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

    def total(self, phase: str) -> int:
        return self.fwd_total if phase == "fwd" else self.bwd_total

    def _groups(self, ws: np.ndarray, dt: np.dtype):
        """(n0, n1, cols (K, m*P), cols6 (m, Cin, kh, kw, Ho, Wo) view of it, Cout x m*P block) per group."""
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

    def backward(self, x, w, dy, dx, dw, ws) -> None:
        g = self.g
        dy3 = _as(dy, (g.n, g.cout, g.p))
        dw2 = _as(dw, (g.cout, g.k)) if dw is not None else None
        prod = view(ws, self.off_prod, (g.cout, g.k), dy.dtype) if dw is not None and self.groups > 1 else None
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
                _col2im(cols6, dx[n0:n1], self.taps, g.stride)


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
                        workspace: np.ndarray | None) -> None:
        """dx, dw, db of y = conv2d(x, w) + b given dy; any of them may be None (not wanted)."""
        stride = tuple(stride)
        g, taps, ws = self._conv_setup(x, w, dy, stride, padding, dilation, groups, algo, "bwd", workspace)
        with _blas_scope(g):
            self._conv_backward(g, taps, ws, x, w, dy, dx, dw, db, stride, algo)

    def _conv_backward(self, g, taps, ws, x, w, dy, dx, dw, db, stride, algo) -> None:
        if algo in OBJECT_ALGOS:
            if dx is not None or dw is not None:
                taps.backward(x, w, dy, dx, dw, ws)  # the layer's _RowShift, _Grouped or _Winograd
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

        def accumulate_dw(sample: int, cols4: np.ndarray) -> None:
            """dW += dy[sample] @ cols.T, one GEMM per group; sample 0 goes straight into dW."""
            cols_t = cols4.transpose(0, 2, 1)  # (G, P, K): a transposed view, BLAS reads it as such
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
            if dx is not None:
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
                    _col2im(buf6, dx[s:e], taps, stride)
        if db is not None:
            # per-plane sums (pairwise over the contiguous H*W), then over the batch: an (N, Cout) scratch only
            np.sum(np.sum(_as(dy, (n, g.cout, g.p)), axis=2), axis=0, out=db)

    def conv_workspace_options(self, phase: str, x_shape, w_shape, y_shape, stride, padding, dilation,
                               groups: int, dtype=np.float32):
        """This backend's menu's algorithms for `phase` (`cpu_menu.CPUMenu`; same signature as the CUDA
        backend's)."""
        return self.menu.conv_workspace_options(phase, x_shape, w_shape, y_shape, stride, padding, dilation, groups,
                                                dtype)

    # -- shared checks ----------------------------------------------------------------------------------------------
    def _conv_setup(self, x, w, y, stride, padding, dilation, groups, algo, phase, workspace):
        """(geometry, taps, workspace) after checking the call; for the algorithms of `OBJECT_ALGOS`, taps is the
        layer's object that runs them (`_RowShift`, `_Grouped`, `cpu_winograd._Winograd`). Everything but the
        workspace check is a pure function of the shapes and the configuration, so it is worked out once per
        distinct call and remembered (it cost ~100 us per call, more than the kernels of a batch-1 CIFAR
        convolution take)."""
        key = (x.shape, w.shape, y.shape, x.dtype, tuple(stride), tuple(padding), tuple(dilation), groups, algo,
               phase)
        cache = self.__dict__.setdefault("_conv_calls", {})
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = self._conv_check(x, w, y, stride, padding, dilation, groups, algo, phase)
        g, taps, need = hit
        if need:
            if workspace is None:
                raise ValueError(f"conv2d {phase}: algorithm {algo!r} needs a workspace of {need} bytes, "
                                 f"none was given")
            if workspace.dtype != np.uint8 or workspace.ndim != 1 or workspace.nbytes < need:
                raise ValueError(f"conv2d {phase}: algorithm {algo!r} needs a flat uint8 workspace of at least "
                                 f"{need} bytes, got {workspace.dtype} {workspace.shape}")
        return g, taps, workspace

    def _conv_check(self, x, w, y, stride, padding, dilation, groups, algo, phase):
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
        need = conv_workspace_bytes(algo, phase, g, x.dtype.itemsize)
        if algo in ROW_ALGOS:
            return g, _RowShift(g, algo, x.dtype.itemsize), need
        if algo == GROUPED:
            return g, _Grouped(g, x.dtype.itemsize), need
        if algo in WINOGRAD_ALGOS:
            return g, cpu_winograd._Winograd(g, x.dtype.itemsize, by_position=algo == WINOGRAD_BY_POSITION), need
        return g, _taps(g, stride, padding, dilation), need
