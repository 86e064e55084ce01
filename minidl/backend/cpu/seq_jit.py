"""Exact GELU of the CPU backend compiled with numba, forward and backward.

Why compiled. The exact form needs erf, which numpy does not have (numba compiles `math.erf` to the C library's).
(The tanh form runs in numpy, `cpu_seq.SeqOps.gelu_forward`: numpy's vectorized tanh is far faster than a
compiled scalar loop.) Each kernel has a `_parallel` twin that cuts the flat array into one piece per worker:
elementwise, so the split changes no bits.

Formulas (PyTorch's `F.gelu`, `approximate='none'`): y = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2));
dy/dx = Phi(x) + x phi(x), phi(x) = exp(-x^2/2) / sqrt(2 pi). Each value is computed in float64 and rounded once to
the array's dtype. The arrays are flat (1-D) C-contiguous views of one dtype: the caller falls back to numpy for
anything else.
"""
from __future__ import annotations

import math

from numba import prange

from .jit_cache import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
_SQRT_HALF = 0.7071067811865476      # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327   # 1 / sqrt(2 pi)


@njit(**_OPTS)
def _forward(x, y, lo, hi):
    for i in range(lo, hi):
        a = float(x[i])
        y[i] = 0.5 * a * (1.0 + math.erf(a * _SQRT_HALF))


@njit(**_OPTS)
def _backward(x, dy, dx, lo, hi):
    for i in range(lo, hi):
        a = float(x[i])
        dx[i] = float(dy[i]) * (0.5 * (1.0 + math.erf(a * _SQRT_HALF)) + a * _INV_SQRT_2PI * math.exp(-0.5 * a * a))


@njit(**_OPTS)
def gelu_exact_forward(x, y):
    _forward(x, y, 0, x.size)


@njit(**_OPTS, parallel=True)
def gelu_exact_forward_parallel(x, y, workers):
    n = x.size
    for t in prange(workers):
        _forward(x, y, n * t // workers, n * (t + 1) // workers)


@njit(**_OPTS)
def gelu_exact_backward(x, dy, dx):
    _backward(x, dy, dx, 0, x.size)


@njit(**_OPTS, parallel=True)
def gelu_exact_backward_parallel(x, dy, dx, workers):
    n = x.size
    for t in prange(workers):
        _backward(x, dy, dx, n * t // workers, n * (t + 1) // workers)
