"""Paged arena memory on a GPU: the CUDA driver's virtual memory management API (via cuda-python).

The GPU twin of `cpu.paged.MemfdArena`: physical chunks from `cuMemCreate` (the budget, up front), one
`cuMemAddressReserve` range, and a mapping is `cuMemMap` at `base + v*chunk` then `cuMemSetAccess`. The chunk
is a multiple of the allocation granularity (2 MiB; the default 20 MiB is). Rule: unmapping is not
stream-ordered, so `unmap` synchronizes first (a round trip per freed tensor). `driver` is injected (host tests
pass a recording fake).
"""
from __future__ import annotations

import math

from ...core.errors import MinidlError
from .halves import storage_dtype


class VmmError(MinidlError, RuntimeError):
    """A CUDA virtual memory call failed; the message names the call and the driver's error."""


def default_driver():
    from cuda.bindings import driver  # cuda-python (the `cuda` extra)

    return driver


class VmmArena:
    """`physical_bytes` of `chunk`-sized physical allocations behind a `virtual_bytes` reservation."""

    def __init__(self, driver, cupy, physical_bytes: int, chunk: int, virtual_bytes: int, device: int = 0):
        self.drv, self._cupy = driver, cupy
        self.chunk, self.virtual_bytes = int(chunk), int(virtual_bytes)
        d = driver
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        gran = int(self._call("cuMemGetAllocationGranularity", prop,
                              d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        if self.chunk % gran:
            raise VmmError(f"paged chunk {self.chunk} bytes is not a multiple of the device's allocation "
                           f"granularity ({gran} bytes): use e.g. --paged {max(gran, 2 ** 21) // 2 ** 20}MiB")
        self.base = int(self._call("cuMemAddressReserve", self.virtual_bytes, self.chunk, 0, 0))
        self.handles = [self._call("cuMemCreate", self.chunk, prop, 0) for _ in range(physical_bytes // self.chunk)]
        access = d.CUmemAccessDesc()
        access.location = prop.location
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self.mapped: dict[int, int] = {}   # virtual chunk -> physical chunk

    def _call(self, name: str, *args):
        out = getattr(self.drv, name)(*args)
        err, rest = out[0], out[1:]
        if err != self.drv.CUresult.CUDA_SUCCESS:
            raise VmmError(f"{name}{args[:2]} failed: {err}")
        return rest[0] if len(rest) == 1 else (rest or None)

    def map(self, vchunk: int, pchunk: int, count: int = 1) -> None:
        c = self.chunk
        for i in range(count):
            self._call("cuMemMap", self.base + (vchunk + i) * c, c, 0, self.handles[pchunk + i], 0)
            self.mapped[vchunk + i] = pchunk + i
        self._call("cuMemSetAccess", self.base + vchunk * c, count * c, [self._access], 1)

    def unmap(self, vchunk: int, count: int = 1) -> None:
        self._call("cuCtxSynchronize")     # queued kernels may still read the range
        self._call("cuMemUnmap", self.base + vchunk * self.chunk, count * self.chunk)
        for i in range(count):
            self.mapped.pop(vchunk + i, None)

    def view_at(self, offset: int, shape, dtype):
        cp = self._cupy
        dt = storage_dtype(dtype)
        nbytes = int(math.prod(shape)) * dt.itemsize
        mem = cp.cuda.UnownedMemory(self.base + offset, nbytes, self)
        return cp.ndarray(tuple(shape), dt, memptr=cp.cuda.MemoryPointer(mem, 0))

    def close(self) -> None:
        if self.handles is None:
            return
        for v in sorted(self.mapped):
            self.unmap(v)
        for h in self.handles:
            self._call("cuMemRelease", h)
        self._call("cuMemAddressFree", self.base, self.virtual_bytes)
        self.handles = None


class VmmBacking:
    """The CUDA backend's `paged_backing()`: hands a `PagedPool` a `VmmArena`."""

    def __init__(self, cupy, driver=None, device: int = 0):
        self._cupy, self._driver, self._device = cupy, driver, device

    def allocate(self, physical_bytes: int, chunk: int, virtual_bytes: int) -> VmmArena:
        return VmmArena(self._driver or default_driver(), self._cupy, physical_bytes, chunk, virtual_bytes,
                        self._device)
