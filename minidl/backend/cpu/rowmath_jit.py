"""Float arithmetic the compiled CPU kernels share (`seq_jit`, `loss_jit`), in orders fixed by the inputs alone, no
fastmath: the bits depend neither on the thread count nor on the vector width. `_exp32` is Cephes' `expf` in
IEEE float32 operations: it vectorizes (~0.24 ns a value, C's expf ~3 ns), within 2 ulp on [-87.3, 0], 0 below.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ...core.jit_cache import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
_INF = math.inf
_LANES = 64  # partial sums per row: 8 float64 vectors of AVX-512 (16 of AVX2); 8 lanes did not vectorize


@njit(**_OPTS)
def _sum(a, acc):
    """The sum of the 1-D a in float64: lane l adds a[l], a[l + 64], ...; lanes l and l + w are added for w = 32, ...,
    1; then the tail. `acc`: `_LANES` float64 of scratch."""
    n = a.shape[0]
    whole = n - n % _LANES
    acc[:] = 0.0
    for j in range(0, whole, _LANES):
        for lane in range(_LANES):
            acc[lane] += a[j + lane]
    w = _LANES
    while w > 1:
        w //= 2
        for lane in range(w):
            acc[lane] = acc[lane] + acc[lane + w]
    s = acc[0]
    for j in range(whole, n):
        s += a[j]
    return s


# Cephes' expf: exp(a) = 2^n exp(r), n = round(a log2 e), r = a - n ln 2 (ln 2 in two parts)
_EXP_LO = np.float32(-87.33654)         # ~ln of float32's smallest normal
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)
_HALF, _ONE = np.float32(0.5), np.float32(1.0)


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bits are the int32 `bits`."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


def _flip(builder, bits, width: int):
    """bits ^ ((bits >> (width - 1)) & INT_MAX), its own inverse."""
    sign = builder.ashr(bits, ir.Constant(bits.type, width - 1))
    return builder.xor(bits, builder.and_(sign, ir.Constant(bits.type, (1 << (width - 1)) - 1)))


@intrinsic
def _order_key(typingctx, v):
    """An integer of v's width ordering as v; NaNs outside [key(-inf), key(+inf)]. Integer max vectorizes (float max
    does not without fastmath)."""
    width = v.bitwidth
    out = types.int32 if width == 32 else types.int64

    def codegen(context, builder, signature, args):
        return _flip(builder, builder.bitcast(args[0], ir.IntType(width)), width)
    return out(v), codegen


@intrinsic
def _from_order_key(typingctx, k, like):
    """The float of `like`'s type whose `_order_key` is k."""
    width = like.bitwidth
    ftype = ir.FloatType() if width == 32 else ir.DoubleType()

    def codegen(context, builder, signature, args):
        return builder.bitcast(_flip(builder, args[0], width), ftype)
    return like(k, like), codegen


@njit(**_OPTS)
def _exp32(a):
    """exp(a) for a float32 a <= 0; 0 below `_EXP_LO`, -inf and NaN included."""
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
def _tanh32(u):
    """tanh of a float32 from `_exp32(-2 |u|)`, a few ulps of 1; NaN gives +-1 (the GELU's x carries it)."""
    neg = u < np.float32(0.0)
    s = -u if neg else u
    t = _exp32(np.float32(-2.0) * s)
    r = (_ONE - t) / (_ONE + t)
    return -r if neg else r


@njit(**_OPTS)
def _row_max(x):
    """(max of the 1-D x, whether it holds a NaN or +inf), over `_order_key`s."""
    inf = x.dtype.type(_INF)
    hi = lo = _order_key(-inf)
    for j in range(x.shape[0]):
        k = _order_key(x[j])
        hi = max(hi, k)
        lo = min(lo, k)
    return _from_order_key(hi, inf), hi >= _order_key(inf) or lo < _order_key(-inf)


@njit(**_OPTS)
def _exp_shifted(x, m, e):
    """e = exp(x - m), x - m in x's dtype."""
    if x.itemsize == 4:
        for j in range(x.shape[0]):
            e[j] = _exp32(np.float32(x[j] - m))
    else:
        for j in range(x.shape[0]):
            e[j] = math.exp(x[j] - m)
