"""Softmax cross-entropy of the CPU backend compiled with numba: the loss over rows of logits and its gradient,
with or without an ignored label, in one pass over each row (plus one over the row in cache).

Why. A language model's loss reads (B*T, vocabulary) logits: GPT-2 small at batch 4 x 128 tokens has 25.7M of
them (103 MB of float32). The numpy kernels (`CoreOps.softmax_xent_*`, the fallback) made three tensor-sized
temporaries a call (x - max, its exp, a boolean mask) and ran on one thread: ~31 ms forward, ~28 ms backward
there. Here each row is read once from memory, its exponentials land in a per-thread row of scratch (forward)
or straight in the gradient (backward), and rows split over the threads.

Rules (Note [cross-entropy on threads]):
- a row's max, sum and loss are computed by one thread, in an order fixed by the row's length alone
  (`seq_jit._sum`'s lanes); the mean over rows is summed in row order by one thread after the rows are done: so
  the bits never depend on the thread count;
- exp of a float32 value is `_exp32` below, written in float32 operations (Cephes' `expf`: a reduction by
  multiples of ln 2, a degree-6 polynomial, a power of two built from its bits), so that the loop vectorizes
  (numba has no vector exp without Intel's SVML, and the C library's scalar `expf` cost ~3 ns a value here
  against ~0.3 for numpy's) and gives the same bits on any x86-64 CPU (nothing fastmath: no reordering, no
  fused multiply-add). Within 2 ulp of the true value on [-87.3, 0], the only range it is called on
  (x - max <= 0); below it, 0 (the true value is subnormal there, < 1.2e-38). float64 logits use `math.exp`;
- a row with a NaN or +inf logit, or a label outside [0, classes) that is not ignored, gets a NaN loss and NaN
  gradients (PyTorch's NaN, without reading outside the row): the divergence guard sees it.

Numerics: the loss of a row is log(sum) - (x[label] - max), in float64, the sum of the row's exponentials in
float64; the mean is the float64 sum of the rows' losses in order over the count, rounded once. The gradient
is (e * (1 / sum) - onehot) * scale, in float64, rounded once; scale = dloss / count (the caller's).
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import types
from numba.extending import intrinsic

from ...core.jit_cache import njit
from .seq_jit import _sum

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
_INF = math.inf

# Cephes' expf (float32): exp(a) = 2^n exp(r), n = round(a log2 e), r = a - n ln 2 (ln 2 in two parts).
_EXP_LO = np.float32(-87.33654)         # ~ln of float32's smallest normal: below it, exp is 0 here
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)       # ln 2 = _LN2_HI + _LN2_LO, the first exact in few bits
_LN2_LO = np.float32(-2.12194440e-4)
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)
_HALF, _ONE = np.float32(0.5), np.float32(1.0)


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 `bits` (an LLVM bitcast: no conversion)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


def _flip(builder, bits, width: int):
    """bits ^ ((bits >> (width - 1)) & INT_MAX): the map between a float's bits and an integer that orders as
    the float does (negative floats' magnitude bits reversed); its own inverse."""
    sign = builder.ashr(bits, ir.Constant(bits.type, width - 1))
    return builder.xor(bits, builder.and_(sign, ir.Constant(bits.type, (1 << (width - 1)) - 1)))


@intrinsic
def _order_key(typingctx, v):
    """The integer of v's width that orders as v (float32 -> int32, float64 -> int64): ... < key(-inf) < keys of
    finite floats < key(+inf) < ..., NaNs outside [key(-inf), key(+inf)] (by their sign bit, either side)."""
    width = v.bitwidth
    out = types.int32 if width == 32 else types.int64

    def codegen(context, builder, signature, args):
        return _flip(builder, builder.bitcast(args[0], ir.IntType(width)), width)
    return out(v), codegen


@intrinsic
def _from_order_key(typingctx, k, like):
    """The float (of `like`'s type) whose `_order_key` is k."""
    width = like.bitwidth
    ftype = ir.FloatType() if width == 32 else ir.DoubleType()

    def codegen(context, builder, signature, args):
        return builder.bitcast(_flip(builder, args[0], width), ftype)
    return like(k, like), codegen


@njit(**_OPTS)
def _exp32(a):
    """exp(a) for a float32 a <= 0 (see the module note); 0 below `_EXP_LO`, which also takes -inf and NaN (a
    NaN's row is marked by its caller)."""
    lo = not (a >= _EXP_LO)
    a = _EXP_LO if lo else a
    n = np.floor(a * _LOG2E + _HALF)
    r = a - n * _LN2_HI
    r = r - n * _LN2_LO
    p = _P0 * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    p = p * (r * r) + r + _ONE
    e = p * _float32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))
    return np.float32(0.0) if lo else e


@njit(**_OPTS)
def _row_max(x):
    """(the max of the 1-D x, whether x holds a NaN or +inf). As integer max and min of `_order_key`s: they
    vectorize (a float max reduction does not without fastmath) and see NaNs; exact whatever the order."""
    inf = x.dtype.type(_INF)
    hi = lo = _order_key(-inf)
    for j in range(x.shape[0]):
        k = _order_key(x[j])
        hi = max(hi, k)
        lo = min(lo, k)
    return _from_order_key(hi, inf), hi >= _order_key(inf) or lo < _order_key(-inf)


@njit(**_OPTS)
def _exp_shifted(x, m, e):
    """e = exp(x - m) elementwise (x - m in x's dtype), e of x's dtype."""
    if x.itemsize == 4:
        for j in range(x.shape[0]):
            e[j] = _exp32(np.float32(x[j] - m))
    else:
        for j in range(x.shape[0]):
            e[j] = math.exp(x[j] - m)


@njit(**_OPTS)
def _forward_rows(logits, labels, ignore, has_ignore, losses, lo, hi):
    """losses[i] for rows [lo, hi): log(sum exp(x - max)) - (x[label] - max), in float64; 0 for an ignored
    row; NaN for a row with a NaN or +inf logit or a label outside the row."""
    k = logits.shape[1]
    e = np.empty(k, logits.dtype)  # one row of exponentials (scratch)
    for i in range(lo, hi):
        lab = labels[i]
        if has_ignore and lab == ignore:
            losses[i] = 0.0
            continue
        x = logits[i]
        m, bad = _row_max(x)
        if bad or lab < 0 or lab >= k:
            losses[i] = np.nan
            continue
        _exp_shifted(x, m, e)
        losses[i] = math.log(_sum(e)) - float(x[lab] - m)


@njit(**_OPTS)
def _mean(losses, labels, ignore, has_ignore):
    """The sum of the counted rows' losses in row order, over their count (NaN when none counts)."""
    s = 0.0
    n = 0
    for i in range(losses.shape[0]):
        if has_ignore and labels[i] == ignore:
            continue
        s += losses[i]
        n += 1
    return s / n if n else np.nan


@njit(**_OPTS)
def xent_forward(logits, labels, ignore, has_ignore, losses):
    """The mean loss over the rows not ignored (float64; the caller rounds it); losses (R,) float64 scratch."""
    _forward_rows(logits, labels, ignore, has_ignore, losses, 0, logits.shape[0])
    return _mean(losses, labels, ignore, has_ignore)


@njit(**_OPTS, parallel=True)
def xent_forward_parallel(logits, labels, ignore, has_ignore, losses, workers):
    rows = logits.shape[0]
    for t in prange(workers):
        _forward_rows(logits, labels, ignore, has_ignore, losses, rows * t // workers, rows * (t + 1) // workers)
    return _mean(losses, labels, ignore, has_ignore)


@njit(**_OPTS)
def _backward_rows(logits, labels, ignore, has_ignore, scale, dlogits, lo, hi):
    """dlogits rows [lo, hi): (softmax - onehot(label)) * scale; zeros on an ignored row, NaN on a bad one."""
    k = logits.shape[1]
    for i in range(lo, hi):
        d = dlogits[i]
        lab = labels[i]
        if has_ignore and lab == ignore:
            d[:] = 0
            continue
        x = logits[i]
        m, bad = _row_max(x)
        if bad or lab < 0 or lab >= k:
            d[:] = np.nan
            continue
        _exp_shifted(x, m, d)
        inv = 1.0 / _sum(d)
        e_lab = float(d[lab])
        for j in range(k):
            d[j] = float(d[j]) * inv * scale
        d[lab] = (e_lab * inv - 1.0) * scale


@njit(**_OPTS)
def xent_backward(logits, labels, ignore, has_ignore, scale, dlogits):
    _backward_rows(logits, labels, ignore, has_ignore, scale, dlogits, 0, logits.shape[0])


@njit(**_OPTS, parallel=True)
def xent_backward_parallel(logits, labels, ignore, has_ignore, scale, dlogits, workers):
    rows = logits.shape[0]
    for t in prange(workers):
        _backward_rows(logits, labels, ignore, has_ignore, scale, dlogits, rows * t // workers,
                       rows * (t + 1) // workers)
