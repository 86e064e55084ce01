"""Lazy access to the CPU backend's compiled (numba) kernel modules: `cpu.norm_jit`, `cpu.update_jit`,
`cpu.eltwise_jit`, `cpu.winograd_jit`, `cpu.rows_jit`, `cpu.pooling_jit`, `cpu.gemm_jit`; and how many threads those
kernels may use.

Why lazy: importing numba costs ~0.3 s (more with its first compilation), which a process that never runs a
compiled kernel (planning, the simulator, the CUDA backend) should not pay. Why optional: numba is a runtime
dependency, but where it cannot be imported (a stripped environment, a platform without wheels) every kernel
has a numpy twin that computes the same thing (bit-identically for the element-wise ones and the update; with
the same numerics for batch norm), so minidl keeps working, only slower.
"""
from __future__ import annotations

import importlib
from typing import Callable


def lazy(module: str) -> Callable[[], object | None]:
    """A function returning `minidl.backend.<module>` (imported on its first call), or None if numba cannot be
    imported. Tests replace the returned function (monkeypatch the module attribute that holds it) to run the
    numpy twins."""
    cached: list = []

    def kernels():
        if not cached:
            try:
                cached.append(importlib.import_module(f"{__package__}.{module}"))
            except ImportError:  # numba missing or broken: the numpy kernels do the same work, slower
                cached.append(None)
        return cached[0]
    kernels.__name__ = f"{module}_kernels"
    return kernels


gemm_kernels = lazy("gemm_jit")
PARALLEL_MIN = 1 << 16  # values below which a compiled kernel stays on one thread


def workers_for(values: int) -> int:
    """Threads for a compiled per-channel or elementwise kernel over `values` values (`cpu.gemm_jit.workers`):
    one below `PARALLEL_MIN`, where an OpenMP region (~3 us) and the other core's cache misses cost more than
    the split saves (CIFAR at batch 1: 16K values a layer)."""
    if values < PARALLEL_MIN:
        return 1
    g = gemm_kernels()
    return 1 if g is None else g.workers()
