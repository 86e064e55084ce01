"""The optimizer update of many parameters in one compiled call (numba): SGD and Adam over lists of arrays.

Why. The compiled step used to call the optimizer once per parameter, and each numpy update is ~5 to 8 calls:
ResNet-20 (65 parameters) spent ~0.8 ms per step in ~400 numpy calls whose arithmetic takes a fraction of that.
Here one call updates every parameter of a group (`cpu.update.FusedParams`): the parameters, gradients and
state slots that live in one buffer (the arena), given as offsets into it. The tensors need not be adjacent,
so every policy's layout fuses the same way. (A numba typed list of arrays would need no common buffer, but
building one costs ~1 s of numba compilation per process.)

Bit-identical to `CoreOps.sgd_update` / `adam_update` (the per-parameter path the interpreted executor runs):
the same expression per element, evaluated in the parameter's dtype (every scalar is passed as that dtype, so
numba types each operation as numpy does), in the same order of operations, each operation rounded (no fastmath:
no reassociation, no FMA contraction); error_model="numpy" so a division by zero gives inf/nan as numpy does.
Elements are independent, so the order in which parameters and elements are visited does not matter.
Compiled lazily per dtype and flag combination, cached on disk (`cache=True`).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ...core.jit_cache import njit

_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")


@njit(**_OPTS)
def _part(n, t, workers):
    """Worker t's share [lo, hi) of a parameter's n elements (elements are independent: no bits move)."""
    return n * t // workers, n * (t + 1) // workers


@njit(**_OPTS)
def sgd(flat, p_off, g_off, b_off, sizes, lr, momentum, damp1, wd, nesterov, first_step):
    _sgd(flat, p_off, g_off, b_off, sizes, lr, momentum, damp1, wd, nesterov, first_step, 0, 1)


@njit(**_OPTS, parallel=True)
def sgd_parallel(flat, p_off, g_off, b_off, sizes, lr, momentum, damp1, wd, nesterov, first_step, workers):
    """`sgd` on `workers` threads, each on its share of every parameter."""
    for t in prange(workers):
        _sgd(flat, p_off, g_off, b_off, sizes, lr, momentum, damp1, wd, nesterov, first_step, t, workers)


@njit(**_OPTS)
def _sgd(flat, p_off, g_off, b_off, sizes, lr, momentum, damp1, wd, nesterov, first_step, t, workers):
    """torch.optim.SGD per element: d = g (+ wd * p); buf = d on the first step, else buf * momentum +
    (1 - dampening) * d; d = d + momentum * buf if nesterov else buf; p = p - lr * d. Parameter k is
    flat[p_off[k]:p_off[k] + sizes[k]], its gradient and momentum buffer likewise.

    The options tested per element are types, not values: `wd` None (no weight decay), `b_off` None (no
    momentum), `nesterov` None or True. numba prunes the branches on `is None` when it compiles, so each
    combination is its own branch-free loop, which LLVM vectorizes (6x faster than one loop testing the flags
    per element). `first_step` is a plain bool: it picks one of two loops per parameter, so the first and the
    later steps share one compilation (each costs ~0.6 s the first time on a machine)."""
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
        elif first_step:  # a runtime flag tested once per parameter, outside the element loop
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
    """`adam` on `workers` threads, each on its share of every parameter."""
    for t in prange(workers):
        _adam(flat, p_off, g_off, m_off, v_off, sizes, step_size, c1, beta2, c2, bc2_sqrt, eps, wd, t, workers)


@njit(**_OPTS)
def _adam(flat, p_off, g_off, m_off, v_off, sizes, step_size, c1, beta2, c2, bc2_sqrt, eps, wd, t, workers):
    """torch.optim.Adam per element: d = g (+ wd * p, `wd` None for none); m = m + (1 - beta1) * (d - m);
    v = v * beta2 + (1 - beta2) * d * d; p = p - step_size * (m / (sqrt(v) / sqrt(1 - beta2^t) + eps)).
    Offsets as `sgd`."""
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
