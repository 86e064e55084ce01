"""What both backends compute alike, so neither imports the other: convolution output sizes (the planner's and
the kernels' shapes), and the counter-based dropout RNG whose masks the CUDA kernels (kernels/elementwise.cu) and
the CPU's numpy reference draw bit for bit alike, so a mask can be replayed on either device; the host's clock
for traced calls."""
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
    """PyTorch's output size: floor((H + 2p - d(k-1) - 1) / s) + 1 per axis (may be <= 0 for invalid configs)."""
    return tuple((i + 2 * p - d * (k - 1) - 1) // s + 1  # type: ignore[return-value]
                 for i, k, s, p, d in zip(in_hw, kernel, stride, padding, dilation))


# ---------------------------------------------------------------------------
# Counter-based dropout RNG (numpy reference of kernels/elementwise.cu)
# ---------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S40 = (np.uint64(s) for s in (30, 27, 31, 40))

#: Elements per chunk when building large masks (bounds temporary memory).
_MASK_CHUNK = 1 << 20


def splitmix64(x) -> np.ndarray:
    """SplitMix64 finaliser of every element of ``x`` (uint64, wrapping).

        z = x + 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    Returns a new uint64 array of ``x``'s shape (0-d for a scalar input).
    """
    z = np.array(x, dtype=np.uint64)  # copy; raises for negative ints
    shape = z.shape
    z = z.reshape(-1)
    # numpy wraps uint64 array arithmetic modulo 2**64 silently; the 1-D view
    # keeps it on the array path (0-d scalars would warn on overflow).
    z += _GOLDEN
    z ^= z >> _S30
    z *= _MUL1
    z ^= z >> _S27
    z *= _MUL2
    z ^= z >> _S31
    return z.reshape(shape)


def dropout_threshold24(p: float) -> int:
    """``round(p * 2**24)``: an element is dropped iff its 24 random bits are
    below it, so P(drop) = threshold / 2**24 (0 keeps all, 2**24 drops all)."""
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    return int(round(p * (1 << 24)))


def dropout_scale(p: float) -> float:
    """``1 / (1 - p)``, the factor applied to kept elements (0.0 for p == 1,
    where nothing is kept)."""
    p = float(p)
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def dropout_keep_mask(key: int, n: int, p: float) -> np.ndarray:
    """Boolean keep mask of ``n`` elements, identical to the CUDA kernels'.

    ``keep[i] = (splitmix64((key + i) mod 2**64) >> 40) >= dropout_threshold24(p)``
    for i = 0 .. n-1. Deterministic in ``(key, n, p)``; the mask of a prefix
    does not depend on ``n``.
    """
    n = int(n)
    if n < 0:
        raise ValueError(f"negative n {n}")
    threshold = np.uint64(dropout_threshold24(p))
    key = np.uint64(int(key) & _MASK64)
    keep = np.empty(n, dtype=bool)
    for start in range(0, n, _MASK_CHUNK):
        stop = min(start + _MASK_CHUNK, n)
        idx = np.arange(start, stop, dtype=np.uint64)
        idx += key  # wraps modulo 2**64
        keep[start:stop] = (splitmix64(idx) >> _S40) >= threshold
    return keep
