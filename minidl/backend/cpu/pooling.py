"""Pooling kernels of the CPU backend: max, average and global average pooling (NCHW, PyTorch semantics).

A 2-D pooling is one contiguous ufunc pass per kernel tap on a *phase grid*: each stride phase of a plane on a
padded grid whose row length the output shares, so a tap is a flat offset (strided short rows: 4-7x slower).
Padding holds -inf (max) or 0 (average); cells right of an output row are junk. Max-pool backward recomputes
the maxima and routes each gradient to the first maximum in row-major order (PyTorch's choice).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .jit import lazy, workers_for

pooling_jit = lazy("pooling_jit")  # None without numba
_BLOCK = 1 << 15  # output elements per block of planes (measured: 32K-64K best for a 3x3/2 max-pool)


@dataclass(slots=True, frozen=True)
class _Phase:
    """One stride phase (rows a::sh, columns b::sw): its nt rows and nu columns from grid row t0, column u0."""

    slot: int
    a: int
    b: int
    t0: int
    nt: int
    u0: int
    nu: int


@dataclass(slots=True, frozen=True)
class _Grid:
    """The phase-grid layout of one pooling geometry."""

    out_hw: tuple[int, int]
    stride: tuple[int, int]
    rows: int
    cols: int
    taps: tuple[tuple[int, int], ...]  # (phase slot, flat offset), row-major window order
    phases: tuple[_Phase, ...]
    covers_input: bool

    @property
    def cells(self) -> int:
        return self.rows * self.cols

    @property
    def out_len(self) -> int:
        """Flat length spanning a plane's outputs on the grid, junk cells included."""
        return (self.out_hw[0] - 1) * self.cols + self.out_hw[1]


def _grid(in_hw, out_hw, kernel, stride, padding, dilation) -> _Grid:
    (h, w), (ho, wo), (sh, sw) = in_hw, out_hw, stride
    offs_h = [i * dilation[0] - padding[0] for i in range(kernel[0])]
    offs_w = [j * dilation[1] - padding[1] for j in range(kernel[1])]
    qh = [o // sh for o in offs_h]  # output row oh reads phase row oh + q (q may be < 0)
    qw = [o // sw for o in offs_w]
    qh0, qw0 = min(qh), min(qw)
    rows, cols = ho + max(qh) - qh0, wo + max(qw) - qw0
    slots: dict[tuple[int, int], int] = {}
    taps = []
    for i, oh in enumerate(offs_h):
        for j, ow in enumerate(offs_w):
            key = (oh % sh, ow % sw)
            slot = slots.setdefault(key, len(slots))
            taps.append((slot, (qh[i] - qh0) * cols + (qw[j] - qw0)))
    phases = []
    covers = len(slots) == sh * sw
    for (a, b), slot in slots.items():
        # grid row t holds input row (t + qh0) * sh + a
        t0, u0 = -qh0, -qw0
        need_t = (h - 1 - a) // sh + 1 if a < h else 0
        need_u = (w - 1 - b) // sw + 1 if b < w else 0
        nt, nu = min(rows - t0, need_t), min(cols - u0, need_u)
        covers = covers and nt == need_t and nu == need_u
        phases.append(_Phase(slot, a, b, t0, max(0, nt), u0, max(0, nu)))
    return _Grid(tuple(out_hw), (sh, sw), rows, cols, tuple(taps), tuple(phases), covers)


def _planes(a: np.ndarray) -> np.ndarray:
    """(N, C, H, W) -> (N*C, H, W) as a view (raises rather than copies)."""
    return np.reshape(a, (-1,) + a.shape[2:], copy=False)


class _Scratch:
    """The buffers of one blocked pooling call, for `step` planes."""

    def __init__(self, g: _Grid, planes: int, dtype, phases: bool = True, dphases: bool = False,
                 flat: int = 1, masks: int = 0):
        self.step = max(1, min(planes, _BLOCK // max(1, g.out_hw[0] * g.cols)))
        per_plane = g.out_hw[0] * g.cols
        self.q = np.empty((len(g.phases), self.step, g.cells), dtype) if phases else None
        self.dq = np.empty((len(g.phases), self.step, g.cells), dtype) if dphases else None
        self.flat = [np.empty((self.step, per_plane), dtype) for _ in range(flat)]
        self.masks = [np.empty((self.step, g.out_len), bool) for _ in range(masks)]

    def blocks(self, planes: int):
        for p0 in range(0, planes, self.step):
            yield slice(p0, min(planes, p0 + self.step))


def _fill_phases(xb: np.ndarray, q: np.ndarray, g: _Grid, pad: float) -> None:
    """Lay the planes of xb on the phase grids q[slot, :n], `pad` around the input."""
    n = xb.shape[0]
    sh, sw = g.stride
    for ph in g.phases:
        v = q[ph.slot, :n].reshape(n, g.rows, g.cols)
        t1, u1 = ph.t0 + ph.nt, ph.u0 + ph.nu
        if ph.nt == 0 or ph.nu == 0:
            v.fill(pad)
            continue
        v[:, :ph.t0].fill(pad)
        v[:, t1:].fill(pad)
        v[:, ph.t0:t1, :ph.u0].fill(pad)
        v[:, ph.t0:t1, u1:].fill(pad)
        np.copyto(v[:, ph.t0:t1, ph.u0:u1],
                  xb[:, ph.a:ph.a + (ph.nt - 1) * sh + 1:sh, ph.b:ph.b + (ph.nu - 1) * sw + 1:sw])


def _scatter_phases(dq: np.ndarray, dxb: np.ndarray, g: _Grid) -> None:
    """dx = the input elements of the phase grids dq (zero where no grid holds one)."""
    n = dxb.shape[0]
    sh, sw = g.stride
    if not g.covers_input:
        dxb.fill(0)
    for ph in g.phases:
        if ph.nt and ph.nu:
            v = dq[ph.slot, :n].reshape(n, g.rows, g.cols)
            np.copyto(dxb[:, ph.a:ph.a + (ph.nt - 1) * sh + 1:sh, ph.b:ph.b + (ph.nu - 1) * sw + 1:sw],
                      v[:, ph.t0:ph.t0 + ph.nt, ph.u0:ph.u0 + ph.nu])


def _outputs(flat: np.ndarray, g: _Grid) -> np.ndarray:
    """The (n, Ho, Wo) outputs inside an (n, Ho * cols) grid-layout buffer."""
    return flat.reshape(flat.shape[0], g.out_hw[0], g.cols)[:, :, :g.out_hw[1]]


def _to_grid_layout(src: np.ndarray, flat: np.ndarray, g: _Grid) -> None:
    """Copy (n, Ho, Wo) into an (n, Ho * cols) grid-layout buffer, junk cells zero."""
    v = flat.reshape(flat.shape[0], g.out_hw[0], g.cols)
    np.copyto(v[:, :, :g.out_hw[1]], src)
    v[:, :, g.out_hw[1]:].fill(0)


def _reduce_taps(q: np.ndarray, n: int, g: _Grid, out: np.ndarray, op) -> None:
    """out = the `op` reduction over every tap of the phase grids q, one contiguous call a tap."""
    length = g.out_len
    (slot, off), *rest = g.taps
    np.copyto(out, q[slot, :n, off:off + length])
    for slot, off in rest:
        op(out, q[slot, :n, off:off + length], out=out)


def _pool_divisors(size_in: int, size_out: int, k: int, stride: int, pad: int, include_pad: bool) -> np.ndarray:
    """Per-output window size along one axis, as PyTorch's avg_pool2d counts it."""
    start = np.arange(size_out) * stride - pad
    end = np.minimum(start + k, size_in + pad)
    if include_pad:
        return (end - start).astype(np.float64)
    return (np.minimum(end, size_in) - np.maximum(start, 0)).astype(np.float64)


def _avg_inv_divisor(in_hw, out_hw, kernel, stride, padding, count_include_pad, dtype) -> np.ndarray:
    dh = _pool_divisors(in_hw[0], out_hw[0], kernel[0], stride[0], padding[0], count_include_pad)
    dw = _pool_divisors(in_hw[1], out_hw[1], kernel[1], stride[1], padding[1], count_include_pad)
    div = np.outer(dh, dw)
    with np.errstate(divide="ignore"):
        inv = np.where(div > 0, 1.0 / div, 0.0)  # an empty window outputs 0, as in PyTorch
    return inv.astype(dtype)


def _compiled_max(x: np.ndarray, dy_or_y: np.ndarray, dx: np.ndarray | None, g: _Grid) -> bool:
    """A max-pool forward (dx None: dy_or_y is y) or backward by `pooling_jit`: whether it ran."""
    k = pooling_jit()
    arrays = (x, dy_or_y) if dx is None else (x, dy_or_y, dx)
    if k is None or not all(a.flags.c_contiguous and a.dtype == x.dtype for a in arrays):
        return False
    x3, o3 = _planes(x), _planes(dy_or_y)
    workers = min(x3.shape[0], workers_for(x.size))
    phases = np.array([(p.slot, p.a, p.b, p.t0, p.nt, p.u0, p.nu) for p in g.phases], np.int64)
    taps = np.array(g.taps, np.int64)
    q = np.empty((workers, len(g.phases), g.cells), x.dtype)
    m = np.empty((workers, g.out_hw[0] * g.cols), x.dtype)
    sh, sw = g.stride
    if dx is None:
        args = (x3, o3, q, m, phases, taps, g.cols, sh, sw)
        if workers > 1:
            k.maxpool_forward_parallel(*args, workers)
        else:
            k.maxpool_forward(*args[:2], q[0], m[0], *args[4:], 0, x3.shape[0])
        return True
    dq, r = np.empty_like(q), np.empty_like(m)
    if workers > 1:
        k.maxpool_backward_parallel(x3, o3, _planes(dx), q, dq, m, r, phases, taps, g.cols, sh, sw,
                                    g.covers_input, workers)
    else:
        k.maxpool_backward(x3, o3, _planes(dx), q[0], dq[0], m[0], r[0], phases, taps, g.cols, sh, sw,
                           g.covers_input, 0, x3.shape[0])
    return True


class PoolOps:
    """Max, average and global-average pooling kernels (mixed into CPUBackend)."""

    def maxpool2d_forward(self, x: np.ndarray, y: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int],
                          padding: tuple[int, int], dilation: tuple[int, int]) -> None:
        g = _grid(x.shape[2:], y.shape[2:], kernel, stride, padding, dilation)
        if _compiled_max(x, y, None, g):
            return
        x3, y3 = _planes(x), _planes(y)
        sc = _Scratch(g, x3.shape[0], x.dtype, flat=1)
        length = g.out_len
        for b in sc.blocks(x3.shape[0]):
            n = b.stop - b.start
            _fill_phases(x3[b], sc.q, g, -np.inf)
            m = sc.flat[0][:n]
            _reduce_taps(sc.q, n, g, m[:, :length], np.maximum)
            np.copyto(y3[b], _outputs(m, g))

    def maxpool2d_backward(self, x: np.ndarray, dy: np.ndarray, dx: np.ndarray, kernel: tuple[int, int],
                           stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int]) -> None:
        """Per block the maxima m recomputed; per tap in row-major order g = r * (x == m), r -= g (r: the gradient not
        yet routed), so a later tie gets nothing. Plain ufuncs: `where=` is 10x slower."""
        g = _grid(x.shape[2:], dy.shape[2:], kernel, stride, padding, dilation)
        if _compiled_max(x, dy, dx, g):
            return
        x3, dy3, dx3 = _planes(x), _planes(dy), _planes(dx)
        sc = _Scratch(g, x3.shape[0], x.dtype, dphases=True, flat=3, masks=1)
        length = g.out_len
        last = len(g.taps) - 1
        for b in sc.blocks(x3.shape[0]):
            n = b.stop - b.start
            q, dq = sc.q, sc.dq
            _fill_phases(x3[b], q, g, -np.inf)
            m, r, gr = (f[:n, :length] for f in sc.flat)
            eq = sc.masks[0][:n]
            _reduce_taps(q, n, g, m, np.maximum)
            _to_grid_layout(dy3[b], sc.flat[1][:n], g)
            dq[:, :n].fill(0)
            for k, (slot, off) in enumerate(g.taps):
                np.equal(q[slot, :n, off:off + length], m, out=eq)
                np.multiply(r, eq, out=gr)
                dqv = dq[slot, :n, off:off + length]
                np.add(dqv, gr, out=dqv)
                if k != last:
                    np.subtract(r, gr, out=r)
            _scatter_phases(dq, dx3[b], g)

    def avgpool2d_forward(self, x: np.ndarray, y: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int],
                          padding: tuple[int, int], count_include_pad: bool) -> None:
        g = _grid(x.shape[2:], y.shape[2:], kernel, stride, padding, (1, 1))
        inv = _avg_inv_divisor(x.shape[2:], y.shape[2:], kernel, stride, padding, count_include_pad, y.dtype)
        x3, y3 = _planes(x), _planes(y)
        sc = _Scratch(g, x3.shape[0], x.dtype, flat=1)
        length = g.out_len
        for b in sc.blocks(x3.shape[0]):
            n = b.stop - b.start
            _fill_phases(x3[b], sc.q, g, 0.0)
            s = sc.flat[0][:n]
            _reduce_taps(sc.q, n, g, s[:, :length], np.add)
            np.multiply(_outputs(s, g), inv, out=y3[b])

    def avgpool2d_backward(self, dy: np.ndarray, dx: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int],
                           padding: tuple[int, int], count_include_pad: bool) -> None:
        g = _grid(dx.shape[2:], dy.shape[2:], kernel, stride, padding, (1, 1))
        inv = _avg_inv_divisor(dx.shape[2:], dy.shape[2:], kernel, stride, padding, count_include_pad, dx.dtype)
        dy3, dx3 = _planes(dy), _planes(dx)
        sc = _Scratch(g, dy3.shape[0], dx.dtype, phases=False, dphases=True, flat=1)
        length = g.out_len
        for b in sc.blocks(dy3.shape[0]):
            n = b.stop - b.start
            r = sc.flat[0][:n]
            r3 = r.reshape(n, g.out_hw[0], g.cols)
            np.multiply(dy3[b], inv, out=r3[:, :, :g.out_hw[1]])
            r3[:, :, g.out_hw[1]:].fill(0)
            dq = sc.dq
            dq[:, :n].fill(0)
            for slot, off in g.taps:
                dqv = dq[slot, :n, off:off + length]
                np.add(dqv, r[:, :length], out=dqv)
            _scatter_phases(dq, dx3[b], g)

    def global_avgpool_forward(self, x: np.ndarray, y: np.ndarray) -> None:
        """(N, C, H, W) -> (N, C): the mean of each plane."""
        n, c = x.shape[:2]
        np.sum(x.reshape(n, c, -1), axis=2, out=y)
        y *= y.dtype.type(1.0 / (x.shape[2] * x.shape[3]))

    def global_avgpool_backward(self, dy: np.ndarray, dx: np.ndarray) -> None:
        scale = dx.dtype.type(1.0 / (dx.shape[2] * dx.shape[3]))
        np.multiply(dy[:, :, None, None], scale, out=dx)
