"""Precision: the dtype a math mode stores each tensor role in, and how values round (every backend keeps it;
the planner counts bytes with `Precision.dtype`).

Rules (every backend keeps them; the planner counts bytes with `Precision.dtype`):
* fp32 and tf32 store every role in float32 (tf32 changes only how products compute: `mathmode`).
* bf16 and fp16 store in their half dtype (`HALF_DTYPES`): activations, deltas, float data inputs, the
  probabilities attention keeps (`Layer.half_aux`), and the half copy of the weights a product reads
  (`Layer.half_params`: conv's and linear's weight and bias, a `Role.WEIGHT_COPY` refreshed from its master after
  each update). In float32: parameters (the masters the optimizer updates), buffers, gradients, optimizer state,
  gradient buckets, a loss's output and its delta, and the statistics a norm saves (BN's mean and invstd, LN's
  mean and rstd). Labels keep their integer dtype.
* Kernels read stored values exactly, compute in float32 (sums accumulate in float32 or wider: products, batch-
  and layer-norm statistics, softmax, the loss), and round once when they store a half value: to nearest, ties
  to even (a GPU's `__float2bfloat16_rn`, `__float2half_rn`); fp16 overflows to inf; a NaN stays a NaN.
  A kernel that reads master weights (an embedding's table, a norm's scale) reads them in float32.
* Workspace is bytes sized for the kernel's compute: the CPU's half kernels stage float32 copies of their half
  operands (`backend.cpu.half`: `staging_bytes`, a `Role.STAGING` tensor of the step) and size their algorithms'
  workspace for float32; CUDA sizes what cuDNN and cuBLAS ask for half I/O (`workspace_itemsize`).
* fp16 scales the loss (`minidl.optim.loss_scale`): its smallest normal, 6.1e-5, flushes small gradients;
  bf16 has float32's exponent range and is not scaled.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..core.errors import OptionError
from ..core.options import MATH_MODES, check_math
from ..core.tensors import Role
from .base import FUSES_ADD_RELU_BACKWARD

#: The half dtypes of the mixed-precision modes (each one of `MATH_MODES`).
HALF_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16)}
assert set(HALF_DTYPES) <= set(MATH_MODES)
FLOAT32 = np.dtype(np.float32)
_WIDE_ROLES = frozenset({Role.PARAMETER, Role.BUFFER, Role.GRADIENT, Role.OPTIMIZER, Role.BUCKET})


def is_half(dtype) -> bool:
    """Whether `dtype` is one of the half storage dtypes."""
    return np.dtype(dtype) in _HALF


_HALF = frozenset(HALF_DTYPES.values())


@dataclass(frozen=True)
class Precision:
    """A math mode's storage: `dtype` of each role, whether it is mixed, whether its loss is scaled."""

    mode: str

    @property
    def half(self) -> np.dtype | None:
        """The half dtype of a mixed mode; None where everything is float32."""
        return HALF_DTYPES.get(self.mode)

    @property
    def loss_scaling(self) -> bool:
        return self.mode == "fp16"

    def dtype(self, role: Role, *, layer=None, aux: str | None = None) -> np.dtype | None:
        """The storage dtype of a tensor of `role`; `layer` the layer it belongs to where that decides (a loss's
        output and delta; which aux tensor `aux` names). WORKSPACE and STAGING are bytes (uint8); LABEL is None:
        labels keep the dtype they are declared with."""
        if role in (Role.WORKSPACE, Role.STAGING):
            return np.dtype(np.uint8)
        if role == Role.LABEL:
            return None
        half = self.half
        if half is None or role in _WIDE_ROLES:
            return FLOAT32
        if role in (Role.WEIGHT_COPY, Role.DATA):
            return half
        if role in (Role.ACTIVATION, Role.DELTA):
            return FLOAT32 if layer is not None and layer.is_loss else half
        if role == Role.AUX:
            return half if layer is not None and aux in layer.half_aux else FLOAT32
        raise ValueError(f"no storage dtype for role {role!r}")


    def workspace_itemsize(self, staging: bool) -> int:
        """The element size a kernel's workspace is sized for: float32 in float32 modes and where the half kernels
        stage float32 copies (`staging`: the CPU), the half dtype's where they compute on half I/O (CUDA)."""
        return 4 if self.half is None or staging else self.half.itemsize


def precision(mode: str) -> Precision:
    """The `Precision` of `mode`, or an OptionError naming the modes."""
    return Precision(check_math(mode))


#: Layer kernels that are fusions (`Capabilities.fuses` names them where a backend runs them).
FUSED_KERNELS = frozenset({FUSES_ADD_RELU_BACKWARD})


def check_half_kernels(layers, backend, mode: str) -> None:
    """In a half mode, an OptionError naming the first layer with a kernel `backend` has no half form of."""
    if precision(mode).half is None:
        return
    caps = backend.capabilities
    # a fused kernel is called only where the backend fuses: elsewhere the runner calls the unfused ones
    unused = FUSED_KERNELS - caps.fuses
    for layer in layers:
        missing = [k for k in layer.kernels() if k not in caps.half_kernels and k not in unused]
        if missing:
            raise OptionError(f"--math {mode}: {layer.describe()} has no {mode} kernel on backend "
                              f"'{backend.capabilities.name}' ({', '.join(missing)}); use --math fp32")
