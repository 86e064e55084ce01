"""Winograd's F(2x2, 3x3) convolution on the CPU: the `winograd` algorithm of `cpu_conv`.

Why. A 3x3 convolution computes each 2x2 block of outputs from a 4x4 block of inputs. Winograd's minimal
filtering algorithm (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks", 2016) does it with 16
multiplications instead of 36: with the 4x4 input tile d, the 3x3 kernel g and fixed matrices B, G, A,

    y = A^T [ (G g G^T) * (B^T d B) ] A          (* element by element)

and summed over input channels, the 16 products of a tile position become 16 ordinary GEMMs over all tiles
of a group of samples: M[pos] (T, Cout) = V[pos] (T, Cin) @ U[pos] (Cin, Cout). 2.25x fewer multiplications
than im2col or the row-shift formulation, in GEMMs whose shapes (T = tiles of several samples) keep OpenBLAS
busy even on 8x8 planes. The transforms (B^T d B, A^T m A, G g G^T) are additions only; they are compiled
(`cpu_winograd_jit`) and vectorized over 16 channels at a time.

Backward. dx is itself a stride-1 3x3 convolution, of dy with the kernel flipped and Cin/Cout swapped, padded
by 2 - p: it runs as this algorithm's forward (`_dgrad`). dW goes through the transform's gradient: with
dM = A dY A^T per output tile and V the input tiles, dU[pos] = V[pos]^T @ dM[pos] summed over the tiles, then
dW = G^T dU G (`weight_grad_tiles`).

Numerics and bit-identity. Results differ from a direct convolution by rounding (measured ~3e-7 relative on
float32 against PyTorch in float64, as accurate as im2col here); the tests compare with PyTorch and finite
differences. A layer that runs Winograd has the two variants of `_Winograd` on its menu, which sum in one
order: the samples per group are fixed by the shapes, dU sums the groups in order, each output sums its nine
terms in position order, so every run, whatever the budget picks, gives the same bits. Where numba cannot be
imported the algorithm is not offered (`available`), so those layers run the row-shift formulation.

On by default: the CPU menu's `winograd` field (`cpu_menu.CPUMenu`; the CLI's `--no-cpu-winograd` switches it off).
Applies (`applies`) to 3x3 kernels at stride 1, dilation 1, one group, padding 0..2, with at least 32 input
and output channels: measured on 16-channel layers the channels-last transposition of the transforms costs
more than the multiplications saved (32 x 16 x 32 x 32 forward: 2.6 ms against the row-shift's 2.1 ms).
"""
from __future__ import annotations

import importlib.util
from contextlib import nullcontext

import numpy as np

from . import lanes
from .jit import PARALLEL_MIN, lazy, workers_for
from .workspace import align, view

jit = lazy("winograd_jit")
gemm_jit = lazy("gemm_jit")

BLOCK = 16  # channels per transform block (the jit module's L)
_GROUP_ELEMS = 16384  # samples per group: V and M of a group hold about 16 * this many values (1 MiB in float32)
MIN_CHANNELS = 32


def available() -> bool:
    """Whether numba can be found (without importing it: planning should not pay numba's import)."""
    return importlib.util.find_spec("numba") is not None


def applies(g) -> bool:
    """Whether the convolution of geometry `g` (a `cpu_conv.ConvGeometry`) can run Winograd F(2x2, 3x3). Only
    for such shapes is the kernel module imported (numba present but broken: not offered)."""
    return (g.groups == 1 and (g.kh, g.kw) == (3, 3) and tuple(g.stride) == (1, 1)
            and tuple(g.dilation) == (1, 1) and all(0 <= p <= 2 for p in g.padding)
            and min(g.cin, g.cout) >= MIN_CHANNELS and available() and jit() is not None)


MAX_SPLIT_CHANNELS = 256  # beyond, a layer's forward runs on one thread (see `workers`)


def workers(values: int = PARALLEL_MIN, channels: int = MIN_CHANNELS) -> int:
    """How many threads a whole-tile Winograd call over `values` input values, with `channels` (rounded) input
    channels, runs on: the compiled kernels' (`cpu_jit.workers_for`: one for small layers, CIFAR at batch 1)
    where numpy's GEMM is bound for them, else 1. The forward's workers take fixed pieces of each group
    (`cpu_winograd_jit.forward_pieces`, decided by the shapes), so the bits never depend on this. Layers wider
    than `MAX_SPLIT_CHANNELS` stay on one thread: Winograd runs them only on planes of at least 14x14 with such
    channels where `im2col_grouped` does not apply, which no measured network has."""
    if not _compiled_gemm() or channels > MAX_SPLIT_CHANNELS:
        return 1
    return workers_for(values)


def _compiled_gemm() -> bool:
    """Whether the whole-tile variant runs its compiled path (`cpu_winograd_jit.forward` and the rest): numpy's
    GEMM is bound for compiled code (`cpu_gemm_jit`). Decided once per process, so every call, variant and
    thread count multiplies the same way."""
    g = gemm_jit()
    return g is not None and g.available()


def _gemm(a, b, c, trans_a: bool) -> None:
    """c = a @ b (a.T @ b with `trans_a`), 2-D, the by-position variant's products: the call the whole-tile
    variant's GEMMs make (numpy's `matmul` makes it too; tested)."""
    if _compiled_gemm():
        gemm_jit().gemm(a, b, c, trans_a)
    else:
        np.matmul(a.T if trans_a else a, b, out=c)


def _round(c: int) -> int:
    return -(-c // BLOCK) * BLOCK


class _Winograd:
    """One layer's Winograd convolution: workspace layout and the forward and backward passes, in one of two
    variants that compute the same values in the same order (so the planner may pick either, bit-identically):

    - `winograd` (whole tile): all 16 positions of a group's tiles at once. Workspace, forward: U (16, CiB, CoB)
      | V (16, Tg, CiB) | M (16, Tg, CoB) | the weight transposed (3, 3, Ci, Co) | the transforms' scratch
      (channels-last input and output blocks, one tile's results). Backward: first dW (V | dM | the dU
      accumulator | one dU product when there is more than one group | dW transposed | scratch), then dx (the
      flipped convolution's forward) in the same memory: the larger of the two.
    - `winograd_by_position`: one position at a time, a sixteenth of V and M (and of U in the forward): position
      (k, l)'s U, then for every group its V, the GEMM, and its share of the outputs added into y. Forward:
      U1 (CiB, CoB) | V1 (Tg, CiB) | M1 (Tg, CoB) | the weight transposed | input scratch. Backward: dW (V1 |
      dM1 | the dU accumulator (16, CiB, CoB) | one (CiB, CoB) product with more than one group | dW transposed
      | input and gradient scratch), then dx in the same memory. Slower (each position re-reads the input and
      re-walks the outputs), for budgets the whole-tile workspace does not fit.

    Why the two agree bit for bit: every GEMM has the same operands (position p's (Tg, CiB) by (CiB, CoB), the same
    groups of samples, in the forward the same fixed pieces of a group's rows: `_pieces`), every transformed value
    is the same expression of the same inputs (`cpu_winograd_jit`), each output sums its nine terms in position
    order in both, and dU sums the groups in order per position in both. CiB, CoB are the channels rounded up to 16,
    Tg the tiles of one group."""

    def __init__(self, g, itemsize: int, forward_only: bool = False, by_position: bool = False):
        self.g, self.isz, self.by_position = g, itemsize, by_position
        self.th, self.tw = -(-g.ho // 2), -(-g.wo // 2)
        self.cib, self.cob = _round(g.cin), _round(g.cout)
        per_sample = self.th * self.tw
        self.size = max(1, min(g.n, _GROUP_ELEMS // ((self.cib + self.cob) * per_sample)))
        self.groups = -(-g.n // self.size)
        tg = self.size * per_sample
        xs = (2 * self.th + 2) * (2 * self.tw + 2) * BLOCK
        ys = (2 * self.th) * (2 * self.tw) * BLOCK
        wt = ("wt", (3, 3, g.cin, g.cout))
        if by_position:
            fwd = [("u", (self.cib, self.cob)), ("v", (tg, self.cib)), ("m", (tg, self.cob)), wt, ("xs", (xs,))]
            dw = [("v", (tg, self.cib)), ("m", (tg, self.cob)), ("acc", (16, self.cib, self.cob)),
                  ("prod", (self.cib, self.cob) if self.groups > 1 else (0,)), wt, ("xs", (xs,)), ("ys", (ys,))]
        else:
            fwd = [("u", (16, self.cib, self.cob)), ("v", (16, tg, self.cib)), ("m", (16, tg, self.cob)), wt,
                   ("xs", (xs,)), ("ys", (ys,)), ("buf", (256,))]
            dw = [("v", (16, tg, self.cib)), ("m", (16, tg, self.cob)), ("acc", (16, self.cib, self.cob)),
                  ("prod", (16, self.cib, self.cob) if self.groups > 1 else (0,)), wt,
                  ("xs", (xs,)), ("ys", (ys,)), ("buf", (256,))]
        self.fwd_layout, self.fwd_total = self._place(fwd)
        self.dw_layout, self.dw_total = self._place(dw)
        self.dgrad = None if forward_only else _Winograd(self._flipped(g), itemsize, True, by_position)

    @staticmethod
    def _flipped(g):
        """The geometry of dx's convolution: dy (N, Cout, Ho, Wo) -> dx (N, Cin, H, W), padding 2 - p."""
        return type(g)(g.n, g.cout, g.ho, g.wo, g.cin, 3, 3, g.h, g.w, 1, (1, 1),
                       (2 - g.padding[0], 2 - g.padding[1]), (1, 1))

    def _place(self, parts):
        layout, off = {}, 0
        for name, shape in parts:
            layout[name] = (off, shape)
            off = align(off + int(np.prod(shape)) * self.isz)
        return layout, off

    def total(self, phase: str) -> int:
        return self.fwd_total if phase == "fwd" else max(self.dw_total, self.dgrad.fwd_total)

    @staticmethod
    def _views(ws: np.ndarray, layout, dt: np.dtype) -> dict:
        return {name: view(ws, off, shape, dt) for name, (off, shape) in layout.items()}

    def _group_views(self, ws, layout, dt, name, channels, samples):
        """A contiguous (16, samples * th * tw, channels) view at `name`'s place (a short last group too); one
        position's (samples * th * tw, channels) in the by-position variant."""
        rows = samples * self.th * self.tw
        return view(ws, layout[name][0], (rows, channels) if self.by_position else (16, rows, channels), dt)

    def _spans(self):
        """The groups of samples, [s0, s1) each: fixed by the shapes, the same in both variants."""
        return [(s0, min(self.g.n, s0 + self.size)) for s0 in range(0, self.g.n, self.size)]

    def _pieces(self, s0: int, s1: int) -> list[tuple[int, int]]:
        """The rows [r0, r1) of group [s0, s1)'s V and M that the forward multiplies in one GEMM each: the
        compiled forward's fixed pieces (`cpu_winograd_jit.forward_pieces`), which every path and variant uses,
        so that all run the same GEMMs."""
        k = jit()
        pieces = k.forward_pieces(self.size * self.th * self.tw)
        cuts = [k.piece_units(self.size, self.th, (s1 - s0) * self.th, q, pieces) for q in range(pieces)]
        return [(lo * self.tw, hi * self.tw) for lo, hi in cuts if lo < hi]

    def forward(self, x, w, y, ws) -> None:
        """y = conv(x, w) (no bias); `w` may be any strided view (dx passes the flipped, transposed kernel)."""
        k = jit()
        g, dt = self.g, x.dtype
        b = self._views(ws, self.fwd_layout, dt)
        np.copyto(b["wt"], w.transpose(2, 3, 1, 0))
        xs = b["xs"].reshape(2 * self.th + 2, 2 * self.tw + 2, BLOCK)
        if self.by_position:
            for pos in range(16):
                k.weight_position(b["wt"], pos // 4, pos % 4, b["u"])
                for s0, s1 in self._spans():
                    v = self._group_views(ws, self.fwd_layout, dt, "v", self.cib, s1 - s0)
                    m = self._group_views(ws, self.fwd_layout, dt, "m", self.cob, s1 - s0)
                    k.input_position(x, s0, s1, g.padding[0], g.padding[1], self.th, self.tw, pos // 4, pos % 4,
                                     xs, v)
                    for r0, r1 in self._pieces(s0, s1):
                        _gemm(v[r0:r1], b["u"], m[r0:r1], False)
                    k.output_position(m, s0, s1, self.th, self.tw, pos // 4, pos % 4, y)
            return
        k.weight_tiles(b["wt"], b["u"])
        if _compiled_gemm():
            # the slots lie from the transposed weight on: dead once U is built
            nw = min(workers(x.size, self.cib), k.forward_pieces(self.size * self.th * self.tw))
            slots = self._slots(ws, dt, self.fwd_layout["wt"][0], self.fwd_total, nw)
            args = (x, b["u"], b["v"].reshape(-1), b["m"].reshape(-1), y, self.size, g.padding[0], g.padding[1],
                    self.th, self.tw, slots)
            if len(slots) > 1:
                with lanes.blas_pinned():
                    k.forward_parallel(*args)
            else:
                k.forward(*args)
            return
        ys = b["ys"].reshape(2 * self.th, 2 * self.tw, BLOCK)
        for s0, s1 in self._spans():
            v = self._group_views(ws, self.fwd_layout, dt, "v", self.cib, s1 - s0)
            m = self._group_views(ws, self.fwd_layout, dt, "m", self.cob, s1 - s0)
            k.input_tiles(x, s0, s1, g.padding[0], g.padding[1], self.th, self.tw, xs, b["buf"], v)
            for r0, r1 in self._pieces(s0, s1):
                np.matmul(v[:, r0:r1], b["u"], out=m[:, r0:r1])
            k.output_tiles(m, s0, s1, self.th, self.tw, ys, b["buf"], y)

    def _slots(self, ws, dt, start: int, end: int, nw: int) -> np.ndarray:
        """Scratch for up to `nw` workers (`cpu_winograd_jit`, the compiled-GEMM path) in the workspace's bytes
        [start, end), memory that is dead while they run: a (k, slot) array, each slot one input block (the
        larger of the input and output blocks, which a worker uses in turn) and 256 values; k as many as fit.
        The regions hold the one-thread scratch (an input and an output block) and the transposed weight (at
        least 32 x 32 x 9 values), so two slots fit up to planes of ~270 pixels a side; beyond, fewer workers."""
        per = (2 * self.th + 2) * (2 * self.tw + 2) * BLOCK + 256
        n = max(1, min(nw, (end - start) // (per * self.isz)))
        return view(ws, start, (n, per), dt)

    def backward(self, x, w, dy, dx, dw, ws) -> None:
        """dW first (through the transforms' gradient), then dx as the flipped convolution, in the same memory."""
        if dw is not None:
            self._weight_grad(x, dy, dw, ws)
        if dx is not None:
            self.dgrad.forward(dy, w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3), dx, ws)

    def _weight_grad(self, x, dy, dw, ws) -> None:
        """dU = sum over the groups (in order) of V^T @ dM per position; dW = G^T dU G."""
        b = self._views(ws, self.dw_layout, x.dtype)
        if self.by_position:
            self._weight_grad_by_position(x, dy, ws, b)
        elif _compiled_gemm() and self.groups > 1:
            self._weight_grad_halves(x, dy, b, ws)
        elif _compiled_gemm():
            # the slots lie from the product buffer on (it, the transposed weight, the one-thread scratch):
            # dead until the loop's GEMMs, which run after the transforms
            slots = self._slots(ws, x.dtype, self.dw_layout["prod"][0], self.dw_total, workers(x.size))
            with lanes.blas_pinned() if len(slots) > 1 else nullcontext():
                self._weight_grad_compiled(x, dy, ws, b, slots)
        else:
            self._weight_grad_numpy(x, dy, ws, b)
        jit().weight_grad_tiles(b["acc"], b["wt"])
        np.copyto(dw, b["wt"].transpose(3, 2, 0, 1))

    def _dw_groups(self, ws, dt):
        """(s0, s1, V, dM) per group of samples, the views of the weight gradient's layout."""
        for s0, s1 in self._spans():
            yield (s0, s1, self._group_views(ws, self.dw_layout, dt, "v", self.cib, s1 - s0),
                   self._group_views(ws, self.dw_layout, dt, "m", self.cob, s1 - s0))

    def _dw_scratch(self, b):
        """The one-thread input and gradient scratch blocks of the weight gradient's layout."""
        return (b["xs"].reshape(2 * self.th + 2, 2 * self.tw + 2, BLOCK),
                b["ys"].reshape(2 * self.th, 2 * self.tw, BLOCK))

    def _weight_grad_halves(self, x, dy, b, ws) -> None:
        """dU over several groups, compiled: two fixed halves of every group's tiles, summed apart and then added
        (`cpu_winograd_jit.weight_grad_halves`), on two threads where two slots fit and the layer is large
        enough. H0 accumulates in `acc`, H1 in `prod`; the slots lie from the transposed weight on (it and the
        one-thread scratch are dead until the end), which holds two up to planes of ~270 pixels a side."""
        g, k = self.g, jit()
        slots = self._slots(ws, x.dtype, self.dw_layout["wt"][0], self.dw_total, min(2, workers(x.size)))
        args = (x, dy, self.size, g.padding[0], g.padding[1], self.th, self.tw, b["v"].reshape(-1),
                b["m"].reshape(-1), b["acc"], b["prod"], slots)
        if len(slots) > 1:
            with lanes.blas_pinned():
                k.weight_grad_halves_parallel(*args)
        else:
            k.weight_grad_halves(*args)

    def _weight_grad_compiled(self, x, dy, ws, b, slots) -> None:
        """Per group: V and dM (one OpenMP region when there are several slots), then the 16 products V^T dM
        (another, by positions), added into dU in group order."""
        k, g, nw = jit(), self.g, len(slots)
        for s0, s1, v, dm in self._dw_groups(ws, x.dtype):
            args = (x, dy, s0, s1, g.padding[0], g.padding[1], self.th, self.tw, v, dm, slots)
            first = s0 == 0
            out = b["acc"] if first else b["prod"]
            if nw > 1:
                k.transforms_parallel(*args)
                k.positions_parallel(v, dm, out, b["acc"], not first, nw)
            else:
                k.transforms(*args)
                k.positions(v, dm, out, b["acc"], not first)

    def _weight_grad_numpy(self, x, dy, ws, b) -> None:
        """The same sums with np.matmul, where the compiled GEMM is not bound (one thread)."""
        k, g = jit(), self.g
        xs, ds = self._dw_scratch(b)
        acc, prod = b["acc"], b["prod"]
        for s0, s1, v, dm in self._dw_groups(ws, x.dtype):
            k.input_tiles(x, s0, s1, g.padding[0], g.padding[1], self.th, self.tw, xs, b["buf"], v)
            k.grad_tiles(dy, s0, s1, self.th, self.tw, ds, b["buf"], dm)
            if s0 == 0:
                np.matmul(v.transpose(0, 2, 1), dm, out=acc)
            else:
                np.matmul(v.transpose(0, 2, 1), dm, out=prod)
                np.add(acc, prod, out=acc)

    def _weight_grad_by_position(self, x, dy, ws, b) -> None:
        """dU position by position (the frugal variant): per group, per position, V1 and dM1, then V1^T dM1."""
        k, g = jit(), self.g
        xs, ds = self._dw_scratch(b)
        acc, prod = b["acc"], b["prod"]
        if _compiled_gemm() and self.groups > 1:  # the whole-tile variant's two halves, position by position
            for pos in range(16):
                started = np.zeros(2, np.bool_)
                for s0, s1, v, dm in self._dw_groups(ws, x.dtype):
                    k.input_position(x, s0, s1, g.padding[0], g.padding[1], self.th, self.tw, pos // 4, pos % 4,
                                     xs, v)
                    k.grad_position(dy, s0, s1, self.th, self.tw, pos // 4, pos % 4, ds, dm)
                    k.half_products(v, dm, k.half_cut(self.size, self.th, (s1 - s0) * self.th), self.tw, acc[pos],
                                    prod, started)
                k.add_into(acc[pos], prod)  # the addition the compiled halves end with
            return
        for s0, s1, v, dm in self._dw_groups(ws, x.dtype):
            for pos in range(16):
                k.input_position(x, s0, s1, g.padding[0], g.padding[1], self.th, self.tw, pos // 4, pos % 4, xs, v)
                k.grad_position(dy, s0, s1, self.th, self.tw, pos // 4, pos % 4, ds, dm)
                if s0 == 0:
                    _gemm(v, dm, acc[pos], True)
                else:
                    _gemm(v, dm, prod, True)
                    np.add(acc[pos], prod, out=acc[pos])
