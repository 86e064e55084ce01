"""Fused optimizer updates of the CPU backend: a step's parameters that are C-contiguous views of one buffer, one
dtype per group, updated in one compiled call (`cpu.update_jit`); the others (all, without numba) one by one.
Both compute the same expression in the same order: bit-identical parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .jit import lazy, workers_for

jit_kernels = lazy("update_jit")  # None without numba


@dataclass(slots=True, eq=False)
class FusedParams:
    """Parameters of one dtype in `flat`: parameter k, its gradient and its state s start at p_off[k], g_off[k],
    slots[s][k], sizes[k] long."""

    flat: np.ndarray
    p_off: np.ndarray
    g_off: np.ndarray
    slots: dict[str, np.ndarray]
    sizes: np.ndarray

    @property
    def dtype(self) -> np.dtype:
        return self.flat.dtype

    @property
    def count(self) -> int:
        return int(self.sizes.size)

    def workers(self) -> int:
        """Threads for one update: each takes its share of every parameter."""
        return workers_for(int(self.sizes.sum()))


def _root(a: np.ndarray) -> np.ndarray:
    """The array that owns `a`'s memory."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _typed_buffer(root: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """`root`'s bytes as a 1-D array of `dtype` (None if that cannot be a view)."""
    if not root.flags.c_contiguous or root.ctypes.data % dtype.itemsize:
        return None
    raw = root.reshape(-1).view(np.uint8)
    return raw[:raw.size - raw.size % dtype.itemsize].view(dtype)


def _offset(flat: np.ndarray, a: np.ndarray) -> int | None:
    """The element offset of `a` in `flat` if `a` is exactly flat[off:off + a.size], else None."""
    if not a.flags.c_contiguous or a.dtype != flat.dtype:
        return None
    off, rem = divmod(a.ctypes.data - flat.ctypes.data, a.dtype.itemsize)
    if rem or off < 0 or off + a.size > flat.size:
        return None
    return off


class UpdateOps:
    """The fused optimizer kernels (mixed into CPUBackend)."""

    def fuse_update(self, items: list, slots: tuple[str, ...]) -> tuple[list[FusedParams], list]:
        """(fused groups, one per buffer and dtype; the items left to update one by one)."""
        if jit_kernels() is None:
            return [], list(items)
        groups: dict[tuple[int, np.dtype], tuple[np.ndarray, list]] = {}
        rest = []
        for p, g, state in items:
            arrays = [p, g, *(state[s] for s in slots)]
            root = _root(p) if isinstance(p, np.ndarray) else None
            key = (id(root), p.dtype) if root is not None else None
            if key is not None and key not in groups:
                flat = _typed_buffer(root, p.dtype)
                if flat is not None:
                    groups[key] = (flat, [])
            offs = None
            if key in groups:
                flat = groups[key][0]
                offs = [_offset(flat, a) if isinstance(a, np.ndarray) and _root(a) is root else None
                        for a in arrays]
            if offs is None or any(o is None for o in offs):
                rest.append((p, g, state))
                continue
            groups[key][1].append((*offs, p.size))
        fused = []
        for flat, rows in groups.values():
            if rows:
                cols = [np.array(c, dtype=np.int64) for c in zip(*rows)]
                fused.append(FusedParams(flat, cols[0], cols[1], {s: cols[2 + i] for i, s in enumerate(slots)},
                                         cols[-1]))
        return fused, rest

    def sgd_update_fused(self, fp: FusedParams, lr: float, momentum: float, dampening: float, weight_decay: float,
                         nesterov: bool, first_step: bool) -> None:
        """`sgd_update` on every parameter of `fp` in one call."""
        t = fp.flat.dtype.type
        bufs = fp.slots.get("momentum") if momentum else None
        args = (fp.flat, fp.p_off, fp.g_off, bufs, fp.sizes, t(lr), t(momentum), t(1 - dampening),
                t(weight_decay) if weight_decay else None, True if nesterov else None, bool(first_step))
        workers = fp.workers()
        if workers > 1:
            jit_kernels().sgd_parallel(*args, workers)
        else:
            jit_kernels().sgd(*args)

    def adam_update_fused(self, fp: FusedParams, lr: float, beta1: float, beta2: float, eps: float,
                          weight_decay: float, step: int) -> None:
        """`adam_update` on every parameter of `fp` in one call."""
        t = fp.flat.dtype.type
        bc1 = 1 - beta1 ** step
        bc2_sqrt = float(np.sqrt(1 - beta2 ** step))
        args = (fp.flat, fp.p_off, fp.g_off, fp.slots["exp_avg"], fp.slots["exp_avg_sq"], fp.sizes,
                t(lr / bc1), t(1 - beta1), t(beta2), t(1 - beta2), t(bc2_sqrt), t(eps),
                t(weight_decay) if weight_decay else None)
        workers = fp.workers()
        if workers > 1:
            jit_kernels().adam_parallel(*args, workers)
        else:
            jit_kernels().adam(*args)
