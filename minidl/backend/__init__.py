"""Array/kernel backends. `cpu` (numpy) is the reference; `cuda` (cupy + cuDNN frontend) imports lazily."""
from __future__ import annotations


def get_backend(name: str = "cpu"):
    """Return a backend instance by name. The CUDA backend is imported only when asked for."""
    if name == "cpu":
        from .cpu import CPUBackend

        return CPUBackend()
    if name == "cuda":
        from .cuda import CUDABackend  # noqa: WPS433 - deliberate lazy import: CUDA is optional

        return CUDABackend()
    raise ValueError(f"unknown backend {name!r}: expected 'cpu' or 'cuda'")
