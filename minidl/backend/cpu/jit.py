"""Lazy access to the CPU backend's compiled (numba) kernels: numba's import (~0.3 s) is paid only when one runs;
without numba each kernel's numpy twin computes the same thing, slower.
"""
from __future__ import annotations

import importlib
from typing import Callable


def lazy(module: str) -> Callable[[], object | None]:
    """A function returning `minidl.backend.cpu.<module>`, imported on first call, or None without numba (tests
    monkeypatch it to run the numpy twins)."""
    cached: list = []

    def kernels():
        if not cached:
            try:
                cached.append(importlib.import_module(f"{__package__}.{module}"))
            except ImportError:  # numba missing or broken
                cached.append(None)
        return cached[0]
    kernels.__name__ = f"{module}_kernels"
    return kernels


gemm_kernels = lazy("gemm_jit")
PARALLEL_MIN = 1 << 16  # values below which a compiled kernel stays on one thread


def workers_for(values: int) -> int:
    """Threads for a compiled kernel over `values` values: one below `PARALLEL_MIN`, where a region's cost exceeds its
    saving."""
    if values < PARALLEL_MIN:
        return 1
    g = gemm_kernels()
    return 1 if g is None else g.workers()
