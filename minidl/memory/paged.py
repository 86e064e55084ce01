"""The paged pool (`--paged [CHUNK]`): physical chunks mapped behind contiguous virtual ranges (nnabla's answer to
fragmentation: a free chunk is usable wherever it sits).

Rules: physical chunks go lowest index first, so the highest ever mapped is the plan's arena; a tensor of a chunk
or more owns a run of virtual chunks (its last one rounded up); a smaller one shares a chunk, best fit, never
crossing it; virtual offsets come from a `TensorPool` in chunk units, so they are deterministic. Planner and
executor (`backend.cpu.paged`, `backend.cuda.vmm`) replay the same events, so their peaks agree byte for byte.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Hashable, Protocol

import numpy as np

from minidl.core.errors import OptionError

from .pool import ALIGNMENT, LiveQueries, PoolOutOfMemory, TensorPool, align_up, format_bytes, parse_size

DEFAULT_CHUNK = 20 * 2**20
"""The paper's 20 MB chunk, as 20 MiB: a multiple of CUDA's 2 MiB mapping granularity and of any page."""

CHUNKS_PER_BUDGET = 64
"""`--paged` without a size: the chunk is at most 1/this of the budget."""

LEAST_CHUNK = {"cpu": 64 * 2**10, "cuda": 2 * 2**20}
"""Bytes: the smallest chunk `chunk_for_budget` picks (CPU: a multiple of 4/16/64 KiB pages; CUDA: its granularity)."""


def chunk_for_budget(budget: int | None, backend: str = "cpu") -> int:
    """`--paged`'s chunk: 20 MiB, or under 64 of them the largest power of two <= budget / 64 (at least
    `LEAST_CHUNK`), so chunk rounding costs a small share of the budget."""
    least = LEAST_CHUNK.get(backend, LEAST_CHUNK["cuda"])
    if budget is None or budget >= CHUNKS_PER_BUDGET * DEFAULT_CHUNK:
        return DEFAULT_CHUNK
    return max(least, 1 << max(0, (budget // CHUNKS_PER_BUDGET).bit_length() - 1))


@dataclass(slots=True)
class PagedLayout:
    """The chunk and the virtual space a chunk-placed plan needs."""

    chunk_bytes: int
    virtual_bytes: int      # the highest virtual byte the plan touches
    live_peak_bytes: int    # peak of live bytes, 512-aligned
    rounded_peak_bytes: int = 0  # peak with each tensor rounded to whole chunks (the arena's bound)


class PagedBacking(Protocol):
    """Real memory behind a paged pool: `allocate` reserves the virtual range and physical chunks once."""

    def allocate(self, physical_bytes: int, chunk: int, virtual_bytes: int) -> Any: ...


@dataclass(slots=True)
class _Range:
    size: int         # aligned bytes
    vchunk: int       # first virtual chunk
    nchunks: int      # chunks it owns (0: it lives in a shared chunk)
    tag: Hashable | None


class PagedPool(LiveQueries):
    """`budget // chunk` physical chunks behind a virtual range."""

    def __init__(self, budget: int | str, chunk: int = DEFAULT_CHUNK, virtual_bytes: int | None = None,
                 backing: PagedBacking | None = None):
        self.budget = parse_size(budget)
        self.chunk = int(chunk)
        if self.chunk <= 0 or self.chunk % ALIGNMENT:
            raise OptionError(f"paged chunk {self.chunk} bytes must be a positive multiple of {ALIGNMENT} bytes")
        self.n_chunks = self.budget // self.chunk
        self.capacity = self.n_chunks * self.chunk
        n_virtual = -(-virtual_bytes // self.chunk) if virtual_bytes else 2 * self.n_chunks + 16
        self._virt = TensorPool(max(n_virtual, 1) * ALIGNMENT)   # one 512-byte unit per virtual chunk
        self._free_phys = list(range(self.n_chunks))            # a heap: lowest physical chunk first
        self._phys: dict[int, int] = {}                         # virtual chunk -> physical chunk
        self._shared: dict[int, TensorPool] = {}                # shared virtual chunk -> its sub-pool
        self._live: dict[int, _Range] = {}
        self._in_use = self._peak = self._live_bytes = self._live_peak = 0
        self._rounded = self.rounded_peak = 0
        self.virtual_high = 0
        self.arena = (backing.allocate(self.capacity, self.chunk, n_virtual * self.chunk)
                      if backing is not None else None)

    def _map(self, vchunk: int, count: int, nbytes: int, tag) -> None:
        if len(self._free_phys) < count:
            raise PoolOutOfMemory(count * self.chunk, self._in_use, len(self._free_phys) * self.chunk,
                                  len(self._free_phys) * self.chunk, self.budget, tag)
        phys = [heapq.heappop(self._free_phys) for _ in range(count)]
        for i, p in enumerate(phys):
            self._phys[vchunk + i] = p
        if self.arena is not None:   # one call per run of consecutive physical chunks
            i = 0
            while i < count:
                j = i + 1
                while j < count and phys[j] == phys[j - 1] + 1:
                    j += 1
                self.arena.map(vchunk + i, phys[i], j - i)
                i = j
        self._in_use += count * self.chunk
        self._peak = max(self._peak, self._in_use)
        self.virtual_high = max(self.virtual_high, (vchunk + count) * self.chunk)

    def _unmap(self, vchunk: int, count: int) -> None:
        if self.arena is not None:
            self.arena.unmap(vchunk, count)
        for i in range(count):
            heapq.heappush(self._free_phys, self._phys.pop(vchunk + i))
        self._in_use -= count * self.chunk

    def alloc(self, nbytes: int, tag: Hashable | None = None) -> int:
        """Best fit in a shared chunk, or a fresh run of chunks; returns the virtual offset."""
        size = align_up(nbytes)
        if size < self.chunk:
            best = None
            for vc, sub in self._shared.items():
                hole = _best_hole(sub, size)
                if hole is not None and (best is None or (hole[0], vc) < (best[0], best[1])):
                    best = (hole[0], vc, hole[1])
            if best is not None:
                return self.alloc_at(best[1] * self.chunk + best[2], size, tag)
            count = 1
        else:
            count = -(-size // self.chunk)
        try:
            vchunk = self._virt.alloc(count * ALIGNMENT) // ALIGNMENT
        except PoolOutOfMemory:
            raise PoolOutOfMemory(size, self._in_use, 0, self.capacity - self._in_use, self.budget, tag) from None
        self._virt.free(vchunk * ALIGNMENT)
        return self.alloc_at(vchunk * self.chunk, size, tag)

    def alloc_at(self, offset: int, nbytes: int, tag: Hashable | None = None) -> int:
        """Claim exactly [offset, offset + align_up(nbytes)) (the executor's replay)."""
        size = align_up(nbytes)
        if offset < 0 or offset % ALIGNMENT:
            raise ValueError(f"alloc_at offset {offset} for tag {tag!r} is not a non-negative multiple of "
                             f"{ALIGNMENT}")
        vc, within = divmod(offset, self.chunk)
        if size < self.chunk and within + size <= self.chunk:
            sub = self._shared.get(vc)
            if sub is None:
                self._claim_virtual(vc, 1, offset, size, tag)
                try:
                    self._map(vc, 1, size, tag)
                except PoolOutOfMemory:
                    self._virt.free(vc * ALIGNMENT)
                    raise
                sub = self._shared[vc] = TensorPool(self.chunk)
            sub.alloc_at(within, size, tag)
            self._live[offset] = _Range(size, vc, 0, tag)
        else:
            if within:
                raise ValueError(f"alloc_at offset {offset} for tag {tag!r} ({format_bytes(size)}) is not at a "
                                 f"chunk boundary ({format_bytes(self.chunk)} chunks)")
            count = -(-size // self.chunk)
            self._claim_virtual(vc, count, offset, size, tag)
            try:
                self._map(vc, count, size, tag)
            except PoolOutOfMemory:
                self._virt.free(vc * ALIGNMENT)
                raise
            self._live[offset] = _Range(size, vc, count, tag)
        self._live_bytes += size
        self._live_peak = max(self._live_peak, self._live_bytes)
        self._rounded += -(-size // self.chunk) * self.chunk
        self.rounded_peak = max(self.rounded_peak, self._rounded)
        return offset

    def _claim_virtual(self, vc: int, count: int, offset: int, size: int, tag) -> None:
        try:
            self._virt.alloc_at(vc * ALIGNMENT, count * ALIGNMENT, tag)
        except ValueError:
            raise ValueError(f"alloc_at range [{offset}, {offset + size}) for tag {tag!r} is not free: virtual "
                             f"chunks {vc}..{vc + count - 1} are taken") from None

    def free(self, offset: int) -> None:
        r = self._live.pop(offset, None)
        if r is None:
            raise ValueError(f"free of unknown offset {offset}: no live range starts there")
        self._live_bytes -= r.size
        self._rounded -= -(-r.size // self.chunk) * self.chunk
        if r.nchunks:
            self._unmap(r.vchunk, r.nchunks)
            self._virt.free(r.vchunk * ALIGNMENT)
            return
        sub = self._shared[r.vchunk]
        sub.free(offset - r.vchunk * self.chunk)
        if len(sub) == 0:
            del self._shared[r.vchunk]
            self._unmap(r.vchunk, 1)
            self._virt.free(r.vchunk * ALIGNMENT)

    @property
    def live_bytes(self) -> int:
        """Live bytes, 512-aligned (a contiguous pool's in_use)."""
        return self._live_bytes

    @property
    def live_peak(self) -> int:
        return self._live_peak

    @property
    def largest_free_block(self) -> int:
        """The largest request that can succeed now: every free chunk behind one virtual range."""
        holes = [sub.largest_free_block for sub in self._shared.values()]
        return max([self.free_bytes] + holes)

    def free_below(self, limit: int) -> int:
        """The largest request that fits while mapped chunks stay within `limit` bytes."""
        room = max(0, min(limit, self.capacity) // self.chunk * self.chunk - self._in_use)
        holes = [sub.largest_free_block for sub in self._shared.values()]
        return max([room] + holes)

    def arena_end(self) -> int:
        """One past the highest physical byte mapped now."""
        return (max(self._phys.values()) + 1) * self.chunk if self._phys else 0

    def view(self, offset: int, shape, dtype) -> np.ndarray:
        """An array aliasing the live tensor at `offset` (no copy)."""
        if self.arena is None:
            raise RuntimeError("this paged pool has no backing memory (planning/simulation only): nothing to view")
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = int(math.prod(shp)) * dt.itemsize
        r = self._live_block(offset)
        if nbytes > r.size:
            raise ValueError(f"cannot view {shp} {dt} ({nbytes} bytes) at offset {offset}: the live range there "
                             f"(tag {r.tag!r}) holds only {r.size} bytes")
        return self.arena.view_at(offset, shp, dt)

    def close(self) -> None:
        if self.arena is not None and hasattr(self.arena, "close"):
            self.arena.close()

    def __repr__(self) -> str:
        return (f"PagedPool(chunks={self.n_chunks} x {format_bytes(self.chunk)}, in_use={format_bytes(self._in_use)},"
                f" live={len(self._live)})")


def _best_hole(sub: TensorPool, size: int) -> tuple[int, int] | None:
    """(hole size, offset) of the smallest hole of `sub` holding `size` bytes, or None."""
    best = None
    for b in sub.free_blocks():
        if b.size >= size and (best is None or b.size < best[0]):
            best = (b.size, b.offset)
    return best


def paged_capacity(sizes: list[int], chunk: int) -> int:
    """An arena no paged plan of `sizes` can exceed: every tensor in its own chunks at once."""
    return sum(-(-align_up(s) // chunk) for s in sizes) * chunk + chunk
