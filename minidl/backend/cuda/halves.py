"""The CUDA backend's half storage, device-free: which cupy dtype holds a half tensor and which kernel form reads it.

Rules: cupy has no bfloat16, so a bf16 tensor on the device is a `uint16` array of bf16 bits and a uint16 device
array is always bf16; an fp16 tensor is a `float16` array; float32 stays float32. Copies move bf16 bits unchanged.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
BF16_BITS = np.dtype(np.uint16)    # the device storage of bf16
F16 = np.dtype(np.float16)

#: The half a device array's dtype stores, by dtype.
_HALF_OF = {BF16_BITS: "bf16", F16: "fp16"}
#: The suffix of a kernel's half form in the .cu files, by half.
_SUFFIX = {"bf16": "_bf16", "fp16": "_f16"}


def storage_dtype(dtype) -> np.dtype:
    """The dtype a device array of `dtype` has: uint16 for bfloat16, else `dtype` itself."""
    dt = np.dtype(dtype)
    return BF16_BITS if dt == BF16 else dt


def host_dtype(dtype) -> np.dtype:
    """The dtype a host copy of a device array of `dtype` has: bfloat16 for its uint16 bits, else `dtype`."""
    dt = np.dtype(dtype)
    return BF16 if dt == BF16_BITS else dt


def half_of(array) -> str | None:
    """'bf16' or 'fp16' for a device array holding that half, None otherwise (float32, integers)."""
    return _HALF_OF.get(np.dtype(array.dtype))


def variant(name: str, half: str | None) -> str:
    """The entry point of kernel `name`'s form for `half` (None: the float32 kernel itself)."""
    return name if half is None else name + _SUFFIX[half]
