"""Softmax cross-entropy of the CPU backend compiled with numba: the loss over rows of logits and its gradient,
with or without an ignored label, in one pass over each row (plus one over the row in cache).

Why. A language model's loss reads (B*T, vocabulary) logits: GPT-2 small at batch 4 x 128 tokens has 25.7M of
them (103 MB of float32). The numpy kernels (`CoreOps.softmax_xent_*`, the fallback) made three tensor-sized
temporaries a call (x - max, its exp, a boolean mask) and ran on one thread: ~31 ms forward, ~28 ms backward
there. Here each row is read once from memory, its exponentials land in a per-thread row of scratch (forward)
or straight in the gradient (backward), and rows split over the threads: one thread's CPU time 32 -> 10 ms
forward, 28 -> 12 ms backward at that shape.

Rules (Note [cross-entropy on threads]):
- a row's max, sum and loss are computed by one thread, in an order fixed by the row's length alone
  (`rowmath_jit._sum`'s lanes); the mean over rows is summed in row order by one thread after the rows are
  done: so the bits never depend on the thread count;
- exp of a float32 value is `rowmath_jit._exp32` (plain IEEE float32 operations that vectorize: the same bits
  on any x86-64 CPU), called on x - max <= 0 only; float64 logits use `math.exp`;
- a row with a NaN or +inf logit, or a label outside [0, classes) that is not ignored, gets a NaN loss and NaN
  gradients (PyTorch's NaN, without reading outside the row): the divergence guard sees it.

Numerics: the loss of a row is log(sum) - (x[label] - max), in float64, the sum of the row's exponentials in
float64; the mean is the float64 sum of the rows' losses in order over the count, rounded once. The gradient
is (e * (1 / sum) - onehot) * scale, in float64, rounded once; scale = dloss / count (the caller's).
"""
from __future__ import annotations

import math

import numpy as np
from numba import prange

from ...core.jit_cache import njit
from .rowmath_jit import _LANES, _exp_shifted, _row_max, _sum

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
@njit(**_OPTS)
def _forward_rows(logits, labels, ignore, has_ignore, losses, lo, hi):
    """losses[i] for rows [lo, hi): log(sum exp(x - max)) - (x[label] - max), in float64; 0 for an ignored
    row; NaN for a row with a NaN or +inf logit or a label outside the row."""
    k = logits.shape[1]
    e, acc = np.empty(k, logits.dtype), np.empty(_LANES)  # one row of exponentials, the sum's lanes (scratch)
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
        losses[i] = math.log(_sum(e, acc)) - float(x[lab] - m)


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
    acc = np.empty(_LANES)  # the sum's lanes (scratch)
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
        inv = 1.0 / _sum(d, acc)
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
