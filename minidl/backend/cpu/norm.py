"""Normalization kernels of the CPU backend: batch normalization (NCHW, per channel) and cross-channel LRN.

Batch norm runs compiled (`cpu.norm_jit`), half arrays as their bits (`COMPILED_HALF`); these numpy passes are its
reference and float32 fallback, on blocks of the (N, C, H*W) view. Numerics: per-plane sums in float32, summed over
planes in float64 in a fixed order; the corrected two-pass variance (Chan, Golub & LeVeque 1983); the mean
subtracted first ((x - mean) * a + b is exact near the mean by Sterbenz, where x * a + b' loses eps * |mean| / std).
"""
from __future__ import annotations

import math

import numpy as np

from ..precision import HALF_DTYPES, is_half
from .jit import lazy, workers_for

_BLOCK = 1 << 16  # elements per block (256 KiB of float32): measured best at 32K-128K

jit_kernels = lazy("norm_jit")  # None without numba
#: Kernels whose compiled form reads and writes half arrays itself, without float32 copies (`cpu.half`).
COMPILED_HALF = frozenset({"batchnorm_forward_train", "batchnorm_forward_apply", "batchnorm_forward_eval",
                           "batchnorm_backward", "batchnorm_backward_eval"})
_BF16 = HALF_DTYPES["bf16"]


def _bits(a: np.ndarray) -> np.ndarray:
    """A half array as the uint16 bits the compiled kernels take; others as they are."""
    return a.view(np.uint16) if is_half(a.dtype) else a


def _bf(*arrays) -> bool:
    """Whether the call's half arrays are bfloat16 (else float16, or none)."""
    return any(a is not None and a.dtype == _BF16 for a in arrays)


def _or(a: np.ndarray | None, stand_in: np.ndarray) -> np.ndarray:
    """`a`, or a stand-in the kernel leaves alone (its flag says `a` is absent)."""
    return stand_in if a is None else a


def _ncl(a: np.ndarray) -> np.ndarray:
    """(N, C, H, W) -> (N, C, H*W) as a view (raises rather than copies)."""
    return np.reshape(a, a.shape[:2] + (-1,), copy=False)


def _nc_blocks(n: int, c: int, hw: int):
    """(channel slice, [sample slices]) covering (N, C): per-channel constants are spread once into a block-shaped
    buffer (broadcasting (C, 1) against (C, HW) costs twice a contiguous operand)."""
    if c * hw <= _BLOCK:
        step = max(1, _BLOCK // (c * hw))
        yield slice(0, c), [slice(n0, min(n, n0 + step)) for n0 in range(0, n, step)]
    else:
        step = max(1, _BLOCK // hw)
        for c0 in range(0, c, step):
            yield slice(c0, min(c, c0 + step)), [slice(i, i + 1) for i in range(n)]


def _block_elems(n: int, c: int, hw: int) -> int:
    if c * hw <= _BLOCK:
        return min(n, max(1, _BLOCK // (c * hw))) * c * hw
    return min(c, max(1, _BLOCK // hw)) * hw


class _Scratch:
    """Block-sized buffers: `take(i, shape)` is buffer i viewed as `shape`."""

    def __init__(self, count: int, elems: int, dtype):
        self._bufs = [np.empty(elems, dtype) for _ in range(count)]

    def take(self, i: int, shape) -> np.ndarray:
        size = math.prod(shape)  # not np.prod: ~5 us on a tuple
        return self._bufs[i][:size].reshape(shape)

    def spread(self, i: int, v: np.ndarray, cs: slice, hw: int) -> np.ndarray:
        """v[cs] broadcast into buffer i as a contiguous (channels, hw) block."""
        out = self.take(i, (cs.stop - cs.start, hw))
        np.copyto(out, v[cs, None])
        return out


def _centered_sums(x3: np.ndarray, center: np.ndarray, dy3: np.ndarray | None,
                   sc: _Scratch, squares: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """Per channel in float64, d = x - center: (sum(d), sum(d * d) if `squares`), or with dy3 (sum(dy),
    sum(dy * d))."""
    n, c, hw = x3.shape
    p1 = np.empty((n, c), x3.dtype)
    p2 = np.empty((n, c), x3.dtype)
    ones = np.ones(hw, x3.dtype)
    for cs, samples in _nc_blocks(n, c, hw):
        cb = sc.spread(0, center, cs, hw)
        for ns in samples:
            xb = x3[ns, cs]
            d = sc.take(1, xb.shape)
            np.subtract(xb, cb, out=d)
            if dy3 is None:
                np.vecdot(d, ones, out=p1[ns, cs])
                if squares:
                    np.vecdot(d, d, out=p2[ns, cs])
            else:
                dyb = dy3[ns, cs]
                np.vecdot(dyb, ones, out=p1[ns, cs])
                np.vecdot(dyb, d, out=p2[ns, cs])
    s2 = p2.sum(axis=0, dtype=np.float64) if dy3 is not None or squares else None
    return p1.sum(axis=0, dtype=np.float64), s2


class NormOps:
    """Batch-norm and LRN kernels (mixed into CPUBackend)."""

    def batchnorm_forward_train(self, x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None,
                                running_mean: np.ndarray, running_var: np.ndarray, y: np.ndarray, mean: np.ndarray,
                                invstd: np.ndarray, momentum: float, eps: float, update_running: bool = True,
                                relu_out: np.ndarray | None = None, keep_y: bool = True) -> None:
        """Normalize with batch statistics, saved in `mean`/`invstd`, folded into the running ones if `update_running`
        (variance unbiased). Pass 2 centres on pass 1's mean as stored: the correction is a rounding error of the mean.
        `relu_out`: also ReLU(y) there; with it and not `keep_y`, the compiled kernel leaves y unwritten."""
        x3 = _ncl(x)
        n, c, hw = x3.shape
        m = n * hw
        if m < 2:
            raise ValueError(f"batch norm in training needs more than one value per channel, got input {x.shape}")
        jit = jit_kernels()
        if jit is not None:
            y3 = _bits(_ncl(y))
            args = (_bits(x3), _or(weight, mean), _or(bias, mean), running_mean, running_var, y3, mean, invstd,
                    float(momentum), float(eps), bool(update_running), weight is not None, bias is not None,
                    y3 if relu_out is None else _bits(_ncl(relu_out)), relu_out is not None,
                    keep_y or relu_out is None, _bf(x, y))
            nw = min(workers_for(x3.size), c)
            if nw > 1:
                jit.train_parallel(*args, nw)
            else:
                jit.train(*args)
            return
        shift = np.add.reduce(x3[0], axis=1) * x.dtype.type(1.0 / hw)
        sc = _Scratch(2, _block_elems(n, c, hw), x.dtype)
        s1, _ = _centered_sums(x3, shift, None, sc, squares=False)
        mean[...] = shift + s1 / m
        d1, d2 = _centered_sums(x3, mean, None, sc)
        dmean = d1 / m
        mean64 = mean.astype(np.float64) + dmean
        var64 = np.maximum(d2 / m - dmean * dmean, 0.0)
        invstd[...] = 1.0 / np.sqrt(var64 + eps)
        if update_running:
            running_mean *= 1.0 - momentum
            running_mean += momentum * mean64
            running_var *= 1.0 - momentum
            running_var += momentum * var64 * (m / (m - 1))
        self.batchnorm_forward_apply(x, weight, bias, mean, invstd, y)
        if relu_out is not None:
            self.relu_forward(y, relu_out)

    def batchnorm_forward_apply(self, x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None,
                                mean: np.ndarray, invstd: np.ndarray, y: np.ndarray) -> None:
        """y = (x - mean) * (invstd * weight) + bias; recomputation calls it with the saved statistics."""
        x3, y3 = _ncl(x), _ncl(y)
        jit = jit_kernels()
        if jit is not None:
            args = (_bits(x3), _or(weight, mean), _or(bias, mean), mean, invstd, _bits(y3), weight is not None,
                    bias is not None, _bf(x, y))
            nw = min(workers_for(x3.size), x3.shape[1])
            if nw > 1:
                jit.apply_parallel(*args, nw)
            else:
                jit.apply(*args)
            return
        n, c, hw = x3.shape
        a = invstd * weight if weight is not None else invstd.copy()
        sc = _Scratch(3, _block_elems(n, c, hw), x.dtype)
        for cs, samples in _nc_blocks(n, c, hw):
            mb, ab = sc.spread(0, mean, cs, hw), sc.spread(1, a, cs, hw)
            bb = sc.spread(2, bias, cs, hw) if bias is not None else None
            for ns in samples:
                yb = y3[ns, cs]
                np.subtract(x3[ns, cs], mb, out=yb)
                np.multiply(yb, ab, out=yb)
                if bb is not None:
                    np.add(yb, bb, out=yb)

    def batchnorm_forward_eval(self, x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None,
                               running_mean: np.ndarray, running_var: np.ndarray, y: np.ndarray, eps: float) -> None:
        jit = jit_kernels()
        if jit is not None:
            jit.eval_forward(_bits(_ncl(x)), _or(weight, running_mean), _or(bias, running_mean), running_mean,
                             running_var, float(eps), _bits(_ncl(y)), weight is not None, bias is not None, _bf(x, y))
            return
        invstd = (1.0 / np.sqrt(running_var.astype(np.float64) + eps)).astype(x.dtype)
        self.batchnorm_forward_apply(x, weight, bias, running_mean, invstd, y)

    def batchnorm_backward(self, x: np.ndarray, weight: np.ndarray | None, dy: np.ndarray, mean: np.ndarray,
                           invstd: np.ndarray, dx: np.ndarray | None, dweight: np.ndarray | None,
                           dbias: np.ndarray | None, relu: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """dbias = sum(dy), dweight = sum(dy * xhat), dx = (dy - sum(dy)/M - (x - mean) invstd^2 sum(dy (x - mean))/M)
        * invstd * weight. `relu` = (r, dr): dy is a following ReLU's backward (compiled: per channel, unwritten)."""
        x3, dy3 = _ncl(x), _ncl(dy)
        jit = jit_kernels()
        if relu is not None and jit is None:
            self.relu_backward(relu[0], relu[1], dy)
            relu = None
        if jit is not None:
            x3, dy3 = _bits(x3), _bits(dy3)
            args = (x3, _or(weight, mean), dy3, mean, invstd, x3 if dx is None else _bits(_ncl(dx)),
                    _or(dweight, mean), _or(dbias, mean), weight is not None, dx is not None, dweight is not None,
                    dbias is not None, dy3 if relu is None else _bits(_ncl(relu[1])),
                    dy3 if relu is None else _bits(_ncl(relu[0])), relu is not None, _bf(x, dy, dx))
            nw = min(workers_for(x3.size), x3.shape[1])
            if nw > 1:
                jit.backward_parallel(*args, nw)
            else:
                jit.backward(*args)
            return
        n, c, hw = x3.shape
        m = n * hw
        sc = _Scratch(5, _block_elems(n, c, hw), x.dtype)
        sdy, sdyd = _centered_sums(x3, mean, dy3, sc)
        inv64 = invstd.astype(np.float64)
        if dbias is not None:
            dbias[...] = sdy
        if dweight is not None:
            dweight[...] = sdyd * inv64
        if dx is None:
            return
        # dx = dy * s + (x - mean) * kx + c per channel
        k = inv64 * inv64 * sdyd / m
        s64 = inv64 * weight if weight is not None else inv64
        dt = x.dtype
        scale, kx, c0 = s64.astype(dt), (-s64 * k).astype(dt), (-s64 * (sdy / m)).astype(dt)
        dx3 = _ncl(dx)
        for cs, samples in _nc_blocks(n, c, hw):
            sb, kb, cb = sc.spread(0, scale, cs, hw), sc.spread(2, kx, cs, hw), sc.spread(3, c0, cs, hw)
            mb = sc.spread(4, mean, cs, hw)
            for ns in samples:
                xb, dxb = x3[ns, cs], dx3[ns, cs]
                t = sc.take(1, xb.shape)
                np.multiply(dy3[ns, cs], sb, out=dxb)
                np.subtract(xb, mb, out=t)
                t *= kb
                dxb += t
                dxb += cb

    def batchnorm_backward_eval(self, x: np.ndarray, weight: np.ndarray | None, dy: np.ndarray,
                                running_mean: np.ndarray, running_var: np.ndarray, eps: float,
                                dx: np.ndarray | None, dweight: np.ndarray | None, dbias: np.ndarray | None) -> None:
        """Backward with fixed (running) statistics: dx = dy * weight * invstd."""
        x3, dy3 = _ncl(x), _ncl(dy)
        jit = jit_kernels()
        if jit is not None:
            x3, dy3 = _bits(x3), _bits(dy3)
            jit.backward_eval(x3, _or(weight, running_mean), dy3, running_mean, running_var, float(eps),
                              x3 if dx is None else _bits(_ncl(dx)), _or(dweight, running_mean),
                              _or(dbias, running_mean), weight is not None, dx is not None, dweight is not None,
                              dbias is not None, _bf(x, dy, dx))
            return
        n, c, hw = x3.shape
        inv64 = 1.0 / np.sqrt(running_var.astype(np.float64) + eps)
        sc = _Scratch(2, _block_elems(n, c, hw), x.dtype)
        if dweight is not None or dbias is not None:
            sdy, sdyd = _centered_sums(x3, running_mean, dy3, sc)
            if dbias is not None:
                dbias[...] = sdy
            if dweight is not None:
                dweight[...] = sdyd * inv64
        if dx is not None:
            scale = (inv64 * weight if weight is not None else inv64).astype(x.dtype)
            dx3 = _ncl(dx)
            for cs, samples in _nc_blocks(n, c, hw):
                sb = sc.spread(0, scale, cs, hw)
                for ns in samples:
                    np.multiply(dy3[ns, cs], sb, out=dx3[ns, cs])


    def lrn_forward(self, x: np.ndarray, y: np.ndarray, size: int, alpha: float, beta: float, k: float) -> None:
        """y = x / (k + alpha/size * sum x^2 over channels [c - size//2, c + (size-1)//2])^beta, as torch."""
        x3, y3 = _ncl(x), _ncl(y)
        bufs = _LRNScratch(x3.shape, x.dtype)
        for ns, ls in _nl_blocks(*x3.shape):
            xb = x3[ns, :, ls]
            s = bufs.scale(xb, size, alpha, k)
            _pow_neg(s, beta, out=s)
            np.multiply(xb, s, out=y3[ns, :, ls])

    def lrn_backward(self, x: np.ndarray, y: np.ndarray, dy: np.ndarray, dx: np.ndarray, size: int, alpha: float,
                     beta: float, k: float) -> None:
        """dx_i = dy_i s_i^-beta - (2 alpha beta / size) x_i sum_{c : i in W(c)} dy_c y_c / s_c."""
        x3, y3, dy3, dx3 = _ncl(x), _ncl(y), _ncl(dy), _ncl(dx)
        bufs = _LRNScratch(x3.shape, x.dtype)
        coef = x.dtype.type(2.0 * alpha * beta / size)
        for ns, ls in _nl_blocks(*x3.shape):
            xb, yb, dyb, dxb = x3[ns, :, ls], y3[ns, :, ls], dy3[ns, :, ls], dx3[ns, :, ls]
            s = bufs.scale(xb, size, alpha, k)
            t = bufs.view(bufs.t, xb)
            np.multiply(dyb, yb, out=t)
            t /= s  # t = dy * y / s
            tw = bufs.view(bufs.sq, xb)
            _window_sum(t, tw, lo=-((size - 1) // 2), hi=size // 2)
            tw *= xb
            tw *= coef
            _pow_neg(s, beta, out=s)
            np.multiply(dyb, s, out=dxb)
            dxb -= tw


class _LRNScratch:
    """Block-sized scratch of the LRN kernels."""

    def __init__(self, shape, dtype):
        n, c, hw = shape
        elems = _nl_block_elems(n, c, hw)
        self.sq = np.empty(elems, dtype)
        self.s = np.empty(elems, dtype)
        self.t = np.empty(elems, dtype)

    @staticmethod
    def view(buf: np.ndarray, like: np.ndarray) -> np.ndarray:
        return buf[:like.size].reshape(like.shape)

    def scale(self, xb: np.ndarray, size: int, alpha: float, k: float) -> np.ndarray:
        """s = k + alpha/size * (window sum of x^2) for one block."""
        sq, s = self.view(self.sq, xb), self.view(self.s, xb)
        np.multiply(xb, xb, out=sq)
        _window_sum(sq, s, lo=-(size // 2), hi=(size - 1) // 2)
        s *= xb.dtype.type(alpha / size)
        s += xb.dtype.type(k)
        return s


def _window_sum(src: np.ndarray, dst: np.ndarray, lo: int, hi: int) -> None:
    """dst[:, c] = sum_{o=lo..hi} src[:, c+o] over axis 1, zero outside [0, C)."""
    c = src.shape[1]
    np.copyto(dst, src)
    for o in range(lo, hi + 1):
        if o == 0 or abs(o) >= c:
            continue
        if o > 0:
            np.add(dst[:, :c - o], src[:, o:], out=dst[:, :c - o])
        else:
            np.add(dst[:, -o:], src[:, :c + o], out=dst[:, -o:])


def _pow_neg(s: np.ndarray, beta: float, out: np.ndarray) -> None:
    """out = s ** -beta, by square roots for the usual betas (pow is much slower)."""
    if beta == 0.75:
        np.sqrt(s, out=out)
        r = np.sqrt(out)
        out *= r  # s^3/4
        np.reciprocal(out, out=out)
    elif beta == 0.5:
        np.sqrt(s, out=out)
        np.reciprocal(out, out=out)
    elif beta == 1.0:
        np.reciprocal(s, out=out)
    else:
        np.power(s, -beta, out=out)


def _nl_blocks(n: int, c: int, hw: int):
    """(sample slice, H*W slice) blocks holding all channels (LRN couples them)."""
    if c * hw <= _BLOCK:
        step = max(1, _BLOCK // (c * hw))
        for n0 in range(0, n, step):
            yield slice(n0, min(n, n0 + step)), slice(0, hw)
    else:
        step = max(1, _BLOCK // c)
        for i in range(n):
            for l0 in range(0, hw, step):
                yield slice(i, i + 1), slice(l0, min(hw, l0 + step))


def _nl_block_elems(n: int, c: int, hw: int) -> int:
    if c * hw <= _BLOCK:
        return min(n, max(1, _BLOCK // (c * hw))) * c * hw
    return c * min(hw, max(1, _BLOCK // c))
