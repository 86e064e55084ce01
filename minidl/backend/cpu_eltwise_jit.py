"""ReLU of the CPU backend compiled with numba: forward and backward.

Why. numpy's `maximum` and the chunked `dy * (y > 0)` run at a few GB/s on this machine and cost a few us of
fixed overhead per call; one compiled loop per call is ~4x faster at batch 32 (a (32, 16, 32, 32) ReLU: forward
209 -> 53 us, backward 199 -> 73 us) and ~3-5x at batch 1 (7 -> 1.6 us), without the backward's boolean
temporary.

Bit-identical to the numpy kernels they replace (`CoreOps.relu_forward` etc., which remain as the fallback):
- relu forward: y = 0 if x <= 0 else x, numpy's `maximum(x, 0)` (x when x > 0 or x is NaN, so NaN propagates;
  +0.0 for -0.0);
- relu backward: dx = dy * (1 if y > 0 else 0), a product as numpy's (so a non-finite dy stays non-finite:
  inf * 0 = NaN reaches the divergence guard);
(numpy's two-input `add` is as fast as a compiled loop here, measured: it stays numpy.)
The arrays are flat (1-D) C-contiguous views: the caller falls back to numpy for anything else.
"""
from __future__ import annotations

from numba import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")


@njit(**_OPTS)
def relu_forward(x, y):
    z = x.dtype.type(0)
    for i in range(x.size):
        a = x[i]
        y[i] = z if a <= z else a


@njit(**_OPTS)
def relu_backward(y, dy, dx):
    z = y.dtype.type(0)
    one = y.dtype.type(1)
    for i in range(y.size):
        dx[i] = dy[i] * (one if y[i] > z else z)

