"""The host store on a stream backend (StreamTransfers), against a fake that behaves like a CUDA stream.

The fake (numpy only) keeps the properties the store relies on and nothing more: a copy is only *enqueued* by
`offload_async` / `prefetch_async`; its bytes land when the stream gets that far, which the fake makes happen at
a `transfer_wait` or `transfer_sync` on that handle or a later one (earlier copies first, in FIFO order); a
copy's times can be read only after the host synchronized with it, as cudaEventElapsedTime refuses events that
have not completed. Its clock advances a fixed amount per copy, so every time and stall is exact.

What must hold: round trips are exact; pinned buffers come from `host_empty`, once per tensor; the store's waits
are device-side (`transfer_wait`, never a host sync) and the host blocks only in `end_iteration`, which settles
and accounts every copy of the step (leftovers included, drained first); the disk tier and the misuse errors
work as on the thread engine.
"""
from __future__ import annotations

import numpy as np
import pytest

from minidl.backend import Capabilities, get_backend
from minidl.memory.host import HostStore, StreamTransfers, ThreadTransfers, TransferError

from .test_offload import assert_misuse_is_named

COPY_S = 0.25    # the fake's time per copy (a binary fraction: sums are exact)
T0 = 100.0       # the fake clock's origin, on the host's perf_counter scale


class FakeTransfer:
    def __init__(self, seq: int, kind: str, nbytes: int):
        self.seq, self.kind, self.nbytes = seq, kind, nbytes
        self.landed = False      # the stream has performed the copy
        self.synced = False      # the host knows it has (cudaEventSynchronize returned)
        self.waited = False      # the compute stream waits for it
        self.start = self.end = None

    def __repr__(self):
        return f"<{self.kind} #{self.seq}>"


class FakeStreamBackend:
    """A transfer stream: FIFO, lazy, with pinned-buffer allocation counted and deterministic times."""

    capabilities = Capabilities(name="fake", device="gpu", stream_copies=True)

    def __init__(self, stall_s: float = 0.0, fail_sync: int | None = None):
        self.stall_s = stall_s          # the stall reported for every copy the compute stream waited on
        self.fail_sync = fail_sync      # seq of a copy whose transfer_sync raises (a device error)
        self.queue: list[tuple[FakeTransfer, np.ndarray, np.ndarray]] = []
        self.handles: list[FakeTransfer] = []
        self.calls: list[tuple[str, FakeTransfer]] = []
        self.pinned: list[np.ndarray] = []
        self.clock = T0

    def host_empty(self, shape, dtype):
        a = np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 0, dtype)  # garbage until a copy lands
        self.pinned.append(a)
        return a

    def _enqueue(self, kind, src, dst):
        assert src.shape == dst.shape and src.dtype == dst.dtype and dst.flags.c_contiguous
        h = FakeTransfer(len(self.handles), kind, src.nbytes)
        self.handles.append(h)
        self.queue.append((h, src, dst))
        self.calls.append((f"{kind}_async", h))
        return h

    def offload_async(self, src, dst):
        assert isinstance(dst, np.ndarray), "the host side is a numpy array"
        return self._enqueue("offload", src, dst)

    def prefetch_async(self, src, dst):
        assert isinstance(src, np.ndarray), "the host side is a numpy array"
        return self._enqueue("prefetch", src, dst)

    def _run_through(self, h: FakeTransfer) -> None:
        """The stream reaches `h`: every copy queued up to it is performed, in order."""
        while self.queue and self.queue[0][0].seq <= h.seq:
            t, src, dst = self.queue.pop(0)
            np.copyto(dst, src)
            t.start, self.clock = self.clock, self.clock + COPY_S
            t.end, t.landed = self.clock, True

    def transfer_wait(self, h):
        self.calls.append(("transfer_wait", h))
        self._run_through(h)
        h.waited = True

    def transfer_sync(self, h):
        self.calls.append(("transfer_sync", h))
        if h.seq == self.fail_sync:
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
        self._run_through(h)
        for t in self.handles[:h.seq + 1]:
            t.synced = True

    def transfer_times(self, h):
        self.calls.append(("transfer_times", h))
        if not h.synced:
            raise RuntimeError(f"cudaErrorNotReady: {h} has not been synchronized")
        return h.start, h.end, self.stall_s if h.waited else 0.0

    def names(self, *kinds):
        return [(name, h.seq) for name, h in self.calls if name in kinds]


def _arrays(n=3, size=1000):
    rng = np.random.default_rng(0)
    return {f"t{i}": rng.standard_normal((size + i,)).astype(np.float32) for i in range(n)}


def _one_step(h: HostStore, arrays: dict, outs: dict | None = None) -> dict:
    """Offload every array, release them, prefetch them back in reverse (as backward does), wait for each."""
    for k, (tid, a) in enumerate(arrays.items()):
        h.offload(tid, a, k)
    for tid in arrays:
        h.wait_offload(tid)
    outs = outs if outs is not None else {tid: np.empty_like(a) for tid, a in arrays.items()}
    n = len(arrays)
    for k, tid in enumerate(reversed(list(arrays)), start=n):
        h.prefetch(tid, outs[tid], k)
        h.wait_prefetch(tid)
    return outs


# ---------------------------------------------------------------------------------------------------------
# Engine choice
# ---------------------------------------------------------------------------------------------------------

def test_the_backend_picks_the_engine():
    with HostStore() as h:
        assert isinstance(h.engine, ThreadTransfers)
    with HostStore(backend=get_backend("cpu")) as h:    # no stream copies: the host copies on a thread
        assert isinstance(h.engine, ThreadTransfers)
    fake = FakeStreamBackend()
    with HostStore(backend=fake) as h:
        assert isinstance(h.engine, StreamTransfers) and h.engine.backend is fake
        assert h._thread is None


# ---------------------------------------------------------------------------------------------------------
# Copies, waits and settling
# ---------------------------------------------------------------------------------------------------------

def test_round_trip_is_exact_through_pinned_buffers():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 100)).astype(np.float32)
    fake = FakeStreamBackend()
    with HostStore(backend=fake) as h:
        h.offload("a", a, 3)
        assert h.host_copy("a") is fake.pinned[0]
        assert np.isnan(h.host_copy("a")).all()          # enqueued, not landed: the store did not copy itself
        h.wait_offload("a")
        assert np.array_equal(h.host_copy("a"), a)
        back = np.zeros_like(a)
        h.prefetch("a", back, 7)
        assert not back.any()
        h.wait_prefetch("a")
        assert np.array_equal(back, a)
        h.end_iteration()


def test_pinned_buffers_are_allocated_once_and_reused():
    arrays = _arrays()
    fake = FakeStreamBackend()
    with HostStore(backend=fake) as h:
        bufs = None
        for it in range(3):
            shifted = {tid: a + it for tid, a in arrays.items()}
            outs = _one_step(h, shifted)
            h.end_iteration()
            for tid, a in shifted.items():
                assert np.array_equal(outs[tid], a)
            now = {tid: h.host_copy(tid) for tid in arrays}
            if bufs is not None:
                assert all(now[tid] is bufs[tid] for tid in arrays)
            bufs = now
        assert len(fake.pinned) == len(arrays)
        assert [b.shape for b in fake.pinned] == [a.shape for a in arrays.values()]
        assert all(any(b is p for p in fake.pinned) for b in bufs.values())
        assert h.stats().ram_bytes == sum(a.nbytes for a in arrays.values())


def test_waits_are_device_side_and_the_host_blocks_only_at_the_end():
    arrays = _arrays()
    fake = FakeStreamBackend()
    with HostStore(backend=fake) as h:
        _one_step(h, arrays)
        assert fake.names("transfer_sync", "transfer_times") == []      # no host sync during the step
        assert fake.names("transfer_wait") == [("transfer_wait", seq) for seq in range(6)]
        s = h.stats()
        assert (s.offloads, s.prefetches, s.transfer_time_s) == (0, 0, 0.0)   # not settled yet
        h.end_iteration()
        # every copy settled: synced before its times were read
        synced = set()
        for name, t in fake.calls:
            if name == "transfer_sync":
                synced.add(t.seq)
            elif name == "transfer_times":
                assert t.seq in synced
        assert sorted(seq for _, seq in fake.names("transfer_times")) == list(range(6))


def test_end_iteration_accounts_bytes_times_stalls_and_trace():
    arrays = _arrays()
    fake = FakeStreamBackend(stall_s=0.125)
    trace = []
    nbytes = sum(a.nbytes for a in arrays.values())
    with HostStore(t0=T0, trace=trace, backend=fake) as h:
        _one_step(h, arrays)
        h.end_iteration()
        s = h.stats()
        assert (s.iterations, s.offloads, s.prefetches) == (1, 3, 3)
        assert (s.offloaded_bytes, s.prefetched_bytes, s.spilled_bytes) == (nbytes, nbytes, 0)
        assert s.transfer_time_s == 6 * COPY_S
        assert s.stall_time_s == 6 * 0.125
        assert s.hidden_fraction == 1 - 0.125 / COPY_S
        assert s.bandwidth == 2 * nbytes / (6 * COPY_S)
    assert all(e.track == "transfer" and e.dur_s == COPY_S and e.in_use == -1 for e in trace)
    got = sorted((e.start_s, e.name, e.step) for e in trace)
    assert got == [(0.0, "offload t0", 0), (0.25, "offload t1", 1), (0.5, "offload t2", 2),
                   (0.75, "prefetch t2", 3), (1.0, "prefetch t1", 4), (1.25, "prefetch t0", 5)]


def test_leftovers_are_waited_then_settled_without_a_stall():
    """An evaluation offloads and never prefetches: end_iteration makes compute wait, then settles."""
    arrays = _arrays(2)
    fake = FakeStreamBackend(stall_s=0.125)
    with HostStore(backend=fake) as h:
        for k, (tid, a) in enumerate(arrays.items()):
            h.offload(tid, a, k)
        h.wait_offload("t0")
        assert h.in_flight == 1 and not fake.handles[1].landed
        h.end_iteration()
        assert h.in_flight == 0
        assert np.array_equal(h.host_copy("t1"), arrays["t1"])
        names = [(name, t.seq) for name, t in fake.calls if t.seq == 1]
        assert names == [("offload_async", 1), ("transfer_wait", 1), ("transfer_sync", 1), ("transfer_times", 1)]
        s = h.stats()
        assert s.offloads == 2 and s.transfer_time_s == 2 * COPY_S
        assert s.stall_time_s == 0.125     # only t0's: no step was waiting for the leftover


def test_a_device_error_surfaces_at_end_of_iteration_after_settling_the_rest():
    arrays = _arrays()
    fake = FakeStreamBackend(fail_sync=1)
    with HostStore(backend=fake) as h:
        _one_step(h, arrays)
        with pytest.raises(TransferError, match=r"offload of 't1' \(issued at step 1\) failed: RuntimeError: "
                                                r"cudaErrorIllegalAddress"):
            h.end_iteration()
        assert h.stats().offloads + h.stats().prefetches == 6    # every copy was still settled and counted
        assert sorted(seq for _, seq in fake.names("transfer_times")) == [0, 2, 3, 4, 5]


def test_a_refused_copy_is_named_at_once():
    class Refusing(FakeStreamBackend):
        def offload_async(self, src, dst):
            raise ValueError("host side of a transfer must be C-contiguous")

    with HostStore(backend=Refusing()) as h:
        with pytest.raises(TransferError, match=r"offload of 'a' \(issued at step 2\) failed: ValueError"):
            h.offload("a", np.ones(4, np.float32), 2)
        assert h.in_flight == 0


# ---------------------------------------------------------------------------------------------------------
# Disk tier, misuse, lifetime
# ---------------------------------------------------------------------------------------------------------

def test_disk_tier_with_a_stream_backend(tmp_path):
    arrays = {f"t{i}": np.full((128, 128), i, np.float32) for i in range(4)}
    limit = 2 * arrays["t0"].nbytes
    fake = FakeStreamBackend()
    with HostStore(limit_bytes=limit, spill_dir=tmp_path, backend=fake) as h:
        outs = _one_step(h, arrays)
        h.end_iteration()
        assert [h.on_disk(t) for t in arrays] == [False, False, True, True]
        assert isinstance(h.host_copy("t3"), np.memmap) and not isinstance(h.host_copy("t0"), np.memmap)
        assert len(fake.pinned) == 2 and h.host_copy("t1") is fake.pinned[1]    # pinned only for RAM buffers
        for tid, a in arrays.items():
            assert np.array_equal(outs[tid], a)
        s = h.stats()
        assert s.ram_bytes == limit and s.disk_bytes == 2 * arrays["t0"].nbytes
        assert s.spilled_bytes == 4 * arrays["t0"].nbytes  # two tensors, out and back


def test_misuse_is_named_on_a_stream_backend():
    fake = FakeStreamBackend()
    with HostStore(backend=fake) as h:
        assert_misuse_is_named(h)
        h.prefetch("x", np.zeros(3), 1)
        with pytest.raises(TransferError, match="prefetched twice"):
            h.prefetch("x", np.zeros(3), 1)
        h.end_iteration()
        with pytest.raises(TransferError, match="offloaded before as"):
            h.offload("x", np.zeros(5), 0)
    assert len(fake.handles) == 2      # the refused calls never reached the stream


def test_close_synchronizes_outstanding_copies():
    a = np.arange(100, dtype=np.float32)
    fake = FakeStreamBackend()
    h = HostStore(backend=fake)
    h.offload("a", a, 0)
    buf = h.host_copy("a")
    h.close()
    assert fake.names("transfer_sync") == [("transfer_sync", 0)] and np.array_equal(buf, a)
    with pytest.raises(TransferError, match="transfer stream is not running"):
        h.offload("b", a, 0)
    h.close()     # idempotent
    assert len(fake.names("transfer_sync")) == 1
