"""Array/kernel backends. `cpu` (numpy) is the reference; `cuda` (cupy + cuDNN frontend) imports lazily."""
from __future__ import annotations


def backend_name(backend) -> str:
    """The kind of `backend` ('cpu', 'cuda', ...), which names whose algorithm menu a plan was made from. None
    (the default everywhere) and a backend that declares no name are the CPU reference."""
    return getattr(backend, "name", "cpu") if backend is not None else "cpu"


def get_backend(name: str = "cpu", device: int = 0):
    """Return a backend instance by name. The CUDA backend is imported only when asked for; `device` is the GPU it
    runs on (data parallel: each rank its own)."""
    if name == "cpu":
        from .cpu import CPUBackend

        return CPUBackend()
    if name == "cuda":
        from .cuda import CUDABackend  # noqa: WPS433 - deliberate lazy import: CUDA is optional

        return CUDABackend(device=device)
    raise ValueError(f"unknown backend {name!r}: expected 'cpu' or 'cuda'")
