"""Tests of the tensor pool's arena allocator: exact offsets, then properties over random op sequences."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minidl.memory.pool import (
    ALIGNMENT,
    FreeBlock,
    LiveBlock,
    NumpyArenaBacking,
    PoolOutOfMemory,
    PoolStats,
    TensorPool,
    align_up,
    format_bytes,
    parse_size,
)

KiB = 1024
A = ALIGNMENT


def holes(pool: TensorPool) -> list[tuple[int, int]]:
    return [(f.offset, f.size) for f in pool.free_blocks()]


# ---------------------------------------------------------------------------------------------------------
# Exact offsets, no backing
# ---------------------------------------------------------------------------------------------------------

def test_fresh_pool_is_one_hole():
    pool = TensorPool(64 * KiB)
    assert pool.arena is None
    assert holes(pool) == [(0, 64 * KiB)]
    assert pool.in_use == 0 and pool.peak == 0
    assert pool.largest_free_block == pool.free_bytes == 64 * KiB
    assert pool.fragmentation == 0.0
    assert pool.live_blocks() == []
    pool.check()


def test_budget_accepts_size_strings_and_rounds_capacity_down():
    assert TensorPool("1 MiB").capacity == 1 << 20
    pool = TensorPool(100_000)  # not a multiple of 512: the tail (100000 % 512 = 160 bytes) is unusable
    assert pool.budget == 100_000
    assert pool.capacity == 100_000 // A * A
    assert holes(pool) == [(0, pool.capacity)]
    with pytest.raises(ValueError, match="smaller than one block"):
        TensorPool(100)


def test_alloc_splits_front_of_hole():
    pool = TensorPool(8 * A)
    assert pool.alloc(A, tag="a") == 0
    assert pool.alloc(2 * A, tag="b") == A
    assert holes(pool) == [(3 * A, 5 * A)]
    assert [tuple(b) for b in pool.live_blocks()] == [(0, A, "a"), (A, 2 * A, "b")]
    assert pool.live_blocks()[1] == LiveBlock(offset=A, size=2 * A, tag="b")
    assert pool.size_of(A) == 2 * A and pool.tag_of(A) == "b"
    assert pool.in_use == 3 * A
    pool.check()


def test_alignment_rounding():
    pool = TensorPool(16 * A)
    assert align_up(0) == A and align_up(1) == A and align_up(A) == A and align_up(A + 1) == 2 * A
    o0 = pool.alloc(1)
    o1 = pool.alloc(A + 1)
    o2 = pool.alloc(0)          # zero bytes still takes one unit, at a distinct offset
    o3 = pool.alloc(A)
    assert (o0, o1, o2, o3) == (0, A, 3 * A, 4 * A)
    assert [pool.size_of(o) for o in (o0, o1, o2, o3)] == [A, 2 * A, A, A]
    assert all(o % A == 0 for o in (o0, o1, o2, o3))
    assert pool.in_use == 5 * A
    with pytest.raises(ValueError, match="negative"):
        pool.alloc(-1)
    pool.check()


def _pool_with_holes(sizes_and_gaps, total):
    """Allocate alternating hole/spacer blocks, then free the holes. Returns pool and hole offsets."""
    pool = TensorPool(total)
    hole_offsets = []
    for hole in sizes_and_gaps:
        hole_offsets.append(pool.alloc(hole, tag="hole"))
        pool.alloc(A, tag="spacer")
    for o in hole_offsets:
        pool.free(o)
    return pool, hole_offsets


def test_best_fit_picks_smallest_fitting_hole():
    # holes of 4, 2, 3 units (separated by 1-unit spacers), then a big tail hole
    pool, offs = _pool_with_holes([4 * A, 2 * A, 3 * A], 32 * A)
    assert offs == [0, 5 * A, 8 * A]
    tail = 12 * A
    assert holes(pool) == [(0, 4 * A), (5 * A, 2 * A), (8 * A, 3 * A), (tail, 20 * A)]
    assert pool.alloc(3 * A) == 8 * A            # exact fit beats the bigger 4-unit hole and the tail
    assert pool.alloc(A + 1) == 5 * A            # rounds to 2 units: the 2-unit hole
    assert pool.alloc(A) == 0                    # only the 4 and tail holes remain: 4 is smaller
    assert holes(pool) == [(A, 3 * A), (tail, 20 * A)]
    assert pool.alloc(5 * A) == tail             # too big for every hole but the tail
    pool.check()


def test_best_fit_tie_goes_to_lowest_offset():
    pool, offs = _pool_with_holes([2 * A, 3 * A, 2 * A, 2 * A], 32 * A)
    lows = sorted(o for o, s in holes(pool) if s == 2 * A)
    assert len(lows) == 3
    assert pool.alloc(2 * A) == lows[0]
    assert pool.alloc(2 * A) == lows[1]
    assert pool.alloc(A) == lows[2]              # 1 unit: smallest fitting holes are the 2-unit ones
    pool.check()


def test_free_merges_with_left_neighbour():
    pool = TensorPool(4 * A)
    a, b, c = pool.alloc(A), pool.alloc(A), pool.alloc(A)
    pool.free(a)
    assert holes(pool) == [(0, A), (3 * A, A)]
    pool.free(b)                                 # left neighbour a is free: one hole [0, 2A)
    assert holes(pool) == [(0, 2 * A), (3 * A, A)]
    assert pool.size_of(c) == A
    pool.check()


def test_free_merges_with_right_neighbour():
    pool = TensorPool(4 * A)
    a, b, c, d = (pool.alloc(A) for _ in range(4))
    assert holes(pool) == []
    pool.free(c)
    pool.free(b)                                 # right neighbour c is free
    assert holes(pool) == [(A, 2 * A)]
    pool.check()


def test_free_merges_with_both_neighbours():
    pool = TensorPool(5 * A)
    a, b, c, d, e = (pool.alloc(A) for _ in range(5))
    pool.free(b)
    pool.free(d)
    assert holes(pool) == [(A, A), (3 * A, A)]
    pool.free(c)                                 # both sides free: three blocks become one
    assert holes(pool) == [(A, 3 * A)]
    assert pool.largest_free_block == 3 * A
    pool.check()


def test_freeing_everything_coalesces_to_one_block():
    pool = TensorPool(64 * A)
    offs = [pool.alloc(s * A, tag=i) for i, s in enumerate([1, 3, 2, 5, 1, 4, 7])]
    for o in offs[::2] + offs[1::2]:             # an order that creates holes first
        pool.free(o)
    assert holes(pool) == [(0, 64 * A)]
    assert pool.in_use == 0 and pool.fragmentation == 0.0
    pool.check()


def test_alloc_at_claims_exact_ranges():
    pool = TensorPool(16 * A)
    assert pool.alloc_at(4 * A, 2 * A, tag="mid") == 4 * A      # splits front and back leftovers
    assert holes(pool) == [(0, 4 * A), (6 * A, 10 * A)]
    assert pool.alloc_at(0, 4 * A, tag="front") == 0           # exactly fills the front hole
    assert pool.alloc_at(15 * A, 1, tag="last") == 15 * A      # rounds to A, end of the arena
    assert holes(pool) == [(6 * A, 9 * A)]
    assert pool.tag_of(4 * A) == "mid"
    pool.check()
    # a range overlapping a live block (partly or wholly) is refused and the message names the culprit
    with pytest.raises(ValueError, match="'mid'"):
        pool.alloc_at(5 * A, A)
    with pytest.raises(ValueError, match="'front'.*'mid'"):
        pool.alloc_at(3 * A, 2 * A)                           # straddles two live blocks
    with pytest.raises(ValueError, match="'last'"):
        pool.alloc_at(14 * A, 2 * A)                          # spans the hole's end into a live block
    with pytest.raises(ValueError, match="multiple of 512"):
        pool.alloc_at(6 * A + 1, A)
    with pytest.raises(ValueError, match="beyond"):
        pool.alloc_at(16 * A, A)
    pool.check()
    assert holes(pool) == [(6 * A, 9 * A)]                     # failed calls changed nothing
    pool.free(4 * A)
    assert holes(pool) == [(4 * A, 11 * A)]
    pool.check()


def test_alloc_at_then_alloc_uses_best_fit_among_leftovers():
    pool = TensorPool(16 * A)
    pool.alloc_at(3 * A, A)                      # leftovers: [0, 3A) and [4A, 16A)
    assert pool.alloc(2 * A) == 0
    assert pool.alloc(A) == 2 * A
    pool.check()


def test_out_of_memory_message_states_all_numbers():
    pool = TensorPool(4 * KiB)                   # 8 units
    a = pool.alloc(KiB, tag="a")
    b = pool.alloc(KiB, tag="b")
    pool.alloc(KiB, tag="c")
    pool.free(a)                                 # holes: [0, 1KiB) and [3KiB, 4KiB): 2 KiB free, fragmented
    with pytest.raises(PoolOutOfMemory) as info:
        pool.alloc(1500, tag="conv1:act")
    err = info.value
    assert isinstance(err, MemoryError)
    msg = str(err)
    for fragment in ["1.50 KiB (1536 bytes)",     # asked, rounded up
                     "2.00 KiB (2048 bytes) in use",
                     "largest free block 1.00 KiB (1024 bytes)",
                     "budget 4.00 KiB (4096 bytes)",
                     "'conv1:act'",
                     "fragmented"]:
        assert fragment in msg, (fragment, msg)
    assert (err.requested, err.in_use, err.largest_free, err.budget, err.tag) == (1536, 2048, 1024, 4096,
                                                                                    "conv1:act")
    assert pool.stats().failed_allocs == 1
    with pytest.raises(PoolOutOfMemory, match="not enough free memory"):
        pool.alloc(3 * KiB)
    pool.free(b)
    pool.check()


def test_double_free_and_unknown_offset():
    pool = TensorPool(8 * A)
    a = pool.alloc(A, tag="a")
    b = pool.alloc(2 * A, tag="b")
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a)
    with pytest.raises(ValueError, match="inside live block .* 'b'"):
        pool.free(b + A)
    with pytest.raises(ValueError, match="unknown offset"):
        pool.free(100 * A)
    with pytest.raises(ValueError, match="no live block"):
        pool.size_of(a)
    assert pool.size_of(b) == 2 * A
    pool.check()


def test_stats_peak_and_fragmentation():
    pool = TensorPool(10 * A)
    offs = [pool.alloc(A, tag=i) for i in range(6)]            # 6 units used, one 4-unit hole at the end
    assert pool.peak == 6 * A
    pool.free(offs[1])
    pool.free(offs[3])                           # holes: 1 + 1 + 4 units
    s = pool.stats()
    assert isinstance(s, PoolStats)
    assert (s.budget, s.capacity, s.in_use, s.peak, s.free_bytes) == (10 * A, 10 * A, 4 * A, 6 * A, 6 * A)
    assert s.largest_free_block == 4 * A
    assert s.fragmentation == pytest.approx(1 - 4 / 6)
    assert (s.live_blocks, s.free_blocks, s.allocs, s.frees, s.failed_allocs) == (4, 3, 6, 2, 0)
    assert "fragmentation 33.3%" in str(s)
    pool.reset_peak()
    assert pool.peak == 4 * A
    pool.alloc(A)
    assert pool.peak == 5 * A
    # completely full: nothing free, fragmentation defined as 0
    full = TensorPool(2 * A)
    full.alloc(2 * A)
    assert full.free_bytes == 0 and full.largest_free_block == 0 and full.fragmentation == 0.0
    assert full.free_blocks() == [] and isinstance(TensorPool(A).free_blocks()[0], FreeBlock)


def test_view_requires_backing_and_live_block():
    pool = TensorPool(8 * A)
    o = pool.alloc(64)
    with pytest.raises(RuntimeError, match="no backing"):
        pool.view(o, (4, 4), np.float32)
    pool = TensorPool(8 * A, backing=NumpyArenaBacking())
    assert isinstance(pool.arena, np.ndarray) and pool.arena.nbytes == 8 * A
    assert pool.arena.ctypes.data % 64 == 0
    o1 = pool.alloc(4 * 4 * 4, tag="x")
    o2 = pool.alloc(A, tag="y")
    x = pool.view(o1, (4, 4), np.float32)
    y = pool.view(o2, 128, "float32")
    assert x.shape == (4, 4) and x.dtype == np.float32 and y.shape == (128,)
    assert x.ctypes.data % 64 == 0 and y.ctypes.data - x.ctypes.data == o2 - o1
    assert np.shares_memory(x, pool.arena)
    x[...] = 1.0
    y[...] = 2.0
    np.testing.assert_array_equal(pool.view(o1, (16,), np.float32), np.ones(16, np.float32))
    with pytest.raises(ValueError, match="holds only"):
        pool.view(o2, (A + 1,), np.uint8)
    with pytest.raises(ValueError, match="no live block"):
        pool.view(o1 + 4, (2,), np.float32)


# ---------------------------------------------------------------------------------------------------------
# Properties over random operation sequences
# ---------------------------------------------------------------------------------------------------------

def brute_force_holes(live: list[tuple[int, int]], capacity: int) -> list[tuple[int, int]]:
    """Maximal free ranges, computed from live blocks only (nothing shared with the pool's bookkeeping)."""
    out, pos = [], 0
    for off, size in sorted(live):
        if off > pos:
            out.append((pos, off - pos))
        pos = off + size
    if pos < capacity:
        out.append((pos, capacity - pos))
    return out


# An op is (kind, nbytes, pick): kind 0-2 alloc, 3 alloc_at, 4-6 free; `pick` chooses which block to free
# or where to claim. Sizes skew small so pools fill up gradually (and fragment). Each op is drawn as ONE
# integer and decoded: hypothesis spends most of its time per draw, and this keeps 200-op runs cheap while
# still shrinking towards short runs of small allocations. The length is drawn first because hypothesis'
# own list lengths average only a handful of elements.
def decode_op(x: int) -> tuple[int, int, int]:
    kind, x = x % 7, x // 7
    small, x = x % 4 != 0, x // 4
    limit = 4 * A + 1 if small else 40 * A + 1
    return kind, x % limit, x // limit


ops_strategy = st.integers(1, 200).flatmap(
    lambda n: st.lists(st.integers(0, 2**48).map(decode_op), min_size=n, max_size=n))

budget_strategy = st.one_of(st.integers(1, 128).map(lambda n: n * A), st.integers(A, 128 * A))


def run_ops(pool: TensorPool, ops, on_alloc=None, after_op=None):
    """Apply ops, checking the pool against an independent model after each one."""
    model: dict[int, tuple[int, object]] = {}   # offset -> (size, tag)
    peak = 0
    next_tag = 0
    for kind, nbytes, pick in ops:
        size = align_up(nbytes)
        expected_holes = brute_force_holes([(o, s) for o, (s, _) in model.items()], pool.capacity)
        if kind <= 3 or not model:
            tag = next_tag
            next_tag += 1
            if kind == 3:
                # claim an aligned sub-range of a random hole (or an impossible range when none fits)
                fitting = [(o, s) for o, s in expected_holes if s >= size]
                if not fitting:
                    with pytest.raises(ValueError):
                        pool.alloc_at(0, nbytes, tag)
                    continue
                ho, hs = fitting[pick % len(fitting)]
                off = ho + (pick // 7 % ((hs - size) // A + 1)) * A
                assert pool.alloc_at(off, nbytes, tag) == off
            else:
                fitting = [(s, o) for o, s in expected_holes if s >= size]
                if not fitting:
                    with pytest.raises(PoolOutOfMemory):
                        pool.alloc(nbytes, tag)
                    continue
                off = pool.alloc(nbytes, tag)
                assert off == min(fitting)[1], "not the best fit (smallest hole, then lowest offset)"
            model[off] = (size, tag)
            if on_alloc:
                on_alloc(off, size, tag)
        else:
            off = sorted(model)[pick % len(model)]
            pool.free(off)
            del model[off]
        peak = max(peak, sum(s for s, _ in model.values()))

        live = pool.live_blocks()
        assert [(b.offset, b.size, b.tag) for b in live] == sorted((o, s, t) for o, (s, t) in model.items())
        for b, nxt in zip(live, live[1:]):
            assert b.offset + b.size <= nxt.offset                       # no overlap
        assert all(0 <= b.offset and b.offset + b.size <= pool.capacity for b in live)
        assert pool.in_use == sum(b.size for b in live)
        assert pool.peak == peak
        free = holes(pool)
        assert free == brute_force_holes([(b.offset, b.size) for b in live], pool.capacity)
        assert pool.largest_free_block == max((s for _, s in free), default=0)
        assert pool.free_bytes == pool.capacity - pool.in_use
        pool.check()
        if after_op:
            after_op(model)
    return model


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget=budget_strategy, ops=ops_strategy, order=st.randoms(use_true_random=False))
def test_random_ops_keep_invariants_and_coalesce(budget, ops, order):
    pool = TensorPool(budget)
    model = run_ops(pool, ops)
    offsets = list(model)
    order.shuffle(offsets)
    for o in offsets:
        pool.free(o)
    assert pool.in_use == 0
    assert holes(pool) == [(0, pool.capacity)]
    assert pool.largest_free_block == pool.capacity and pool.fragmentation == 0.0
    pool.check()


def pattern(tag: int, size: int) -> np.ndarray:
    """A byte pattern unique to the tag and varying along the block, so a shifted overlap is caught too."""
    return ((np.arange(size, dtype=np.int64) * 7 + tag * 131 + 17) % 251).astype(np.uint8)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget=budget_strategy, ops=ops_strategy)
def test_byte_patterns_survive_random_ops(budget, ops):
    pool = TensorPool(budget, backing=NumpyArenaBacking())
    pool.arena[...] = 0xFF

    expected: dict[int, np.ndarray] = {}     # tag -> the bytes its block must hold

    def fill(off, size, tag):
        expected[tag] = pattern(tag, size)
        pool.view(off, (size,), np.uint8)[...] = expected[tag]

    def verify(model):
        for off, (size, tag) in model.items():
            if not np.array_equal(pool.arena[off:off + size], expected[tag]):
                raise AssertionError(f"block at {off} (tag {tag}, {size} bytes) was overwritten")

    run_ops(pool, ops, on_alloc=fill, after_op=verify)


# ---------------------------------------------------------------------------------------------------------
# Human-readable sizes
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("1024", 1024), ("0", 0), ("512MiB", 512 * 2**20), ("12GB", 12 * 10**9), ("12GiB", 12 * 2**30),
    ("1.5 GiB", 3 * 2**29), ("64KiB", 64 * 1024), ("10MB", 10**7), ("100kB", 10**5), ("100 kb", 10**5),
    ("2tib", 2 * 2**40), ("1TB", 10**12), ("7 B", 7), ("  3 mib ", 3 * 2**20), ("0.5KiB", 512),
    (".5 KiB", 512), ("1.25MB", 1_250_000), ("4096b", 4096),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("7.02MiB", 7361024),           # 7361003.52 bytes, up to the next 512-byte unit
    ("1.5 B", 512), ("0.001 KB", 1), ("0.0001 KB", 512), ("16.49MiB", 17291264), ("1.001 KiB", 1536),
])
def test_parse_size_rounds_a_fraction_of_a_byte_up_to_the_pool_unit(text, expected):
    assert parse_size(text) == expected  # a whole number of bytes ("0.001 KB") stays as given


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**50))
def test_a_printed_size_parses_back_to_at_least_itself(n):
    """What minidl prints can be typed back: `--budget 7.02MiB` after "the smallest budget that works is 7.02 MiB"
    is never below the budget printed (format_bytes and parse_size both round up)."""
    text = format_bytes(n)
    for typed in (text, text.replace(" ", "")):
        back = parse_size(typed)
        unit = 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(text.split()[1])
        assert n <= back < n + unit // 100 + 512  # at most one hundredth of the unit and one pool unit above


def test_parse_size_passes_ints_through():
    assert parse_size(4096) == 4096
    assert parse_size(np.int64(4096)) == 4096 and type(parse_size(np.int64(4096))) is int


@pytest.mark.parametrize("text, match", [
    ("", "cannot parse"), ("MiB", "cannot parse"), ("-5MiB", "cannot parse"), ("1.5.2 GiB", "cannot parse"),
    ("12 GBs", "unknown unit"), ("3 PiB", "unknown unit"), ("5 Mi", "unknown unit"),
    ("1e3", "cannot parse"), ("12 G B", "cannot parse"),
])
def test_parse_size_rejects(text, match):
    with pytest.raises(ValueError, match=match):
        parse_size(text)


def test_parse_size_rejects_non_strings():
    for bad in (-1, None, 1.5, True):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (1572864, "1.50 MiB"), (12 * 2**30, "12.00 GiB"), (12 * 10**9, "11.18 GiB"), (2**40, "1.00 TiB"),
    (2048 * 2**40, "2048.00 TiB"), (-1536, "-1.50 KiB"), (2**20 - 1, "1.00 MiB"), (2**20 - 6, "1.00 MiB"),
    (2**20 - 11, "1023.99 KiB"), (17_283_072, "16.49 MiB"), (1025, "1.01 KiB"), (7_356_416, "7.02 MiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**50))
def test_format_bytes_is_close_and_in_range(n):
    number, unit = format_bytes(n).split()
    factor = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]
    shown = round(float(number) * 100) * factor  # 100 x the size shown, exactly
    assert 0 <= shown - 100 * n < factor                              # two decimals of the unit, rounded up
    assert unit == "TiB" or float(number) < 1024                    # the largest unit that keeps it < 1024
    assert unit == "B" or float(number) >= 1
