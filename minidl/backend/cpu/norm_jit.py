"""Batch normalization of the CPU backend as compiled kernels (numba): one call per phase, not ~14 numpy calls.

Why compiled. Batch norm is a handful of per-channel passes over (N, H*W). In numpy each pass is one call per
block, and at batch 1 (CIFAR ResNet-20: 16 to 64 channels of 8x8 to 32x32) a call's fixed cost (~1-5 us) is
larger than its arithmetic: ~250 us per layer forward + backward, 4x PyTorch. Here each phase (training forward,
apply, eval forward, backward, eval backward) is one call that loops channel by channel over (N, H*W).

Numerics: those of `cpu.norm` (corrected two-pass statistics, mean subtracted first in the applying passes), with
every sum and every elementwise expression evaluated in float64 and rounded once to the stored dtype:
- pass 1: mean = K + sum(x - K) / M, K = the channel's first value (a rough shift: any value of the order of
  the data keeps the sum's terms of the order of the spread). The mean is stored rounded to the dtype.
- pass 2: with d = x - mean (as stored; exact in float64 for float32 data), var = S2/M - (S1/M)^2: S1/M is a
  rounding error of the stored mean, so the subtraction cancels nothing (Chan, Golub & LeVeque 1983).
- applying: y = (x - mean) * (invstd * weight) + bias, dx = dy * s + (x - mean) * kx + c, mean subtracted first.
Deterministic: the loop order is fixed by the code (channels, then samples, then the plane), every sum uses
L = min(H*W, 64) accumulators whose assignment (element i of a plane to accumulator i mod L) and final
combination are fixed, and nothing is compiled with fastmath (no reassociation, no contraction into FMAs).
Recomputation calls `apply` with the saved statistics, the very function the training forward ends with: bit
for bit the same y. (Why lanes: without fastmath LLVM keeps a chain of scalar accumulators scalar, ~0.5 ns per
element, slower than numpy's BLAS dot at batch 32; a loop over a runtime number of lanes it vectorizes.)

Measured (1 thread, 2-core VM, 2026-11-23), one layer forward-train + backward: (1, 16, 32, 32) 130 -> 20 us,
(32, 16, 32, 32) 1140 -> 540 us; in `benchmarks/step_vs_torch.py`, batch norm of ResNet-20 b1 3.2 -> 0.8 ms per
step and of ResNet-56 b32 63 -> 37 ms (PyTorch: 0.8 and 58 ms).

Optional arrays (weight, bias, dx, dweight, dbias) are passed as flags with a stand-in array of the same type
(`cpu.norm` does it), not as None, so an affine and a non-affine layer share one compilation: each specialization
costs ~0.6 s the first time on a machine. Compiled lazily, per dtype, on first use; `cache=True` keeps
the machine code on disk (numba's cache, in the user cache folder `core.jit_cache` picks), so only the first
process on a machine pays the compilation. This module imports numba at import time: `cpu.norm` imports it on
first use only.
"""
from __future__ import annotations

import math

import numpy as np
from numba import prange

from ...core.jit_cache import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")


_LANES = 64  # accumulators per sum: a plane is read as rows of this many values, summed column by column


@njit(inline="always", **_OPTS)
def _lane_count(hw):
    return min(hw, _LANES)


@njit(inline="always", **_OPTS)
def _sums(x3, c, k, a, q):
    """Per channel c, in float64: (sum(x - k), sum((x - k)^2)) over every sample and plane element.

    Element i of a plane goes to accumulator i mod L (L = `_lane_count`, a runtime value so that LLVM
    vectorizes the loop over lanes, which it does not for a chain of scalar accumulators without fastmath); the
    lanes are then added in order. Which value meets which is fixed by the code, so the result is too."""
    n, _, hw = x3.shape
    lanes = _lane_count(hw)
    rows = hw // lanes
    tail = hw - rows * lanes
    for j in range(lanes):
        a[j] = 0.0
        q[j] = 0.0
    for s in range(n):
        p = x3[s, c]
        for r in range(rows):
            b = r * lanes
            for j in range(lanes):
                d = np.float64(p[b + j]) - k
                a[j] += d
                q[j] += d * d
        b = rows * lanes
        for j in range(tail):
            d = np.float64(p[b + j]) - k
            a[j] += d
            q[j] += d * d
    s1 = 0.0
    s2 = 0.0
    for j in range(lanes):
        s1 += a[j]
        s2 += q[j]
    return s1, s2


@njit(inline="always", **_OPTS)
def _dsums(x3, c, g3, cg, k, a, q):
    """Per channel c, in float64: (sum(dy), sum(dy * (x - k))), dy being channel cg of g3 (the output gradient,
    or a channel's scratch holding it), with the lanes of `_sums`."""
    n, _, hw = x3.shape
    lanes = _lane_count(hw)
    rows = hw // lanes
    tail = hw - rows * lanes
    for j in range(lanes):
        a[j] = 0.0
        q[j] = 0.0
    for s in range(n):
        p = x3[s, c]
        g = g3[s, cg]
        for r in range(rows):
            b = r * lanes
            for j in range(lanes):
                gj = np.float64(g[b + j])
                a[j] += gj
                q[j] += gj * (np.float64(p[b + j]) - k)
        b = rows * lanes
        for j in range(tail):
            gj = np.float64(g[b + j])
            a[j] += gj
            q[j] += gj * (np.float64(p[b + j]) - k)
    s1 = 0.0
    s2 = 0.0
    for j in range(lanes):
        s1 += a[j]
        s2 += q[j]
    return s1, s2


@njit(inline="always", **_OPTS)
def _affine(x3, y3, z3, c, m, a, weight, bias, has_w, has_b, has_z, keep_y, ybuf):
    """y = (x - m) * (a * weight[c]) + bias[c] over channel c of every sample, in float64, rounded once (the mean
    subtracted first; weight/bias read only if has_w/has_b). With has_z, also z = ReLU(y) of the rounded y, as
    `cpu.eltwise_jit.relu_forward` computes it (0 where y <= 0, else y; NaN stays NaN): the fused BN+ReLU of the
    compiled step (`minidl.runtime.program`), which saves the ReLU's pass over y from memory; and without keep_y, y's
    planes go to ybuf (one plane's scratch, in cache), not to y3, which nothing reads then."""
    if has_w:
        a = a * np.float64(weight[c])
    b = 0.0
    if has_b:
        b = np.float64(bias[c])
    n, _, hw = x3.shape
    zero = y3.dtype.type(0)
    for s in range(n):
        p = x3[s, c]
        q = y3[s, c] if keep_y else ybuf
        for i in range(hw):
            q[i] = (np.float64(p[i]) - m) * a + b
        if has_z:  # from the stored y, a plane at a time (it is in cache); z may be exactly x (see program)
            r = z3[s, c]
            for i in range(hw):
                v = q[i]
                r[i] = zero if v <= zero else v


@njit(**_OPTS)
def _apply_channels(x3, weight, bias, mean, invstd, y3, z3, has_w, has_b, has_z, keep_y, c0, c1):
    ybuf = np.empty(0 if keep_y else x3.shape[2], y3.dtype)
    for c in range(c0, c1):
        m = np.float64(mean[c])
        a = np.float64(invstd[c])
        _affine(x3, y3, z3, c, m, a, weight, bias, has_w, has_b, has_z, keep_y, ybuf)


@njit(**_OPTS)
def apply(x3, weight, bias, mean, invstd, y3, has_w, has_b):
    """y = (x - mean) * (invstd * weight) + bias per channel, in float64, rounded once (weight/bias read only
    if has_w/has_b)."""
    _apply_channels(x3, weight, bias, mean, invstd, y3, y3, has_w, has_b, False, True, 0, x3.shape[1])


@njit(parallel=True, **_OPTS)
def apply_parallel(x3, weight, bias, mean, invstd, y3, has_w, has_b, workers):
    """`apply` with the channels split over `workers` threads (one OpenMP region; see `cpu.gemm_jit`)."""
    nc = x3.shape[1]
    for w in prange(workers):
        _apply_channels(x3, weight, bias, mean, invstd, y3, y3, has_w, has_b, False, True, nc * w // workers,
                        nc * (w + 1) // workers)


@njit(**_OPTS)
def _train_channels(x3, weight, bias, running_mean, running_var, y3, mean, invstd, momentum, eps, update_running,
                    has_w, has_b, z3, has_z, keep_y, c0, c1):
    n, nc, hw = x3.shape
    m = n * hw
    la, lq = np.empty(_lane_count(hw)), np.empty(_lane_count(hw))
    for c in range(c0, c1):
        k = np.float64(x3[0, c, 0])
        s1, _ = _sums(x3, c, k, la, lq)
        mean[c] = k + s1 / m
        mc = np.float64(mean[c])
        d1, d2 = _sums(x3, c, mc, la, lq)
        dmean = d1 / m
        var = max(d2 / m - dmean * dmean, 0.0)
        invstd[c] = 1.0 / math.sqrt(var + eps)
        if update_running:
            running_mean[c] = (1.0 - momentum) * np.float64(running_mean[c]) + momentum * (mc + dmean)
            running_var[c] = (1.0 - momentum) * np.float64(running_var[c]) + momentum * var * (m / (m - 1))
    _apply_channels(x3, weight, bias, mean, invstd, y3, z3, has_w, has_b, has_z, keep_y, c0, c1)


@njit(**_OPTS)
def train(x3, weight, bias, running_mean, running_var, y3, mean, invstd, momentum, eps, update_running, has_w,
          has_b, z3, has_z, keep_y):
    """Batch statistics (two passes, see the module docstring), saved in mean/invstd, folded into the running
    statistics if `update_running` (the variance unbiased, as PyTorch), then `apply`; with has_z, z3 = ReLU(y)
    in the same pass (see `_affine`; z3 a stand-in otherwise), y3 left unwritten unless keep_y."""
    _train_channels(x3, weight, bias, running_mean, running_var, y3, mean, invstd, momentum, eps, update_running,
                    has_w, has_b, z3, has_z, keep_y, 0, x3.shape[1])


@njit(parallel=True, **_OPTS)
def train_parallel(x3, weight, bias, running_mean, running_var, y3, mean, invstd, momentum, eps, update_running,
                   has_w, has_b, z3, has_z, keep_y, workers):
    """`train` with the channels split over `workers` threads: each channel computed as on one thread."""
    nc = x3.shape[1]
    for w in prange(workers):
        _train_channels(x3, weight, bias, running_mean, running_var, y3, mean, invstd, momentum, eps,
                        update_running, has_w, has_b, z3, has_z, keep_y, nc * w // workers, nc * (w + 1) // workers)


@njit(**_OPTS)
def eval_forward(x3, weight, bias, running_mean, running_var, eps, y3, has_w, has_b):
    """y with the running statistics: the affine map of `apply`, invstd = 1/sqrt(running_var + eps) in float64."""
    ybuf = np.empty(0, y3.dtype)
    for c in range(x3.shape[1]):
        m = np.float64(running_mean[c])
        a = 1.0 / math.sqrt(np.float64(running_var[c]) + eps)
        _affine(x3, y3, y3, c, m, a, weight, bias, has_w, has_b, False, True, ybuf)


@njit(inline="always", **_OPTS)
def _backward_channel(x3, weight, g3, cg, mean, invstd, dx3, dweight, dbias, has_w, has_dx, has_dw, has_db, c, la,
                      lq):
    """Channel c's gradients from its output gradient, channel cg of g3."""
    n, _, hw = x3.shape
    m = n * hw
    mc = np.float64(mean[c])
    inv = np.float64(invstd[c])
    sdy, sdyd = _dsums(x3, c, g3, cg, mc, la, lq)
    if has_db:
        dbias[c] = sdy
    if has_dw:
        dweight[c] = sdyd * inv
    if has_dx:
        sc = inv
        if has_w:
            sc = inv * np.float64(weight[c])
        kx = -sc * (inv * inv * sdyd / m)
        c0_ = -sc * (sdy / m)
        for s in range(n):
            p = x3[s, c]
            g = g3[s, cg]
            q = dx3[s, c]
            for i in range(hw):
                q[i] = np.float64(g[i]) * sc + (np.float64(p[i]) - mc) * kx + c0_


@njit(**_OPTS)
def _backward_channels(x3, weight, dy3, mean, invstd, dx3, dweight, dbias, has_w, has_dx, has_dw, has_db, dz3, r3,
                       has_relu, c0, c1):
    n, nc, hw = x3.shape
    la, lq = np.empty(_lane_count(hw)), np.empty(_lane_count(hw))
    zero, one = dy3.dtype.type(0), dy3.dtype.type(1)
    gbuf = np.empty((n if has_relu else 0, 1, hw), dy3.dtype)
    for c in range(c0, c1):
        if has_relu:  # the ReLU's backward for this channel first (as `relu_backward`), into a channel scratch
            for s in range(n):  # that stays in cache (dy itself is not written: only this batch norm reads it)
                g, d, r = gbuf[s, 0], dz3[s, c], r3[s, c]
                for i in range(hw):
                    g[i] = d[i] * (one if r[i] > zero else zero)
            _backward_channel(x3, weight, gbuf, 0, mean, invstd, dx3, dweight, dbias, has_w, has_dx, has_dw,
                              has_db, c, la, lq)
        else:
            _backward_channel(x3, weight, dy3, c, mean, invstd, dx3, dweight, dbias, has_w, has_dx, has_dw,
                              has_db, c, la, lq)


@njit(**_OPTS)
def backward(x3, weight, dy3, mean, invstd, dx3, dweight, dbias, has_w, has_dx, has_dw, has_db, dz3, r3, has_relu):
    """Through batch statistics: dbias = sum(dy), dweight = sum(dy * xhat), and
    dx = dy * s + (x - mean) * kx + c with s = invstd * weight, kx = -s * invstd^2 * sum(dy (x - mean)) / M,
    c = -s * sum(dy) / M (the mean subtracted first). With has_relu, dy is first computed channel by channel as
    the backward of a ReLU that follows the batch norm (dy = dz where r > 0, r the ReLU's output), into a scratch
    of one channel (dy3 itself is left unwritten): the compiled step's fused BN+ReLU backward
    (`minidl.runtime.program`); dz3, r3 are stand-ins otherwise."""
    _backward_channels(x3, weight, dy3, mean, invstd, dx3, dweight, dbias, has_w, has_dx, has_dw, has_db, dz3, r3,
                       has_relu, 0, x3.shape[1])


@njit(parallel=True, **_OPTS)
def backward_parallel(x3, weight, dy3, mean, invstd, dx3, dweight, dbias, has_w, has_dx, has_dw, has_db, dz3, r3,
                      has_relu, workers):
    """`backward` with the channels split over `workers` threads: each channel computed as on one thread."""
    nc = x3.shape[1]
    for w in prange(workers):
        _backward_channels(x3, weight, dy3, mean, invstd, dx3, dweight, dbias, has_w, has_dx, has_dw, has_db, dz3,
                           r3, has_relu, nc * w // workers, nc * (w + 1) // workers)


@njit(**_OPTS)
def backward_eval(x3, weight, dy3, running_mean, running_var, eps, dx3, dweight, dbias, has_w, has_dx, has_dw,
                  has_db):
    """With fixed (running) statistics, a per-channel affine map: dx = dy * weight * invstd; the parameter
    gradients as in `backward`, centred on the running mean."""
    n, nc, hw = x3.shape
    la, lq = np.empty(_lane_count(hw)), np.empty(_lane_count(hw))
    for c in range(nc):
        inv = 1.0 / math.sqrt(np.float64(running_var[c]) + eps)
        if has_dw or has_db:
            sdy, sdyd = _dsums(x3, c, dy3, c, np.float64(running_mean[c]), la, lq)
            if has_db:
                dbias[c] = sdy
            if has_dw:
                dweight[c] = sdyd * inv
        if has_dx:
            sc = inv
            if has_w:
                sc = inv * np.float64(weight[c])
            for s in range(n):
                g = dy3[s, c]
                q = dx3[s, c]
                for i in range(hw):
                    q[i] = np.float64(g[i]) * sc
