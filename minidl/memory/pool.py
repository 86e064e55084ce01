"""The unified tensor pool (SuperNeurons): one arena of `budget` bytes, carved by a best-fit coalescing allocator.

Rules: nothing allocates behind its back, so a plan that fits the pool fits the device; offsets only, the memory
behind them injected (`backing`, or none for planning); every block, even of zero bytes, rounds up to `ALIGNMENT`
and has its own offset; best fit, ties to the lowest offset, so the same requests give the same offsets; a freed
block merges with free neighbours in O(1). Not thread safe.
"""
from __future__ import annotations

import bisect
import math
import numbers
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Hashable, Iterator, Protocol

import numpy as np

from minidl.core.errors import MinidlError, OptionError
from minidl.core.guards import check_host_allocation
from minidl.core.units import format_bytes  # noqa: F401  (re-exported)

__all__ = [
    "ALIGNMENT", "ARENA_ALIGNMENT", "Block", "FreeBlock", "LiveBlock", "NumpyArenaBacking", "PoolOutOfMemory",
    "PoolStats", "TensorPool", "align_up", "format_bytes", "parse_size",
]

ALIGNMENT = 512
"""Bytes: every block's size and start are multiples (kernels want aligned inputs; few hole sizes reuse better)."""

ARENA_ALIGNMENT = 64
"""Bytes: the arena's base address alignment (a cache line, enough for any SIMD load)."""



_UNIT_FACTORS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}

_SIZE_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[a-zA-Z]*)\s*$")


def as_size(value: str | int | None, option: str) -> int | None:
    """`parse_size` for a user-facing option: None stays None, a bad value raises `OptionError` naming `option`."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise OptionError(f"{option}: {e}") from None


def _bytes_both(n: int) -> str:
    """"1.50 MiB (1572864 bytes)": units to read, bytes to grep."""
    return f"{format_bytes(n)} ({n} bytes)"


def parse_size(s: str | int) -> int:
    """Bytes from "512MiB", "12GB", "1.5 GiB" or an int. KB/MB/GB/TB are decimal, KiB/MiB/GiB/TiB binary, "mb"
    is megabytes. Fractions are exact; a fractional byte count rounds *up* to `ALIGNMENT`, so a size minidl printed
    (rounded up by `format_bytes`) is never less than what it stood for."""
    if isinstance(s, (bool, np.bool_)):
        raise OptionError(f"not a memory size: {s!r}")
    if isinstance(s, numbers.Integral):  # numpy's integers too
        if s < 0:
            raise OptionError(f"a memory size cannot be negative, got {s}")
        return int(s)
    if not isinstance(s, str):
        raise OptionError(f"not a memory size: {s!r} (expected a string such as '512MiB' or an int)")
    m = _SIZE_RE.match(s)
    if m is None:
        raise OptionError(
            f"cannot parse memory size {s!r}: expected a non-negative number and an optional unit, "
            f"e.g. '1024', '64KiB', '1.5 GiB', '12GB'")
    unit = m.group("unit").lower()
    if unit not in _UNIT_FACTORS:
        raise OptionError(
            f"unknown unit {m.group('unit')!r} in memory size {s!r}: use B, KB, MB, GB, TB (powers of 1000) "
            f"or KiB, MiB, GiB, TiB (powers of 1024)")
    exact = Fraction(m.group("num")) * _UNIT_FACTORS[unit]
    if exact.denominator != 1:
        return -(-math.ceil(exact) // ALIGNMENT) * ALIGNMENT
    return int(exact)


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """The bytes the pool reserves for `nbytes`: rounded up to `alignment`, at least one unit."""
    if nbytes < 0:
        raise ValueError(f"cannot allocate a negative number of bytes ({nbytes})")
    return max(alignment, -(-nbytes // alignment) * alignment)



class ArenaBacking(Protocol):
    """Whatever provides the arena's real memory. The pool calls `allocate` exactly once."""

    def allocate(self, nbytes: int) -> Any: ...


class NumpyArenaBacking:
    """Host memory for the CPU backend: a uint8 buffer over-allocated so its base is `ARENA_ALIGNMENT`-aligned."""

    def allocate(self, nbytes: int) -> np.ndarray:
        check_host_allocation(nbytes, "the tensor pool's arena")
        raw = np.empty(nbytes + ARENA_ALIGNMENT, dtype=np.uint8)
        pad = (-raw.ctypes.data) % ARENA_ALIGNMENT
        arena = raw[pad:pad + nbytes]
        assert arena.ctypes.data % ARENA_ALIGNMENT == 0
        return arena



@dataclass(slots=True, eq=False)
class Block:
    """One contiguous range of the arena, free or live; `prev`/`next` (address neighbours) stay out of repr."""

    offset: int
    size: int
    free: bool
    tag: Hashable | None = None
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(slots=True, frozen=True)
class LiveBlock:
    """An allocated block as reports see it. Unpacks as `offset, size, tag`."""

    offset: int
    size: int
    tag: Hashable | None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.offset, self.size, self.tag))


@dataclass(slots=True, frozen=True)
class FreeBlock:
    """A free hole of the arena. Unpacks as `offset, size`."""

    offset: int
    size: int

    def __iter__(self) -> Iterator[int]:
        return iter((self.offset, self.size))


@dataclass(slots=True, frozen=True)
class PoolStats:
    """A snapshot of the pool, in bytes."""

    budget: int
    capacity: int               # budget rounded down to ALIGNMENT
    in_use: int                 # live blocks, rounded sizes
    peak: int                   # max in_use since construction or reset_peak()
    free_bytes: int
    largest_free_block: int
    fragmentation: float
    live_blocks: int
    free_blocks: int
    allocs: int
    frees: int
    failed_allocs: int

    def __str__(self) -> str:
        return (f"pool: {format_bytes(self.in_use)} in use of {format_bytes(self.capacity)} "
                f"(peak {format_bytes(self.peak)}), {self.live_blocks} live / {self.free_blocks} free blocks, "
                f"largest free {format_bytes(self.largest_free_block)}, "
                f"fragmentation {self.fragmentation:.1%}")


class PoolOutOfMemory(MinidlError, MemoryError):
    """No free block is large enough; the message says whether the budget is too small or fragmented."""

    def __init__(self, requested: int, in_use: int, largest_free: int, free_bytes: int, budget: int,
                 tag: Hashable | None):
        self.requested = requested
        self.in_use = in_use
        self.largest_free = largest_free
        self.free_bytes = free_bytes
        self.budget = budget
        self.tag = tag
        if requested > free_bytes:
            why = "not enough free memory in total"
        else:
            why = ("enough memory is free in total, but it is fragmented: no single hole is large enough")
        super().__init__(
            f"tensor pool out of memory allocating {_bytes_both(requested)} for tag {tag!r}: "
            f"{_bytes_both(in_use)} in use, {_bytes_both(free_bytes)} free, "
            f"largest free block {_bytes_both(largest_free)}, budget {_bytes_both(budget)} ({why})")



class LiveQueries:
    """Queries over `_live` (offset -> record with `.size`, `.tag`), `_in_use`, `_peak` and `capacity`, shared by
    `TensorPool` and `paged.PagedPool` so both answer the same way."""

    _live: dict
    _in_use: int
    _peak: int
    capacity: int

    def size_of(self, offset: int) -> int:
        return self._live_block(offset).size

    def tag_of(self, offset: int) -> Hashable | None:
        return self._live_block(offset).tag

    def _live_block(self, offset: int):
        try:
            return self._live[offset]
        except KeyError:
            raise ValueError(f"no live block starts at offset {offset}") from None

    def __contains__(self, offset: object) -> bool:
        return offset in self._live

    def __len__(self) -> int:
        return len(self._live)

    @property
    def in_use(self) -> int:
        """Bytes counted as used: live blocks with their padding (the paged pool: mapped chunks)."""
        return self._in_use

    @property
    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._in_use

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._in_use


class TensorPool(LiveQueries):
    """A best-fit, coalescing allocator over `budget` bytes; with no `backing` it only does the arithmetic."""

    def __init__(self, budget: int | str, backing: ArenaBacking | None = None):
        self.budget = parse_size(budget)
        self.capacity = self.budget // ALIGNMENT * ALIGNMENT
        if self.capacity == 0:
            raise OptionError(f"pool budget {_bytes_both(self.budget)} is smaller than one block "
                              f"({ALIGNMENT} bytes)")
        self.arena = backing.allocate(self.capacity) if backing is not None else None
        # merges keep the left block, so offset 0's block is a stable head
        self._head = Block(offset=0, size=self.capacity, free=True)
        self._live: dict[int, Block] = {}
        self._free: dict[int, Block] = {}            # offset -> free block
        self._free_by_size: list[tuple[int, int]] = []   # sorted (size, offset): best fit is one bisect
        self._free_starts: list[int] = []            # sorted offsets of free blocks
        self._index_add(self._head)
        self._in_use = 0
        self._peak = 0
        self._allocs = 0
        self._frees = 0
        self._failed = 0

    def _index_add(self, block: Block) -> None:
        bisect.insort(self._free_by_size, (block.size, block.offset))
        bisect.insort(self._free_starts, block.offset)
        self._free[block.offset] = block

    def _index_remove(self, block: Block) -> None:
        # before the block's size or offset change: the keys are the current ones
        i = bisect.bisect_left(self._free_by_size, (block.size, block.offset))
        del self._free_by_size[i]
        j = bisect.bisect_left(self._free_starts, block.offset)
        del self._free_starts[j]
        del self._free[block.offset]

    @staticmethod
    def _split(block: Block, at: int) -> Block:
        """Cut `block` at `at`: it keeps the front, the new block returned is the back."""
        back = Block(offset=at, size=block.end - at, free=block.free, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = back
        block.next = back
        block.size = at - block.offset
        return back

    def _carve(self, hole: Block, offset: int, size: int, tag: Hashable | None) -> int:
        self._index_remove(hole)
        block = hole
        if offset > hole.offset:             # alloc_at only
            block = self._split(hole, offset)
            self._index_add(hole)
        if block.size > size:
            self._index_add(self._split(block, offset + size))
        block.free = False
        block.tag = tag
        self._live[offset] = block
        self._in_use += size
        self._peak = max(self._peak, self._in_use)
        self._allocs += 1
        return offset

    def _hole_containing(self, offset: int) -> Block | None:
        i = bisect.bisect_right(self._free_starts, offset) - 1
        if i < 0:
            return None
        hole = self._free[self._free_starts[i]]
        return hole if offset < hole.end else None

    def _blocks(self) -> Iterator[Block]:
        b: Block | None = self._head
        while b is not None:
            yield b
            b = b.next

    def alloc(self, nbytes: int, tag: Hashable | None = None) -> int:
        """Reserve `align_up(nbytes)` in the smallest hole, lowest offset first; raises `PoolOutOfMemory`."""
        size = align_up(nbytes)
        i = bisect.bisect_left(self._free_by_size, (size, -1))
        if i == len(self._free_by_size):
            self._failed += 1
            raise PoolOutOfMemory(size, self._in_use, self.largest_free_block, self.free_bytes, self.budget,
                                  tag)
        _, offset = self._free_by_size[i]
        return self._carve(self._free[offset], offset, size, tag)

    def alloc_at(self, offset: int, nbytes: int, tag: Hashable | None = None) -> int:
        """Claim exactly [offset, offset + align_up(nbytes)): the executor replays a plan's offsets, so a plan that
        disagrees with the pool raises instead of corrupting a tensor."""
        size = align_up(nbytes)
        if offset < 0 or offset % ALIGNMENT:
            raise ValueError(f"alloc_at offset {offset} for tag {tag!r} is not a non-negative multiple of "
                             f"{ALIGNMENT}")
        if offset + size > self.capacity:
            raise ValueError(f"alloc_at range [{offset}, {offset + size}) for tag {tag!r} ends beyond the "
                             f"pool capacity {_bytes_both(self.capacity)}")
        hole = self._hole_containing(offset)
        if hole is None or offset + size > hole.end:
            clash = [b for b in self._live.values() if b.offset < offset + size and offset < b.end]
            clash.sort(key=lambda b: b.offset)
            desc = ", ".join(f"[{b.offset}, {b.end}) tag {b.tag!r}" for b in clash[:5])
            if len(clash) > 5:
                desc += f", ... ({len(clash)} blocks)"
            raise ValueError(f"alloc_at range [{offset}, {offset + size}) ({_bytes_both(size)}) for tag {tag!r} "
                             f"is not free: it overlaps live block(s) {desc}")
        return self._carve(hole, offset, size, tag)

    def free(self, offset: int) -> None:
        """Release the block at `offset`, merging free neighbours."""
        block = self._live.pop(offset, None)
        if block is None:
            hole = self._hole_containing(offset)
            if hole is not None:
                raise ValueError(f"double free: offset {offset} is already free (inside free block "
                                 f"[{hole.offset}, {hole.end}))")
            inside = next((b for b in self._live.values() if b.offset < offset < b.end), None)
            where = (f"it lies inside live block [{inside.offset}, {inside.end}) tag {inside.tag!r}"
                     if inside is not None else f"it is outside the pool [0, {self.capacity})")
            raise ValueError(f"free of unknown offset {offset}: no live block starts there; {where}")
        self._in_use -= block.size
        self._frees += 1
        block.free = True
        block.tag = None
        prev, nxt = block.prev, block.next
        if prev is not None and prev.free:       # the left neighbour survives
            self._index_remove(prev)
            prev.size += block.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        if nxt is not None and nxt.free:
            self._index_remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        self._index_add(block)

    @property
    def largest_free_block(self) -> int:
        return self._free_by_size[-1][0] if self._free_by_size else 0

    @property
    def fragmentation(self) -> float:
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free_block / free

    def live_blocks(self) -> list[LiveBlock]:
        return [LiveBlock(b.offset, b.size, b.tag) for b in self._blocks() if not b.free]

    def free_blocks(self) -> list[FreeBlock]:
        return [FreeBlock(b.offset, b.size) for b in self._blocks() if b.free]

    def stats(self) -> PoolStats:
        return PoolStats(budget=self.budget, capacity=self.capacity, in_use=self._in_use, peak=self._peak,
                         free_bytes=self.free_bytes, largest_free_block=self.largest_free_block,
                         fragmentation=self.fragmentation, live_blocks=len(self._live),
                         free_blocks=len(self._free), allocs=self._allocs, frees=self._frees,
                         failed_allocs=self._failed)

    def check(self) -> None:
        """Assert every invariant: blocks tile the capacity, linked, aligned, no free neighbours, indexes agree."""
        pos, prev, live_bytes, n_live, free_seen = 0, None, 0, 0, []
        for b in self._blocks():
            assert b.prev is prev, f"broken prev link at {b.offset}"
            assert b.offset == pos, f"gap or overlap at {pos}: next block starts at {b.offset}"
            assert b.size > 0 and b.offset % ALIGNMENT == 0 and b.size % ALIGNMENT == 0, f"bad block {b}"
            if b.free:
                assert prev is None or not prev.free, f"adjacent free blocks at {b.offset}"
                assert self._free.get(b.offset) is b, f"free block {b} not indexed"
                free_seen.append((b.size, b.offset))
            else:
                assert self._live.get(b.offset) is b, f"live block {b} not indexed"
                live_bytes += b.size
                n_live += 1
            pos, prev = b.end, b
        assert pos == self.capacity, f"blocks end at {pos}, capacity is {self.capacity}"
        assert n_live == len(self._live) and live_bytes == self._in_use
        assert sorted(free_seen) == self._free_by_size
        assert [o for _, o in free_seen] == self._free_starts and len(free_seen) == len(self._free)
        assert self._peak >= self._in_use

    def view(self, offset: int, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
        """An array aliasing the live block at `offset` (no copy); freed or too-small memory raises."""
        if self.arena is None:
            raise RuntimeError("this pool has no backing memory (planning/simulation only): nothing to view")
        is_numpy = isinstance(self.arena, np.ndarray)
        if not is_numpy and not hasattr(self.arena, "view_at"):
            raise TypeError(f"view() needs a numpy arena or one with view_at(offset, shape, dtype); this pool's "
                            f"arena is a {type(self.arena).__name__}")
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = int(math.prod(shp)) * dt.itemsize
        block = self._live.get(offset)
        if block is None:
            raise ValueError(f"cannot view offset {offset}: no live block starts there")
        if nbytes > block.size:
            raise ValueError(f"cannot view {shp} {dt} ({_bytes_both(nbytes)}) at offset {offset}: the live "
                             f"block there (tag {block.tag!r}) holds only {_bytes_both(block.size)}")
        if not is_numpy:
            return self.arena.view_at(offset, shp, dt)
        return self.arena[offset:offset + nbytes].view(dt).reshape(shp)

    def __repr__(self) -> str:
        return (f"TensorPool(budget={format_bytes(self.budget)}, in_use={format_bytes(self._in_use)}, "
                f"live={len(self._live)}, free_holes={len(self._free)})")
