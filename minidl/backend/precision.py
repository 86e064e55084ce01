"""Precision: the dtype a math mode stores each tensor role in, and how values round (every backend keeps it;
the planner counts bytes with `Precision.dtype`).

* fp32 and tf32 store every role in float32.
* bf16 and fp16 store activations, deltas, float data, attention's kept probabilities (`Layer.half_aux`) and the
  `WEIGHT_COPY` a product reads (`Layer.half_params`) in half; masters, buffers, gradients, optimizer state,
  buckets, a loss's output and delta and norms' saved statistics in float32; labels keep their dtype.
* Kernels compute in float32 (sums in float32 or wider) and round once on storing half: to nearest even.
* fp16 scales the loss (its smallest normal, 6.1e-5, flushes small gradients); bf16 has float32's range.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..core.errors import OptionError
from ..core.tensors import Role

#: The half dtypes of the mixed-precision modes.
HALF_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16)}
#: Every precision mode, float32 ones first.
PRECISION_MODES = ("fp32", "tf32", *HALF_DTYPES)
#: The half copy of a master weight that products read.
WEIGHT_COPY = "weight_copy"
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

    def dtype(self, role: Role | str, *, layer=None, aux: str | None = None) -> np.dtype | None:
        """The storage dtype of `role` (or `WEIGHT_COPY`) on `layer`'s tensor `aux`; None for labels."""
        if role == Role.WORKSPACE:
            return np.dtype(np.uint8)
        if role == Role.LABEL:
            return None
        half = self.half
        if half is None or role in _WIDE_ROLES:
            return FLOAT32
        if role == WEIGHT_COPY or role == Role.DATA:
            return half
        if role in (Role.ACTIVATION, Role.DELTA):
            return FLOAT32 if layer is not None and layer.is_loss else half
        if role == Role.AUX:
            return half if layer is not None and aux in layer.half_aux else FLOAT32
        raise ValueError(f"no storage dtype for role {role!r}")


def precision(mode: str) -> Precision:
    """The `Precision` of `mode`, or an OptionError naming the modes."""
    if mode not in PRECISION_MODES:
        raise OptionError(f"--math must be one of {', '.join(PRECISION_MODES)}, got {mode!r}")
    return Precision(mode)


def check_half_kernels(layers, backend, mode: str) -> None:
    """In a half mode, an OptionError naming the first layer with a kernel `backend` has no half form of."""
    if precision(mode).half is None:
        return
    have = backend.capabilities.half_kernels
    for layer in layers:
        missing = [k for k in layer.kernels() if k not in have]
        if missing:
            raise OptionError(f"--math {mode}: {layer.describe()} has no {mode} kernel on backend "
                              f"'{backend.capabilities.name}' ({', '.join(missing)}); use --math fp32")
