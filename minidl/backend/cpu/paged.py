"""Paged arena memory on the CPU (`--paged`; planned by `memory.paged.PagedPool`): memfd chunks mapped MAP_FIXED
into a range reserved PROT_NONE; unmapping restores PROT_NONE, so a stale view faults. Through libc (Python's
mmap cannot map at a fixed address); Linux only.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os

import numpy as np

from ...core.errors import MinidlError

PROT_NONE, PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
MAP_SHARED, MAP_PRIVATE = 0x01, 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


class PagedMemoryError(MinidlError, OSError):
    """The operating system refused a mapping (or the platform has no memfd)."""


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long)
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


class MemfdArena:
    """`physical_bytes` of memfd chunks behind a `virtual_bytes` reservation; `map`/`unmap` per chunk run."""

    def __init__(self, physical_bytes: int, chunk: int, virtual_bytes: int):
        page = mmap.PAGESIZE
        if chunk % page:
            raise PagedMemoryError(f"paged chunk {chunk} bytes is not a multiple of the page size ({page} bytes): "
                                   f"the CPU maps whole pages")
        if not hasattr(os, "memfd_create"):
            raise PagedMemoryError("--paged on the CPU needs os.memfd_create (Linux)")
        self.chunk, self.physical_bytes, self.virtual_bytes = chunk, physical_bytes, virtual_bytes
        self._libc = _libc()
        self.fd = os.memfd_create("minidl-arena", getattr(os, "MFD_CLOEXEC", 1))
        os.ftruncate(self.fd, max(physical_bytes, page))
        base = self._libc.mmap(None, max(virtual_bytes, page), PROT_NONE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if base in (None, _MAP_FAILED):
            os.close(self.fd)
            raise PagedMemoryError(f"cannot reserve {virtual_bytes} bytes of virtual address space: "
                                   f"{os.strerror(ctypes.get_errno())}")
        self.base = base
        self.mapped: dict[int, int] = {}  # virtual chunk -> physical chunk

    def _mmap(self, addr: int, length: int, prot: int, flags: int, fd: int, offset: int) -> None:
        got = self._libc.mmap(addr, length, prot, flags, fd, offset)
        if got != addr:
            raise PagedMemoryError(f"mmap at {addr:#x} ({length} bytes) failed: {os.strerror(ctypes.get_errno())}")

    def map(self, vchunk: int, pchunk: int, count: int = 1) -> None:
        """Map `count` virtual chunks from `vchunk` onto physical chunks `pchunk`, `pchunk + 1`, ..."""
        c = self.chunk
        if (vchunk + count) * c > self.virtual_bytes or (pchunk + count) * c > self.physical_bytes:
            raise PagedMemoryError(f"map of chunks v{vchunk}/p{pchunk} x{count} is outside the arena "
                                   f"(virtual {self.virtual_bytes} B, physical {self.physical_bytes} B)")
        self._mmap(self.base + vchunk * c, count * c, PROT_RW, MAP_SHARED | MAP_FIXED, self.fd, pchunk * c)
        for i in range(count):
            self.mapped[vchunk + i] = pchunk + i

    def unmap(self, vchunk: int, count: int = 1) -> None:
        c = self.chunk
        self._mmap(self.base + vchunk * c, count * c, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED |
                   MAP_NORESERVE, -1, 0)
        for i in range(count):
            self.mapped.pop(vchunk + i, None)

    def view_at(self, offset: int, shape, dtype) -> np.ndarray:
        dt = np.dtype(dtype)
        nbytes = int(math.prod(shape)) * dt.itemsize
        buf = (ctypes.c_char * max(nbytes, 1)).from_address(self.base + offset)
        buf._arena = self  # a view keeps the mapping alive
        return np.frombuffer(buf, dtype=np.uint8, count=nbytes).view(dt).reshape(shape)

    def close(self) -> None:
        if self.fd >= 0:
            self._libc.munmap(self.base, max(self.virtual_bytes, mmap.PAGESIZE))
            os.close(self.fd)
            self.fd = -1

    def __del__(self):  # no view is left: each holds the arena
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class MemfdBacking:
    """The CPU backend's `paged_backing()`: hands a `PagedPool` a `MemfdArena`."""

    def allocate(self, physical_bytes: int, chunk: int, virtual_bytes: int) -> MemfdArena:
        return MemfdArena(physical_bytes, chunk, virtual_bytes)
