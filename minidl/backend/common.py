"""What both backends compute alike: convolution output sizes, the counter-based dropout RNG (the masks of
kernels/elementwise.cu), the host's clock.
"""
from __future__ import annotations

import time

import numpy as np


class HostClock:
    """The host's `CallClock`: a call's own time, on `time.perf_counter`."""

    mark = staticmethod(time.perf_counter)

    @staticmethod
    def read(start: float, end: float) -> tuple[float, float]:
        return start, end - start


def conv_output_hw(in_hw, kernel, stride, padding, dilation) -> tuple[int, int]:
    """PyTorch's output size per axis: floor((H + 2p - d(k-1) - 1) / s) + 1 (<= 0 when invalid)."""
    return tuple((i + 2 * p - d * (k - 1) - 1) // s + 1  # type: ignore[return-value]
                 for i, k, s, p, d in zip(in_hw, kernel, stride, padding, dilation))


_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S40 = (np.uint64(s) for s in (30, 27, 31, 40))

_MASK_CHUNK = 1 << 20  # elements per chunk of a mask


def splitmix64(x) -> np.ndarray:
    """The SplitMix64 finaliser of every element of `x` (uint64, wrapping), as a new array."""
    z = np.array(x, dtype=np.uint64)  # raises for negative ints
    shape = z.shape
    z = z.reshape(-1)
    # 1-D: arrays wrap silently, 0-d scalars warn
    z += _GOLDEN
    z ^= z >> _S30
    z *= _MUL1
    z ^= z >> _S27
    z *= _MUL2
    z ^= z >> _S31
    return z.reshape(shape)


def dropout_threshold24(p: float) -> int:
    """round(p * 2**24): an element is dropped iff its 24 random bits are below it."""
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    return int(round(p * (1 << 24)))


def dropout_scale(p: float) -> float:
    """1 / (1 - p), the factor of kept elements (0.0 for p == 1)."""
    p = float(p)
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def dropout_keep_mask(key: int, n: int, p: float) -> np.ndarray:
    """keep[i] = (splitmix64((key + i) mod 2**64) >> 40) >= dropout_threshold24(p), as the CUDA kernels draw it."""
    n = int(n)
    if n < 0:
        raise ValueError(f"negative n {n}")
    threshold = np.uint64(dropout_threshold24(p))
    key = np.uint64(int(key) & _MASK64)
    keep = np.empty(n, dtype=bool)
    for start in range(0, n, _MASK_CHUNK):
        stop = min(start + _MASK_CHUNK, n)
        idx = np.arange(start, stop, dtype=np.uint64)
        idx += key
        keep[start:stop] = (splitmix64(idx) >> _S40) >= threshold
    return keep
