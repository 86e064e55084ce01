"""The paged pool (`--paged`): chunks mapped behind virtual ranges, for any policy.

What must hold: small tensors share chunks, large ones own whole runs; the arena a plan needs is its peak of
mapped chunks (at most the peak of live chunk-rounded bytes, at least the live bytes); the memfd backing really
maps pages (one physical chunk seen at two virtual places); a compiled step replays the mappings. Every policy
under `--paged` trains `none`'s bits at the plan's peak: tests/runtime/test_policy_matrix.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import minidl as dl
from minidl.backend.cpu.paged import MemfdArena
from minidl.memory.paged import PagedPool
from minidl.memory.pool import PoolOutOfMemory
from tests.planning import planned

from . import nets
from .nets import NETS, opt

CHUNK = 4096


def test_small_tensors_share_a_chunk_large_ones_own_runs():
    pool = PagedPool(8 * CHUNK, CHUNK)
    a = pool.alloc(100, "a")
    b = pool.alloc(1000, "b")
    assert a // CHUNK == b // CHUNK and pool.in_use == CHUNK      # one shared chunk
    big = pool.alloc(2 * CHUNK + 1, "big")
    assert big % CHUNK == 0 and pool.in_use == 4 * CHUNK          # 3 chunks of its own
    assert pool.live_bytes == 512 + 1024 + 2 * CHUNK + 512
    pool.free(a)
    assert pool.in_use == 4 * CHUNK                                # b still holds the shared chunk
    pool.free(b)
    assert pool.in_use == 3 * CHUNK
    assert pool.peak == pool.arena_end() == 4 * CHUNK              # chunk 0 is free again: the arena keeps its top
    with pytest.raises(PoolOutOfMemory):
        pool.alloc(6 * CHUNK, "too big")
    assert pool.in_use == 3 * CHUNK


def test_no_fragmentation_a_free_chunk_is_usable_anywhere():
    """Alternate frees leave holes a contiguous pool could not use for a big tensor; the paged pool can."""
    pool = PagedPool(8 * CHUNK, CHUNK)
    offs = [pool.alloc(CHUNK, f"t{i}") for i in range(8)]
    for o in offs[::2]:
        pool.free(o)
    pool.alloc(4 * CHUNK, "big")                                   # four scattered physical chunks
    assert pool.in_use == 8 * CHUNK


def test_alloc_at_replays_and_refuses_overlaps():
    pool, replay = PagedPool(8 * CHUNK, CHUNK), PagedPool(8 * CHUNK, CHUNK)
    for n in (100, 3 * CHUNK, 700, CHUNK):
        off = pool.alloc(n, n)
        assert replay.alloc_at(off, n, n) == off
    assert replay.in_use == pool.in_use and replay.peak == pool.peak
    with pytest.raises(ValueError, match="not free"):
        replay.alloc_at(CHUNK, CHUNK, "clash")
    with pytest.raises(ValueError, match="multiple of 512"):
        PagedPool(8 * CHUNK, 1000)


def test_memfd_arena_maps_real_pages():
    arena = MemfdArena(4 * CHUNK, CHUNK, 16 * CHUNK)
    try:
        arena.map(5, 2, 1)
        v = arena.view_at(5 * CHUNK, (CHUNK // 4,), np.float32)
        v[:] = np.arange(CHUNK // 4, dtype=np.float32)
        arena.map(9, 2, 1)                                          # the same physical chunk, elsewhere
        w = arena.view_at(9 * CHUNK, (CHUNK // 4,), np.float32)
        assert np.array_equal(w, np.arange(CHUNK // 4, dtype=np.float32))
        arena.unmap(5)
        assert arena.mapped == {9: 2}
        with pytest.raises(dl.MinidlError, match="page size"):
            MemfdArena(4 * CHUNK, 1536, 16 * CHUNK)
    finally:
        del v, w
        arena.close()


def test_arena_is_the_peak_of_live_chunks():
    contiguous = planned(NETS["resnet20"](), opt(), "liveness")
    paged = planned(NETS["resnet20"](), opt(), "liveness", paged=CHUNK)
    live = paged.paged.live_peak_bytes
    assert live == contiguous.peak_bytes
    assert paged.min_budget_bytes == paged.peak_bytes
    rounded = sum(-(-max(paged.sizes[t], 1) // CHUNK) * CHUNK for t in paged.peak_live)
    assert live <= paged.min_budget_bytes <= paged.paged.rounded_peak_bytes
    assert rounded <= paged.paged.rounded_peak_bytes
    assert paged.min_budget_bytes < contiguous.min_budget_bytes   # the contiguous pool's holes are gone


def _budget(key, policy):
    """The smallest budget `policy` accepts under --paged (None for policies that take none)."""
    if policy in ("none", "liveness"):
        return None
    try:
        planned(NETS[key](), opt(), policy, 1, paged=CHUNK)
    except dl.BudgetError as e:
        return e.min_budget_bytes
    return None


def train(key, policy, budget=None, paged=None, steps=3):
    return nets.train(key, policy, budget, steps=steps, n=16, debug=paged is None, paged=paged)


def test_out_of_chunks_leaves_the_pool_unchanged():
    pool = PagedPool(2 * CHUNK, CHUNK)
    pool.alloc(2 * CHUNK, "all")
    for n in (100, 3 * CHUNK):
        with pytest.raises(PoolOutOfMemory):
            pool.alloc(n, "more")
    assert len(pool) == 1 and pool.in_use == 2 * CHUNK and not pool._shared


def test_the_compiled_step_replays_the_mappings():
    """A paged plan lowered into the compiled step: each chunk mapping is a recorded call, run in order every
    step (that its parameters are `none`'s: tests/runtime/test_policy_matrix.py, runner `paged`)."""
    sess = train("resnet20", "window", _budget("resnet20", "window"), paged=CHUNK, steps=3)
    prog = sess.executor.program
    assert prog is not None and prog.kinds.get("map", 0) > 0 and prog.kinds.get("unmap", 0) > 0


def test_paged_and_contiguous_pools_share_their_queries():
    """size_of, tag_of, in_use, peak ... are one implementation for both pools (`pool.LiveQueries`), so an
    unknown offset is refused by both in the same words."""
    from minidl.memory.paged import PagedPool
    from minidl.memory.pool import LiveQueries, TensorPool

    for name in ("size_of", "tag_of", "__contains__", "__len__", "in_use", "peak", "reset_peak", "free_bytes"):
        assert name not in vars(PagedPool) and name not in vars(TensorPool), name
        assert getattr(PagedPool, name) is getattr(LiveQueries, name) is getattr(TensorPool, name), name
    for pool in (TensorPool(8 * 4096), PagedPool(8 * 4096, 4096)):
        off = pool.alloc(1000, tag="t")
        assert pool.size_of(off) == 1024 and pool.tag_of(off) == "t" and off in pool and len(pool) == 1
        with pytest.raises(ValueError, match="no live block starts at offset 7"):
            pool.size_of(7)


def test_chunk_for_budget():
    """The paper's chunk unless the budget holds fewer than 64 of them; then a power of two within 1/64 of it,
    never below the backend's least (a page multiple on the CPU, CUDA's granularity)."""
    from minidl.memory.paged import DEFAULT_CHUNK, chunk_for_budget

    assert chunk_for_budget(None) == chunk_for_budget(2 * 2**30) == DEFAULT_CHUNK
    assert chunk_for_budget(64 * 2**20) == 2**20 and chunk_for_budget(100 * 2**20) == 2**20
    assert chunk_for_budget(2 * 2**20) == 64 * 2**10 == chunk_for_budget(1000)
    assert chunk_for_budget(64 * 2**20, "cuda") == 2 * 2**20


def test_paged_options_never_change_the_cached_route():
    """`--paged` travels as a `PlanOptions` value on a copy of the route: the route `Network.route` caches (and
    every plan of the network shares) is left as it was, so a plan made without --paged afterwards does not
    turn an earlier paged plan's route into a contiguous one, and the other way round."""
    net = nets.NETS["dropnet"]()
    paged = planned(net, opt(), "liveness", paged=4096)
    cached = net.route(optimizer_slots=tuple(opt().slots))
    assert cached.options.paged_chunk is None and paged.route.options.paged_chunk == 4096
    plain = planned(net, opt(), "liveness")
    assert plain.paged is None and plain.route is cached
    assert paged.route.options.paged_chunk == 4096 and paged.paged is not None
    assert paged.route.memo is cached.memo   # placement options leave the route's analyses valid
