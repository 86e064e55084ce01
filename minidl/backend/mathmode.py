"""Math modes (`--math fp32|tf32|bf16|fp16`): how a backend may compute float32 convolutions and matrix products.

* `fp32` (the default): full float32 arithmetic everywhere. On the CPU that is the only mode; on CUDA, cuDNN
  engines with the TENSOR_CORE / DOWN_CONVERT_INPUTS numerical notes are deselected (`EngineFilters`) and
  cuBLAS keeps its default math.
* `tf32`: NVIDIA's tensor-core format for float32 data (Ampere and later): inputs rounded to a 10-bit mantissa,
  products accumulated in float32. PyTorch's default for convolutions, so a fair speed comparison needs it.
  Results move ~1e-3 off the fp32 reference, but a mode is a fixed choice of engines: bit-identity across
  memory policies holds *within* a mode, as it does for fp32.

* `bf16`, `fp16`: mixed precision, a choice of storage (`backend.precision`: the dtype of each tensor role) more
  than of arithmetic: the kernels compute in float32 on half operands, and what stays float32 (the optimizer, the
  statistics) computes as in fp32. The CPU stays in `fp32`; CUDA takes the mode (`set_math`: tensor-core engines
  on half inputs, float32 accumulation). Every backend with half kernels runs them (the CPU's compute on float32
  copies); a layer without one is named when the route is built.

Why the CPU backend refuses `tf32` rather than ignoring it: a run or benchmark row labelled tf32 would then be
fp32 figures under the wrong name. The refusal is an `OptionError` naming the option, raised when the session is
built (before planning), like every other bad option.

The mode must be set before planning: it decides which convolution engines exist, hence the plan's workspace
options (the cuDNN graph cache is keyed by the engine filters, so the two modes never share a built graph).
"""
from __future__ import annotations

from ..core.errors import OptionError
from ..core.options import MATH_MODES, check_math
from .base import backend_name
from .precision import precision

__all__ = ["MATH_MODES", "apply_math", "backend_math", "check_math"]


def backend_math(backend) -> str:
    """The math mode `backend` runs in ('fp32' where it declares none)."""
    return getattr(backend, "math", "fp32") if backend is not None else "fp32"


def apply_math(backend, math: str | None) -> str:
    """Put `backend` in mode `math` (None: leave it in its own) and return the mode it now runs in.

    A backend that offers modes has `set_math(mode)`; one that has not (the CPU) runs fp32 only and refuses
    anything else, naming the option, the backend and what to do instead. A half mode goes to the backend's
    `set_math` where it has one (CUDA: its engines), else leaves it in fp32 (the CPU's float32 arithmetic), and
    returns the half mode: the plan stores as it says."""
    if math is None:
        return backend_math(backend)
    if precision(math).half is not None:
        setter = getattr(backend, "set_math", None)
        if setter is None:
            apply_math(backend, "fp32")
        else:
            setter(math)
        return math
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
