"""Carving a kernel's flat uint8 workspace into typed arrays: shared by the convolution algorithms
(`cpu.conv`, `cpu.winograd`), whose workspace sizes the planner reserves exactly as their layouts say."""
from __future__ import annotations

import numpy as np

ALIGN = 64  # byte alignment of each sub-buffer inside a workspace


def align(nbytes: int) -> int:
    """`nbytes` rounded up to the next sub-buffer boundary."""
    return -(-nbytes // ALIGN) * ALIGN


def view(ws: np.ndarray, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The C-contiguous `shape` array of `dtype` at byte `offset` of the workspace `ws` (no copy)."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    a = ws[offset:offset + nbytes].view(dtype).reshape(shape)
    if not a.flags.aligned:
        raise ValueError(f"convolution workspace is not aligned to {dtype.itemsize} bytes")
    return a
