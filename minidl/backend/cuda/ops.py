"""What the CUDA backend's op families share: their kernels' dtypes, the compute-stream decorator, the
NCHW channel broadcast.
"""
from __future__ import annotations

import functools

import numpy as np

F32 = np.dtype(np.float32)
I64 = np.dtype(np.int64)


def on_compute(fn):
    """Run a backend op with the compute stream current (cupy and cuBLAS enqueue there)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with self.compute:
            return fn(self, *args, **kwargs)
    return wrapper


def chan4(v):
    """A (C,) device vector as (1, C, 1, 1), to broadcast over NCHW."""
    return v.reshape(1, -1, 1, 1)
