"""Math modes (`--math fp32|tf32`): how a backend may compute float32 convolutions and products.

`tf32` (Ampere+: inputs rounded to a 10-bit mantissa, float32 accumulation; PyTorch's default for convolutions)
moves results ~1e-3 off fp32, but bit-identity across policies holds within a mode. A mode is set before planning:
it decides the engines, hence the workspace options. The CPU refuses tf32 rather than label fp32 figures tf32.
"""
from __future__ import annotations

from ..core.errors import OptionError
from ..core.options import MATH_MODES, check_math
from .base import backend_name

__all__ = ["MATH_MODES", "apply_math", "backend_math", "check_math"]


def backend_math(backend) -> str:
    """The math mode `backend` runs in ('fp32' where it declares none)."""
    return getattr(backend, "math", "fp32") if backend is not None else "fp32"


def apply_math(backend, math: str | None) -> str:
    """Put `backend` in mode `math` (None: its own) and return it; a backend without `set_math` runs fp32 only."""
    if math is None:
        return backend_math(backend)
    check_math(math)
    if math == backend_math(backend):
        return math
    setter = getattr(backend, "set_math", None)
    name = backend_name(backend)
    if setter is None:
        raise OptionError(f"--math {math}: backend '{name}' computes in fp32 only (TF32 is a tensor-core format of "
                          f"NVIDIA GPUs since Ampere); use --math fp32, or --backend cuda on such a GPU")
    setter(math)
    return backend_math(backend)
