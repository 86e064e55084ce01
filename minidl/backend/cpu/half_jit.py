"""Half-precision conversions compiled with numba, as uint16 bits: bf16/fp16 to float32 (exact) and back, rounded
to nearest even (a GPU's `__float2bfloat16_rn`, `__float2half_rn`), ~0.1 ns a value (numpy's float16: 6-10).
The bits of numpy's and ml_dtypes' casts (tests/backend/test_half_cast.py); a NaN stays quiet, its sign kept.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import float32, prange, types, uint16, uint32, uint64
from numba.extending import intrinsic

from ...core.jit_cache import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
_PIECE = 4096  # worker pieces start on multiples of this (16 KiB of float32)


@intrinsic
def as_f32(typingctx, x):
    """The float32 whose bits are the uint32 `x`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def as_u32(typingctx, x):
    """The bits of the float32 `x`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def bf16_bits(typingctx, f):
    """float32 -> bfloat16 bits, ties to even; NaN -> a quiet NaN (bit 6 of its top half set). Written in 32-bit IR:
    numba's uint32 arithmetic widens to 64-bit lanes, half as many a vector (add_relu on 512K values: 2x slower)."""
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        u = builder.bitcast(args[0], i32)
        top = builder.lshr(u, ir.Constant(i32, 16))
        lsb = builder.and_(top, ir.Constant(i32, 1))
        r = builder.lshr(builder.add(builder.add(u, ir.Constant(i32, 0x7FFF)), lsb), ir.Constant(i32, 16))  # no wrap
        nan = builder.icmp_unsigned(">", builder.and_(u, ir.Constant(i32, 0x7FFFFFFF)), ir.Constant(i32, 0x7F800000))
        return builder.trunc(builder.select(nan, builder.or_(top, ir.Constant(i32, 0x40)), r), ir.IntType(16))
    return types.uint16(types.float32), codegen


@njit(**_OPTS)
def bf16_value(h):
    return as_f32(uint32(h) << uint32(16))


@njit(**_OPTS)
def f16_bits(f):
    """float32 -> float16 bits, ties to even; subnormals rounded by adding the magic 0.5."""
    u = as_u32(f)
    sign = u & uint32(0x80000000)
    a = u ^ sign
    nan = uint32(0x7E00) | ((a >> uint32(13)) & uint32(0x3FF))
    big = nan if a > uint32(0x7F800000) else uint32(0x7C00)
    sub = as_u32(as_f32(a) + float32(0.5)) - uint32(0x3F000000)
    nrm = (a + uint32(0xC8000FFF) + ((a >> uint32(13)) & uint32(1))) >> uint32(13)
    o = big if a >= uint32(0x47800000) else (sub if a < uint32(0x38800000) else nrm)
    return uint16(o | (sign >> uint32(16)))


@njit(**_OPTS)
def f16_value(h):
    """float16 bits -> float32: subnormals renormalized by subtracting 2^-14."""
    v = uint32(h)
    o = (v & uint32(0x7FFF)) << uint32(13)
    e = o & uint32(0x0F800000)
    o += uint32(112 << 23)
    inf = o + uint32(112 << 23)
    sub = as_u32(as_f32(o + uint32(1 << 23)) - float32(6.103515625e-05))
    o = inf if e == uint32(0x0F800000) else (sub if e == uint32(0) else o)
    return as_f32(o | ((v & uint32(0x8000)) << uint32(16)))


@njit(**_OPTS)
def _cut(n, t, workers):
    return n if t == workers else (n * t // workers) // _PIECE * _PIECE


@njit(**_OPTS)
def _widen(h, f, bf, lo, hi):
    for i in range(uint64(lo), uint64(hi)):
        f[i] = bf16_value(h[i]) if bf else f16_value(h[i])


@njit(**_OPTS)
def _narrow(f, h, bf, lo, hi):
    for i in range(uint64(lo), uint64(hi)):
        h[i] = bf16_bits(f[i]) if bf else f16_bits(f[i])


@njit(**_OPTS)
def _quantize(f, bf, lo, hi):
    for i in range(uint64(lo), uint64(hi)):
        f[i] = bf16_value(bf16_bits(f[i])) if bf else f16_value(f16_bits(f[i]))


@njit(**_OPTS)
def widen(h, f, bf):
    """f = the float32 values of the half bits h (bf: bfloat16, else float16)."""
    _widen(h, f, bf, 0, h.size)


@njit(**_OPTS)
def narrow(f, h, bf):
    """h = the half bits of the float32 values f, rounded to nearest even."""
    _narrow(f, h, bf, 0, f.size)


@njit(**_OPTS)
def quantize(f, bf):
    """f rounded in place to the nearest half value (kept in float32)."""
    _quantize(f, bf, 0, f.size)


@njit(**_OPTS)
def widen_nd(h, f, bf):
    """`widen` over 4-D arrays of any strides."""
    for a in range(h.shape[0]):
        for b in range(h.shape[1]):
            for c in range(h.shape[2]):
                for d in range(h.shape[3]):
                    f[a, b, c, d] = bf16_value(h[a, b, c, d]) if bf else f16_value(h[a, b, c, d])


@njit(**_OPTS)
def narrow_nd(f, h, bf):
    """`narrow` over 4-D arrays of any strides."""
    for a in range(f.shape[0]):
        for b in range(f.shape[1]):
            for c in range(f.shape[2]):
                for d in range(f.shape[3]):
                    h[a, b, c, d] = bf16_bits(f[a, b, c, d]) if bf else f16_bits(f[a, b, c, d])


# Elementwise kernels on half bits: `eltwise_jit`'s float32 operations, each rounded once (the staged values).
@njit(**_OPTS)
def _value(h, bf):
    return bf16_value(h) if bf else f16_value(h)


@njit(**_OPTS)
def _store(f, bf):
    return bf16_bits(f) if bf else f16_bits(f)


# Each computes a block's float32 results into a local buffer, then stores them: an output may be exactly an input
# (the compiled step's placements), and a loop reading and writing overlapping arrays is not vectorized (LLVM's
# runtime alias check fails: add_relu in place 0.69 ms against 0.11 on (32, 16, 32, 32), one thread). `_k` runs
# `_k_blocks` inlined with `bf` a constant: a conversion chosen in the loop costs 1.4-1.6x.
@njit(inline="always", **_OPTS)
def _relu_forward_blocks(x, y, bf, lo, hi):
    z = float32(0)
    t = np.empty(_PIECE, np.float32)
    for s in range(lo, hi, _PIECE):
        b, m = uint64(s), uint64(min(hi, s + _PIECE) - s)
        for i in range(m):
            a = _value(x[b + i], bf)
            t[i] = z if a <= z else a
        for i in range(m):
            y[b + i] = _store(t[i], bf)


@njit(**_OPTS)
def _relu_forward(x, y, bf, lo, hi):
    if bf:
        _relu_forward_blocks(x, y, True, lo, hi)
    else:
        _relu_forward_blocks(x, y, False, lo, hi)


@njit(inline="always", **_OPTS)
def _relu_backward_blocks(y, dy, dx, bf, lo, hi):
    z, one = float32(0), float32(1)
    t = np.empty(_PIECE, np.float32)
    for s in range(lo, hi, _PIECE):
        b, m = uint64(s), uint64(min(hi, s + _PIECE) - s)
        for i in range(m):
            t[i] = _value(dy[b + i], bf) * (one if _value(y[b + i], bf) > z else z)
        for i in range(m):
            dx[b + i] = _store(t[i], bf)


@njit(**_OPTS)
def _relu_backward(y, dy, dx, bf, lo, hi):
    if bf:
        _relu_backward_blocks(y, dy, dx, True, lo, hi)
    else:
        _relu_backward_blocks(y, dy, dx, False, lo, hi)


@njit(inline="always", **_OPTS)
def _add_relu_blocks(a, b, y, r, keep_y, relu, bf, lo, hi):
    z = float32(0)
    t = np.empty(_PIECE, np.float32)
    for s in range(lo, hi, _PIECE):
        o, m = uint64(s), uint64(min(hi, s + _PIECE) - s)
        for i in range(m):
            t[i] = _value(a[o + i], bf) + _value(b[o + i], bf)
        if keep_y:
            for i in range(m):
                y[o + i] = _store(t[i], bf)
        if relu:
            for i in range(m):
                v = t[i]
                r[o + i] = _store(z if v <= z else v, bf)


@njit(**_OPTS)
def _add_relu(a, b, y, r, keep_y, relu, bf, lo, hi):
    if bf:
        _add_relu_blocks(a, b, y, r, keep_y, relu, True, lo, hi)
    else:
        _add_relu_blocks(a, b, y, r, keep_y, relu, False, lo, hi)


@njit(inline="always", **_OPTS)
def _relu_backward_add_blocks(y, dy, d1, d2, bf, lo, hi):
    z, one = float32(0), float32(1)
    t = np.empty(_PIECE, np.uint16)
    for s in range(lo, hi, _PIECE):
        b, m = uint64(s), uint64(min(hi, s + _PIECE) - s)
        for i in range(m):
            t[i] = _store(_value(dy[b + i], bf) * (one if _value(y[b + i], bf) > z else z), bf)
        for i in range(m):
            d1[b + i] = t[i]
            d2[b + i] = t[i]


@njit(**_OPTS)
def _relu_backward_add(y, dy, d1, d2, bf, lo, hi):
    if bf:
        _relu_backward_add_blocks(y, dy, d1, d2, True, lo, hi)
    else:
        _relu_backward_add_blocks(y, dy, d1, d2, False, lo, hi)


@njit(inline="always", **_OPTS)
def _add_into_blocks(a, b, bf, lo, hi):
    t = np.empty(_PIECE, np.float32)
    for s in range(lo, hi, _PIECE):
        o, m = uint64(s), uint64(min(hi, s + _PIECE) - s)
        for i in range(m):
            t[i] = _value(a[o + i], bf) + _value(b[o + i], bf)
        for i in range(m):
            a[o + i] = _store(t[i], bf)


@njit(**_OPTS)
def _add_into(a, b, bf, lo, hi):
    if bf:
        _add_into_blocks(a, b, True, lo, hi)
    else:
        _add_into_blocks(a, b, False, lo, hi)


@njit(**_OPTS)
def relu_forward(x, y, bf):
    _relu_forward(x, y, bf, 0, x.size)


@njit(**_OPTS, parallel=True)
def relu_forward_parallel(x, y, bf, workers):
    for t in prange(workers):
        _relu_forward(x, y, bf, _cut(x.size, t, workers), _cut(x.size, t + 1, workers))


@njit(**_OPTS)
def relu_backward(y, dy, dx, bf):
    _relu_backward(y, dy, dx, bf, 0, y.size)


@njit(**_OPTS, parallel=True)
def relu_backward_parallel(y, dy, dx, bf, workers):
    for t in prange(workers):
        _relu_backward(y, dy, dx, bf, _cut(y.size, t, workers), _cut(y.size, t + 1, workers))


@njit(**_OPTS)
def add_relu(a, b, y, r, keep_y, relu, bf):
    """y = a + b (with `keep_y`) and r = ReLU(a + b) (with `relu`)."""
    _add_relu(a, b, y, r, keep_y, relu, bf, 0, a.size)


@njit(**_OPTS, parallel=True)
def add_relu_parallel(a, b, y, r, keep_y, relu, bf, workers):
    for t in prange(workers):
        _add_relu(a, b, y, r, keep_y, relu, bf, _cut(a.size, t, workers), _cut(a.size, t + 1, workers))


@njit(**_OPTS)
def relu_backward_add(y, dy, d1, d2, bf):
    _relu_backward_add(y, dy, d1, d2, bf, 0, y.size)


@njit(**_OPTS, parallel=True)
def relu_backward_add_parallel(y, dy, d1, d2, bf, workers):
    for t in prange(workers):
        _relu_backward_add(y, dy, d1, d2, bf, _cut(y.size, t, workers), _cut(y.size, t + 1, workers))


@njit(**_OPTS)
def add_into(a, b, bf):
    _add_into(a, b, bf, 0, a.size)


@njit(**_OPTS, parallel=True)
def add_into_parallel(a, b, bf, workers):
    for t in prange(workers):
        _add_into(a, b, bf, _cut(a.size, t, workers), _cut(a.size, t + 1, workers))
