"""Winograd's F(2x2, 3x3) convolution on the CPU: the `winograd` pair of `cpu.conv`.

Lavin & Gray 2016: y = A^T [(G g G^T) * (B^T d B)] A per 4x4 tile; over channels, 16 GEMMs M[pos] = V[pos] @
U[pos], 2.25x fewer multiplications than im2col; the transforms are compiled additions (`cpu.winograd_jit`).
dx is the forward of dy with the kernel flipped, Cin/Cout swapped, padding 2 - p; dW = G^T dU G.
Rules: both variants sum in one order (sample groups fixed by the shapes, dU over groups in order, each
output's nine terms in position order): the same bits. Applies to 3x3, stride 1, one group, padding 0..2, at
least 32 channels (16 channels: 2.6 ms against the row-shift's 2.1); not offered without numba.
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
_GROUP_ELEMS = 16384  # V and M of a group hold about 16 * this many values (1 MiB in float32)
MIN_CHANNELS = 32


def available() -> bool:
    """Whether numba can be found, without importing it (planning should not pay its import)."""
    return importlib.util.find_spec("numba") is not None


def applies(g) -> bool:
    """Whether the convolution of geometry `g` can run Winograd F(2x2, 3x3) (imports the kernels)."""
    return (g.groups == 1 and (g.kh, g.kw) == (3, 3) and tuple(g.stride) == (1, 1)
            and tuple(g.dilation) == (1, 1) and all(0 <= p <= 2 for p in g.padding)
            and min(g.cin, g.cout) >= MIN_CHANNELS and available() and jit() is not None)


MAX_SPLIT_CHANNELS = 256  # channels above which a layer's forward runs on one thread (no measured network)


def workers(values: int = PARALLEL_MIN, channels: int = MIN_CHANNELS) -> int:
    """Threads of a whole-tile call (`cpu.jit.workers_for`); 1 without the bound GEMM or above
    `MAX_SPLIT_CHANNELS`. Pieces are fixed by the shapes: no bits depend on this."""
    if not _compiled_gemm() or channels > MAX_SPLIT_CHANNELS:
        return 1
    return workers_for(values)


def _compiled_gemm() -> bool:
    """Whether numpy's GEMM is bound for compiled code (`cpu.gemm_jit`): decided once per process."""
    g = gemm_jit()
    return g is not None and g.available()


def _gemm(a, b, c, trans_a: bool) -> None:
    """c = a @ b (a.T @ b with `trans_a`): the same call the whole-tile variant's GEMMs make."""
    if _compiled_gemm():
        gemm_jit().gemm(a, b, c, trans_a)
    else:
        np.matmul(a.T if trans_a else a, b, out=c)


def _round(c: int) -> int:
    return -(-c // BLOCK) * BLOCK


class _Winograd:
    """One layer's Winograd convolution, two variants with the same values and sums: `winograd` (all 16
    positions of a group's tiles at once: U | V | M | weight | scratch; backward dW's then dx's in the same memory)
    and `winograd_by_position` (one position at a time, a sixteenth of U, V and M; slower)."""

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
        """dx's convolution: dy (N, Cout, Ho, Wo) -> dx (N, Cin, H, W), padding 2 - p."""
        return type(g)(g.n, g.cout, g.ho, g.wo, g.cin, 3, 3, g.h, g.w, 1, (1, 1),
                       (2 - g.padding[0], 2 - g.padding[1]), (1, 1))

    def _place(self, parts):
        layout, off = {}, 0
        for name, shape in parts:
            layout[name] = (off, shape)
            off = align(off + int(np.prod(shape)) * self.isz)
        return layout, off

    def total(self, phase: str, accumulate: bool = False) -> int:
        if phase == "fwd":
            return self.fwd_total
        return max(self.dw_total, self.dgrad.fwd_total + (self.dgrad.group_tile_bytes() if accumulate else 0))

    def group_tile_bytes(self) -> int:
        """An accumulating by-position forward's tile of one group's outputs."""
        g = self.g
        return self.size * g.cout * g.ho * g.wo * self.isz if self.by_position else 0

    @staticmethod
    def _views(ws: np.ndarray, layout, dt: np.dtype) -> dict:
        return {name: view(ws, off, shape, dt) for name, (off, shape) in layout.items()}

    def _group_views(self, ws, layout, dt, name, channels, samples):
        """A (16, samples * th * tw, channels) view at `name` (one position's in by-position)."""
        rows = samples * self.th * self.tw
        return view(ws, layout[name][0], (rows, channels) if self.by_position else (16, rows, channels), dt)

    def _spans(self):
        """The groups of samples [s0, s1), fixed by the shapes."""
        return [(s0, min(self.g.n, s0 + self.size)) for s0 in range(0, self.g.n, self.size)]

    def _pieces(self, s0: int, s1: int) -> list[tuple[int, int]]:
        """Rows [r0, r1) of a group's V and M per forward GEMM (`cpu.winograd_jit.forward_pieces`)."""
        k = jit()
        pieces = k.forward_pieces(self.size * self.th * self.tw)
        cuts = [k.piece_units(self.size, self.th, (s1 - s0) * self.th, q, pieces) for q in range(pieces)]
        return [(lo * self.tw, hi * self.tw) for lo, hi in cuts if lo < hi]

    def forward(self, x, w, y, ws, accumulate: bool = False) -> None:
        """y (+)= conv(x, w), no bias; `w` may be a strided view. Accumulating, each output's nine
        terms are summed before y's value is added."""
        k = jit()
        g, dt = self.g, x.dtype
        b = self._views(ws, self.fwd_layout, dt)
        np.copyto(b["wt"], w.transpose(2, 3, 1, 0))
        xs = b["xs"].reshape(2 * self.th + 2, 2 * self.tw + 2, BLOCK)
        if self.by_position and accumulate:
            self._forward_by_group(x, y, ws, b, xs)
            return
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
            # slots from the transposed weight on: dead once U is built
            nw = min(workers(x.size, self.cib), k.forward_pieces(self.size * self.th * self.tw))
            slots = self._slots(ws, dt, self.fwd_layout["wt"][0], self.fwd_total, nw)
            args = (x, b["u"], b["v"].reshape(-1), b["m"].reshape(-1), y, self.size, g.padding[0], g.padding[1],
                    self.th, self.tw, slots, accumulate)
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
            k.output_tiles(m, s0, s1, self.th, self.tw, ys, b["buf"], y, accumulate)

    def _forward_by_group(self, x, y, ws, b, xs) -> None:
        """The by-position forward accumulating: each group's 16 positions summed in a tile,
        then added to y."""
        k, g, dt = jit(), self.g, x.dtype
        tile = view(ws, self.fwd_total, (self.size, g.cout, g.ho, g.wo), dt)
        for s0, s1 in self._spans():
            t = tile[:s1 - s0]
            v = self._group_views(ws, self.fwd_layout, dt, "v", self.cib, s1 - s0)
            m = self._group_views(ws, self.fwd_layout, dt, "m", self.cob, s1 - s0)
            for pos in range(16):
                k.weight_position(b["wt"], pos // 4, pos % 4, b["u"])
                k.input_position(x, s0, s1, g.padding[0], g.padding[1], self.th, self.tw, pos // 4, pos % 4, xs, v)
                for r0, r1 in self._pieces(s0, s1):
                    _gemm(v[r0:r1], b["u"], m[r0:r1], False)
                k.output_position(m, 0, s1 - s0, self.th, self.tw, pos // 4, pos % 4, t)
            np.add(y[s0:s1], t, out=y[s0:s1])

    def _slots(self, ws, dt, start: int, end: int, nw: int) -> np.ndarray:
        """Scratch for up to `nw` workers in the dead bytes [start, end): (k, slot), one input block and
        256 values each; two fit up to planes of ~270 pixels a side."""
        per = (2 * self.th + 2) * (2 * self.tw + 2) * BLOCK + 256
        n = max(1, min(nw, (end - start) // (per * self.isz)))
        return view(ws, start, (n, per), dt)

    def backward(self, x, w, dy, dx, dw, ws, accumulate: bool = False) -> None:
        """dW first, then dx as the flipped convolution (+= with `accumulate`), same memory."""
        if dw is not None:
            self._weight_grad(x, dy, dw, ws)
        if dx is not None:
            self.dgrad.forward(dy, w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3), dx, ws, accumulate)

    def _weight_grad(self, x, dy, dw, ws) -> None:
        """dU = sum over the groups (in order) of V^T @ dM per position; dW = G^T dU G."""
        b = self._views(ws, self.dw_layout, x.dtype)
        if self.by_position:
            self._weight_grad_by_position(x, dy, ws, b)
        elif _compiled_gemm() and self.groups > 1:
            self._weight_grad_halves(x, dy, b, ws)
        elif _compiled_gemm():
            # slots from the product buffer on: dead until the GEMMs, after the transforms
            slots = self._slots(ws, x.dtype, self.dw_layout["prod"][0], self.dw_total, workers(x.size))
            with lanes.blas_pinned() if len(slots) > 1 else nullcontext():
                self._weight_grad_compiled(x, dy, ws, b, slots)
        else:
            self._weight_grad_numpy(x, dy, ws, b)
        jit().weight_grad_tiles(b["acc"], b["wt"])
        np.copyto(dw, b["wt"].transpose(3, 2, 0, 1))

    def _dw_groups(self, ws, dt):
        """(s0, s1, V, dM) per group."""
        for s0, s1 in self._spans():
            yield (s0, s1, self._group_views(ws, self.dw_layout, dt, "v", self.cib, s1 - s0),
                   self._group_views(ws, self.dw_layout, dt, "m", self.cob, s1 - s0))

    def _dw_scratch(self, b):
        """The one-thread input and gradient scratch blocks."""
        return (b["xs"].reshape(2 * self.th + 2, 2 * self.tw + 2, BLOCK),
                b["ys"].reshape(2 * self.th, 2 * self.tw, BLOCK))

    def _weight_grad_halves(self, x, dy, b, ws) -> None:
        """dU over several groups, compiled: two fixed halves of every group's tiles,
        summed apart (H0 in `acc`, H1 in `prod`) and then added; slots from the transposed weight on."""
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
        """Per group: V and dM, then the 16 products V^T dM added into dU in group order."""
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
        """The same sums with np.matmul (no bound GEMM)."""
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
        """dU position by position: per group and position V1, dM1, then V1^T dM1."""
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
