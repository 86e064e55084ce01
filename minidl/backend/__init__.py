"""Array/kernel backends. `cpu` (numpy) is the reference; `cuda` (cupy + cuDNN frontend) imports lazily."""
from __future__ import annotations

from ..core.errors import OptionError


def backend_name(backend) -> str:
    """The kind of `backend` ('cpu', 'cuda', ...), which names whose algorithm menu a plan was made from. None
    (the default everywhere) and a backend that declares no name are the CPU reference."""
    return getattr(backend, "name", "cpu") if backend is not None else "cpu"


def get_backend(name: str = "cpu", device: int = 0, math: str | None = None):
    """Return a backend instance by name. The CUDA backend is imported only when asked for; `device` is the GPU it
    runs on (data parallel: each rank its own); `math` its math mode (`mathmode.py`; None: fp32)."""
    from .mathmode import apply_math

    if name == "cpu":
        from .cpu.backend import CPUBackend

        backend = CPUBackend()
        apply_math(backend, math)  # the CPU computes in fp32 only: tf32 is refused, naming --math
        return backend
    if name == "cuda":
        from .cuda.backend import CUDABackend  # noqa: WPS433 - deliberate lazy import: CUDA is optional
        from .mathmode import check_math

        return CUDABackend(device=device, allow_tf32=check_math(math or "fp32") == "tf32")
    raise OptionError(f"unknown backend {name!r}: expected 'cpu' or 'cuda'")
