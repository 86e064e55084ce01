"""Carving a convolution's flat uint8 workspace into typed arrays, at the offsets the planner reserved."""
from __future__ import annotations

import numpy as np

ALIGN = 64  # bytes: alignment of each sub-buffer


def align(nbytes: int) -> int:
    """`nbytes` rounded up to `ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def view(ws: np.ndarray, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The C-contiguous `shape` array of `dtype` at byte `offset` of `ws` (no copy)."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    a = ws[offset:offset + nbytes].view(dtype).reshape(shape)
    if not a.flags.aligned:
        raise ValueError(f"convolution workspace is not aligned to {dtype.itemsize} bytes")
    return a
