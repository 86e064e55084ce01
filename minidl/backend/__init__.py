"""Array/kernel backends. `cpu` (numpy) is the reference; `cuda` (cupy + cuDNN frontend) imports lazily."""
from __future__ import annotations

from ..core import startup
from ..core.errors import OptionError
from .base import Backend, Capabilities, backend_name, menu_of

__all__ = ["Backend", "Capabilities", "backend_name", "get_backend", "menu_of"]


def get_backend(name: str = "cpu", device: int = 0, math: str | None = None, menu=None):
    """A backend by name (CUDA imported only when asked for): `device` its GPU, `math` its math mode (None: fp32),
    `menu` the CPU's (`cpu.menu.CPUMenu`)."""
    with startup.phase("backend"):
        return _open_backend(name, device, math, menu)


def _open_backend(name: str, device: int, math: str | None, menu):
    from .mathmode import apply_math

    if name == "cpu":
        from .cpu.backend import CPUBackend
        from .cpu.menu import CPU_MENU

        backend = CPUBackend(menu or CPU_MENU)
        apply_math(backend, math)  # refuses tf32, naming --math
        return backend
    if name == "cuda":
        from .cuda.backend import CUDABackend
        from .mathmode import check_math

        return CUDABackend(device=device, allow_tf32=check_math(math or "fp32") == "tf32")
    raise OptionError(f"unknown backend {name!r}: expected 'cpu' or 'cuda'")
