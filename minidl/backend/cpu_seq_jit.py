"""GELU of the CPU backend compiled with numba, both forms, forward and backward.

Why compiled. The exact form needs erf, which numpy does not have (numba compiles `math.erf` to the C library's);
and the tanh form is ~8 numpy passes over the tensor, each with a tensor-sized temporary, where one loop reads x
once and writes y once. Each kernel has a `_parallel` twin that cuts the flat array into one piece per worker:
elementwise, so the split changes no bits.

Formulas (PyTorch's `F.gelu`, `approximate='none'` and `'tanh'`):
- exact: y = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)); dy/dx = Phi(x) + x phi(x), phi(x) = exp(-x^2/2) / sqrt(2 pi);
- tanh: y = 0.5 x (1 + t), t = tanh(sqrt(2/pi) (x + 0.044715 x^3));
  dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
Each value is computed in float64 and rounded once to the array's dtype.
The arrays are flat (1-D) C-contiguous views of one dtype: the caller falls back to numpy for anything else.
"""
from __future__ import annotations

import math

from numba import prange

from .cpu_jit_cache import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
_SQRT_HALF = 0.7071067811865476      # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327   # 1 / sqrt(2 pi)
_SQRT_2_OVER_PI = 0.7978845608028654  # sqrt(2 / pi)
_TANH_CUBIC = 0.044715


@njit(**_OPTS)
def _value(a, tanh_form):
    if tanh_form:
        return 0.5 * a * (1.0 + math.tanh(_SQRT_2_OVER_PI * (a + _TANH_CUBIC * a * a * a)))
    return 0.5 * a * (1.0 + math.erf(a * _SQRT_HALF))


@njit(**_OPTS)
def _slope(a, tanh_form):
    if tanh_form:
        t = math.tanh(_SQRT_2_OVER_PI * (a + _TANH_CUBIC * a * a * a))
        return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * a * a)
    return 0.5 * (1.0 + math.erf(a * _SQRT_HALF)) + a * _INV_SQRT_2PI * math.exp(-0.5 * a * a)


@njit(**_OPTS)
def _forward(x, y, tanh_form, lo, hi):
    for i in range(lo, hi):
        y[i] = _value(float(x[i]), tanh_form)


@njit(**_OPTS)
def _backward(x, dy, dx, tanh_form, lo, hi):
    for i in range(lo, hi):
        dx[i] = float(dy[i]) * _slope(float(x[i]), tanh_form)


@njit(**_OPTS)
def gelu_forward(x, y, tanh_form):
    _forward(x, y, tanh_form, 0, x.size)


@njit(**_OPTS, parallel=True)
def gelu_forward_parallel(x, y, tanh_form, workers):
    n = x.size
    for t in prange(workers):
        _forward(x, y, tanh_form, n * t // workers, n * (t + 1) // workers)


@njit(**_OPTS)
def gelu_backward(x, dy, dx, tanh_form):
    _backward(x, dy, dx, tanh_form, 0, x.size)


@njit(**_OPTS, parallel=True)
def gelu_backward_parallel(x, dy, dx, tanh_form, workers):
    n = x.size
    for t in prange(workers):
        _backward(x, dy, dx, tanh_form, n * t // workers, n * (t + 1) // workers)
