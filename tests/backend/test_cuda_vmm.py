"""Host-only tests of the CUDA paged arena (`backend/cuda/vmm.py`) against a recording fake of the driver API.

No GPU or cuda-python is needed: the fake records every call and returns (CUDA_SUCCESS, value) as cuda-python
does. What must hold: the physical chunks are created once; each mapping is cuMemMap + cuMemSetAccess at
base + chunk * virtual index with the physical chunk the pool chose; unmapping synchronizes first; closing
releases everything; a chunk off the device's granularity and a failing call are named errors. On a GPU the
paged executor runs through the same calls (tests/backend/test_conformance.py covers the numerics).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from minidl.backend.cuda.vmm import VmmArena, VmmBacking, VmmError
from minidl.memory.paged import PagedPool

CHUNK = 2 * 2**20
BASE = 0x7F0000000000


class _Prop(SimpleNamespace):
    def __init__(self):
        super().__init__(type=None, location=SimpleNamespace(type=None, id=None))


class FakeDriver:
    """Just enough of `cuda.bindings.driver` for the VMM calls, recording them."""

    CUresult = SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_OUT_OF_MEMORY=2)
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED="pinned")
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE="device")
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM="min")
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE="rw")
    CUmemAllocationProp = _Prop
    CUmemAccessDesc = SimpleNamespace

    def __init__(self, fail: str | None = None):
        self.calls: list[tuple] = []
        self.fail = fail
        self._handles = 0

    def _rec(self, name, *args, value=None):
        self.calls.append((name, *args))
        if name == self.fail:
            return (self.CUresult.CUDA_ERROR_OUT_OF_MEMORY,) + ((None,) if value is not None else ())
        return (self.CUresult.CUDA_SUCCESS,) + ((value,) if value is not None else ())

    def cuMemGetAllocationGranularity(self, prop, flag):
        return self._rec("cuMemGetAllocationGranularity", flag, value=CHUNK)

    def cuMemAddressReserve(self, size, align, addr, flags):
        return self._rec("cuMemAddressReserve", size, align, value=BASE)

    def cuMemCreate(self, size, prop, flags):
        self._handles += 1
        assert prop.location.type == "device" and prop.type == "pinned"
        return self._rec("cuMemCreate", size, value=f"h{self._handles - 1}")

    def cuMemMap(self, ptr, size, offset, handle, flags):
        return self._rec("cuMemMap", ptr, size, handle)

    def cuMemSetAccess(self, ptr, size, descs, count):
        assert descs[0].flags == "rw" and count == 1
        return self._rec("cuMemSetAccess", ptr, size)

    def cuCtxSynchronize(self):
        return self._rec("cuCtxSynchronize")

    def cuMemUnmap(self, ptr, size):
        return self._rec("cuMemUnmap", ptr, size)

    def cuMemRelease(self, handle):
        return self._rec("cuMemRelease", handle)

    def cuMemAddressFree(self, ptr, size):
        return self._rec("cuMemAddressFree", ptr, size)


class FakeCupy:
    """cupy's UnownedMemory / MemoryPointer / ndarray, recording the pointer a view is built on."""

    def __init__(self):
        self.cuda = SimpleNamespace(UnownedMemory=lambda ptr, size, owner: SimpleNamespace(ptr=ptr, size=size),
                                    MemoryPointer=lambda mem, off: SimpleNamespace(ptr=mem.ptr + off, mem=mem))
        self.ndarray = lambda shape, dtype, memptr: SimpleNamespace(shape=shape, dtype=dtype, ptr=memptr.ptr,
                                                                     nbytes=memptr.mem.size)


def _names(drv, name):
    return [c[1:] for c in drv.calls if c[0] == name]


def test_paged_pool_on_the_driver_api():
    drv = FakeDriver()
    pool = PagedPool(4 * CHUNK, CHUNK, 16 * CHUNK, backing=VmmBacking(FakeCupy(), driver=drv))
    assert _names(drv, "cuMemAddressReserve") == [(16 * CHUNK, CHUNK)]
    assert _names(drv, "cuMemCreate") == [(CHUNK,)] * 4
    a = pool.alloc(2 * CHUNK, "a")                       # two chunks of its own: physical h0, h1
    assert _names(drv, "cuMemMap") == [(BASE + a, CHUNK, "h0"), (BASE + a + CHUNK, CHUNK, "h1")]
    assert _names(drv, "cuMemSetAccess") == [(BASE + a, 2 * CHUNK)]
    b = pool.alloc(1000, "b")                            # a shared chunk: physical h2
    assert _names(drv, "cuMemMap")[-1] == (BASE + b, CHUNK, "h2")
    v = pool.view(b, (250,), np.float32)
    assert v.ptr == BASE + b and v.nbytes == 1000 and v.shape == (250,)
    drv.calls.clear()
    pool.free(a)
    assert [c[0] for c in drv.calls] == ["cuCtxSynchronize", "cuMemUnmap"]
    assert _names(drv, "cuMemUnmap") == [(BASE + a, 2 * CHUNK)]
    c = pool.alloc(CHUNK, "c")                           # the lowest free physical chunk again
    assert _names(drv, "cuMemMap")[-1] == (BASE + c, CHUNK, "h0")
    drv.calls.clear()
    pool.close()
    assert sorted(_names(drv, "cuMemRelease")) == [("h0",), ("h1",), ("h2",), ("h3",)]
    assert _names(drv, "cuMemAddressFree") == [(BASE, 16 * CHUNK)]
    assert len(_names(drv, "cuMemUnmap")) == 2          # b's and c's chunks


def test_chunk_off_granularity_and_failures_are_named():
    with pytest.raises(VmmError, match="granularity"):
        VmmArena(FakeDriver(), FakeCupy(), 4 * CHUNK, CHUNK // 2, 16 * CHUNK)
    with pytest.raises(VmmError, match="cuMemCreate"):
        VmmArena(FakeDriver(fail="cuMemCreate"), FakeCupy(), 4 * CHUNK, CHUNK, 16 * CHUNK)
