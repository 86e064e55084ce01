"""SGD and Adam over a group of parameters in one compiled call (numba), as offsets into one buffer
(`cpu.update.FusedParams`; a numba typed list would need no buffer but costs ~1 s of compilation a process).
`CoreOps.sgd_update`'s and `adam_update`'s bits: the same expression in the parameter's dtype, in the same
order, no fastmath. Elements are independent: the thread split moves no bits.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ...core.jit_cache import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")


@njit(**_OPTS)
def _part(n, t, workers):
    """Worker t's share [lo, hi) of n elements."""
    return n * t // workers, n * (t + 1) // workers


@njit(**_OPTS)
def sgd(flat, p_off, g_off, b_off, sizes, lr, momentum, damp1, wd, nesterov, first_step):
    _sgd(flat, p_off, g_off, b_off, sizes, lr, momentum, damp1, wd, nesterov, first_step, 0, 1)


@njit(**_OPTS, parallel=True)
def sgd_parallel(flat, p_off, g_off, b_off, sizes, lr, momentum, damp1, wd, nesterov, first_step, workers):
    """`sgd` with every parameter split over `workers` threads."""
    for t in prange(workers):
        _sgd(flat, p_off, g_off, b_off, sizes, lr, momentum, damp1, wd, nesterov, first_step, t, workers)


@njit(**_OPTS)
def _sgd(flat, p_off, g_off, b_off, sizes, lr, momentum, damp1, wd, nesterov, first_step, t, workers):
    """torch.optim.SGD per element. Options are types (`wd`, `b_off`, `nesterov`: None or not), so numba compiles
    branch-free loops that vectorize (6x); `first_step` is a bool per parameter: one compilation for both."""
    for k in range(sizes.size):
        lo, hi = _part(sizes[k], t, workers)
        n = hi - lo
        p = flat[p_off[k] + lo:p_off[k] + hi]
        g = flat[g_off[k] + lo:g_off[k] + hi]
        if b_off is None:
            for i in range(n):
                d = g[i]
                if wd is not None:
                    d = d + wd * p[i]
                p[i] = p[i] - lr * d
        elif first_step:
            b = flat[b_off[k] + lo:b_off[k] + hi]
            for i in range(n):
                d = g[i]
                if wd is not None:
                    d = d + wd * p[i]
                b[i] = d
                if nesterov is not None:
                    d = d + momentum * d
                p[i] = p[i] - lr * d
        else:
            b = flat[b_off[k] + lo:b_off[k] + hi]
            for i in range(n):
                d = g[i]
                if wd is not None:
                    d = d + wd * p[i]
                bi = b[i] * momentum + damp1 * d
                b[i] = bi
                if nesterov is not None:
                    d = d + momentum * bi
                else:
                    d = bi
                p[i] = p[i] - lr * d


@njit(**_OPTS)
def adam(flat, p_off, g_off, m_off, v_off, sizes, step_size, c1, beta2, c2, bc2_sqrt, eps, wd):
    _adam(flat, p_off, g_off, m_off, v_off, sizes, step_size, c1, beta2, c2, bc2_sqrt, eps, wd, 0, 1)


@njit(**_OPTS, parallel=True)
def adam_parallel(flat, p_off, g_off, m_off, v_off, sizes, step_size, c1, beta2, c2, bc2_sqrt, eps, wd, workers):
    """`adam` with every parameter split over `workers` threads."""
    for t in prange(workers):
        _adam(flat, p_off, g_off, m_off, v_off, sizes, step_size, c1, beta2, c2, bc2_sqrt, eps, wd, t, workers)


@njit(**_OPTS)
def _adam(flat, p_off, g_off, m_off, v_off, sizes, step_size, c1, beta2, c2, bc2_sqrt, eps, wd, t, workers):
    """torch.optim.Adam per element; `wd` None for no weight decay."""
    for k in range(sizes.size):
        lo, hi = _part(sizes[k], t, workers)
        n = hi - lo
        p = flat[p_off[k] + lo:p_off[k] + hi]
        g = flat[g_off[k] + lo:g_off[k] + hi]
        m = flat[m_off[k] + lo:m_off[k] + hi]
        v = flat[v_off[k] + lo:v_off[k] + hi]
        for i in range(n):
            d = g[i]
            if wd is not None:
                d = d + wd * p[i]
            mi = m[i] + c1 * (d - m[i])
            m[i] = mi
            vi = v[i] * beta2
            vi = vi + c2 * d * d
            v[i] = vi
            denom = np.sqrt(vi) / bc2_sqrt + eps
            p[i] = p[i] - step_size * (mi / denom)
