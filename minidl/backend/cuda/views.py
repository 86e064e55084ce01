"""Arena views of the CUDA backend, device-free: a tensor is a `cupy.ndarray` at `arena base + offset`.
Rule: `view_spec` checks bounds and alignment, so a view never reaches past its block or the arena; a bf16 view is
uint16 (`storage_dtype`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .halves import storage_dtype

CUDA_MALLOC_ALIGNMENT = 256  # bytes cudaMalloc aligns to; the arena base must be as aligned

VIEW_ALIGNMENT = 16  # bytes: a view's start (cuDNN's vectorized loads); the pool's 512 B offsets keep it


def element_strides(a) -> tuple[int, ...]:
    """An array's strides in elements (cuDNN's and cuBLAS's unit)."""
    return tuple(int(st) // a.itemsize for st in a.strides)


def contiguous_strides(shape: Sequence[int], itemsize: int = 1) -> tuple[int, ...]:
    """C-order strides of `shape`: in elements with itemsize=1 (cuDNN), else in bytes (numpy);
    any values for a zero-size shape."""
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
    """Check and describe the view of `shape`/`dtype` at byte `offset` of a `capacity`-byte arena (`dtype` as the
    device stores it: `storage_dtype`); raises ValueError where it starts unaligned or outside, or ends past it."""
    dt = storage_dtype(dtype)
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
