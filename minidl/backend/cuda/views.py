"""Arena views of the CUDA backend, device-free: a tensor is a `cupy.ndarray` whose pointer is `arena base + offset`;
`view_spec` turns (offset, shape, dtype) into the byte range and C-order byte strides and checks bounds and
alignment, so a view can never reach past its block or the arena (host-tested, no GPU needed)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

CUDA_MALLOC_ALIGNMENT = 256
"""cudaMalloc returns 256-byte aligned pointers; the arena base must be at least that aligned."""

VIEW_ALIGNMENT = 16
"""Every tensor view must start on a multiple of this (cuDNN's vectorized loads). The tensor pool hands out
512-byte aligned offsets, so this holds for every planned tensor."""


# ---------------------------------------------------------------------------------------------------------
# Arena views
# ---------------------------------------------------------------------------------------------------------

def contiguous_strides(shape: Sequence[int], itemsize: int = 1) -> tuple[int, ...]:
    """C-order strides of `shape`: in elements with itemsize=1 (what cuDNN wants), in bytes otherwise (what
    numpy/cupy report). For a zero-size shape no element is ever addressed, so the values do not matter (numpy
    itself reports zeros there)."""
    strides = []
    acc = int(itemsize)
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(strides))


@dataclass(slots=True, frozen=True)
class ViewSpec:
    """A C-contiguous view of the arena: bytes [offset, offset + nbytes), `strides` in bytes."""

    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    strides: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def shape_tuple(shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    out = tuple(int(d) for d in shape)
    if any(d < 0 for d in out):
        raise ValueError(f"negative dimension in shape {out}")
    return out


def view_spec(offset: int, shape, dtype, capacity: int, alignment: int = VIEW_ALIGNMENT) -> ViewSpec:
    """Check and describe the view of `shape`/`dtype` at byte `offset` of an arena of `capacity` bytes.

    Raises ValueError if the view would start unaligned (to `alignment` and to the dtype's size), start
    outside the arena or end past it.
    """
    dt = np.dtype(dtype)
    shp = shape_tuple(shape)
    offset = int(offset)
    nbytes = math.prod(shp) * dt.itemsize
    if offset < 0:
        raise ValueError(f"arena view at negative offset {offset}")
    align = max(int(alignment), dt.itemsize)
    if offset % align:
        raise ValueError(f"arena view of {shp} {dt} at offset {offset} is not aligned to {align} bytes")
    if offset + nbytes > capacity:
        raise ValueError(f"arena view of {shp} {dt} ({nbytes} bytes) at offset {offset} ends at byte "
                         f"{offset + nbytes}, past the arena's {capacity} bytes")
    return ViewSpec(offset, shp, dt, nbytes, contiguous_strides(shp, dt.itemsize))


def check_base_alignment(ptr: int, alignment: int = CUDA_MALLOC_ALIGNMENT) -> None:
    """The arena's base device address must be `alignment`-aligned (cudaMalloc guarantees 256)."""
    if int(ptr) % alignment:
        raise ValueError(f"arena base address {int(ptr):#x} is not aligned to {alignment} bytes")


def ranges_overlap(a: ViewSpec, b: ViewSpec) -> bool:
    """Whether two views share at least one byte (empty views overlap nothing)."""
    return a.nbytes > 0 and b.nbytes > 0 and a.offset < b.end and b.offset < a.end
