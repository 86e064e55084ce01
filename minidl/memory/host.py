"""The host store (one reused host buffer per offloaded tensor) and the two engines that copy.

Rules: starting a copy never waits; the executor waits at the plan's RELEASE (`wait_offload`, before freeing the
block) and WAIT (`wait_prefetch`, before a kernel reads it). Copies run in issue order on one FIFO stream, as the
simulator assumes. A failed copy raises `TransferError` at its next wait, else at `end_iteration`. On the CPU a wait
blocks the host; on CUDA it is device-side (a blocked host would starve the compute stream) and the host blocks
once a step. Past `limit_bytes`, buffers live in a memory-mapped temporary file (pages the kernel can write back).
"""
from __future__ import annotations

import mmap
import os
import queue
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..core.errors import MinidlError, OptionError
from ..core.units import format_bytes
from ..core.vocab import TraceEvent

__all__ = ["HostStore", "StreamTransfers", "ThreadTransfers", "TransferEngine", "TransferError", "TransferStats",
           "transfer_json"]

_PAGE = max(mmap.ALLOCATIONGRANULARITY, 4096)


class TransferError(MinidlError, RuntimeError):
    """A host <-> device copy failed, or the plan asked for a wait that has no copy behind it."""


@dataclass(slots=True, eq=False)
class _Job:
    """One copy until settled; times on the `time.perf_counter` clock; a `leftover`'s stall is not counted."""

    kind: str                 # "offload" (device -> host) or "prefetch" (host -> device)
    tensor: str
    src: np.ndarray
    dst: np.ndarray
    step: int
    nbytes: int
    handle: Any = None
    submitted: float = 0.0
    start: float = 0.0
    end: float = 0.0
    stall: float = 0.0
    leftover: bool = False
    error: BaseException | None = None


def _failure(job: _Job, error: BaseException) -> TransferError:
    return TransferError(f"{job.kind} of '{job.tensor}' (issued at step {job.step}) failed: "
                         f"{type(error).__name__}: {error}")



class TransferEngine(Protocol):
    """Buffers, and copies to start, wait on and settle (times and error final)."""

    name: str            # for messages
    times_at_wait: bool  # a copy's times are known when `wait` returns

    def empty(self, shape, dtype) -> np.ndarray: ...
    def start(self, job: _Job) -> None: ...
    def wait(self, job: _Job) -> None: ...
    def settle(self, job: _Job) -> None: ...
    @property
    def alive(self) -> bool: ...
    def close(self) -> None: ...


def _worker(jobs: "queue.Queue[_Job | None]") -> None:
    """Copy jobs in FIFO order until `None` (holding no engine reference, so it can be collected)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        job.start = time.perf_counter()
        try:
            np.copyto(job.dst, job.src, casting="no")  # releases the GIL for the whole copy
        except BaseException as e:  # noqa: BLE001 - raised in the executor's thread
            job.error = e
        job.end = time.perf_counter()
        job.handle.set()


def _stop_worker(jobs: "queue.Queue[_Job | None]", thread: threading.Thread) -> None:
    jobs.put(None)  # behind every queued copy
    if thread is not threading.current_thread():
        thread.join(timeout=30)


class ThreadTransfers:
    """Copies on one worker thread (`np.copyto` releases the GIL); a wait blocks the host, its time the stall."""

    name = "transfer thread"
    times_at_wait = True

    def __init__(self):
        self._jobs: "queue.Queue[_Job | None]" = queue.Queue()
        self.thread = threading.Thread(target=_worker, args=(self._jobs,), name="minidl-transfer", daemon=True)
        self.thread.start()
        self._finalizer = weakref.finalize(self, _stop_worker, self._jobs, self.thread)

    def empty(self, shape, dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def start(self, job: _Job) -> None:
        job.handle = threading.Event()
        self._jobs.put(job)

    def wait(self, job: _Job) -> None:
        t = time.perf_counter()
        while not job.handle.wait(timeout=1.0):
            if not self.thread.is_alive():
                raise TransferError(f"the transfer thread died before the {job.kind} of '{job.tensor}' landed")
        job.stall = time.perf_counter() - t

    def settle(self, job: _Job) -> None:
        pass  # the copy landed before `wait` returned

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def close(self) -> None:
        self._finalizer()


def _sync_outstanding(backend, outstanding: dict) -> None:
    for handle in list(outstanding.values()):
        backend.transfer_sync(handle)
    outstanding.clear()


class StreamTransfers:
    """Copies on the backend's transfer stream between pinned buffers; `settle` syncs and reads device times."""

    name = "transfer stream"
    times_at_wait = False

    def __init__(self, backend):
        self.backend = backend
        self._outstanding: dict[int, Any] = {}  # id(job) -> handle, until settled
        self._finalizer = weakref.finalize(self, _sync_outstanding, backend, self._outstanding)
        self._finalizer.atexit = False  # the device goes away with the process

    def empty(self, shape, dtype) -> np.ndarray:
        return self.backend.host_empty(shape, dtype)

    def start(self, job: _Job) -> None:
        copy = self.backend.offload_async if job.kind == "offload" else self.backend.prefetch_async
        job.handle = copy(job.src, job.dst)
        self._outstanding[id(job)] = job.handle

    def wait(self, job: _Job) -> None:
        self.backend.transfer_wait(job.handle)

    def settle(self, job: _Job) -> None:
        self._outstanding.pop(id(job), None)
        try:
            self.backend.transfer_sync(job.handle)
            job.start, job.end, job.stall = self.backend.transfer_times(job.handle)
        except Exception as e:  # noqa: BLE001 - the store raises it as a TransferError
            job.error = e

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def forget(self, job: _Job) -> None:
        """Drop a copy captured in a CUDA graph (its events are the graph's)."""
        self._outstanding.pop(id(job), None)

    def close(self) -> None:
        """Wait for every copy on the stream: none may outlive its buffers."""
        self._finalizer()



def _close_spill(spill: list) -> None:
    for f in spill:
        try:
            f.close()  # a TemporaryFile: closing deletes it
        except OSError:
            pass
    spill.clear()


@dataclass(slots=True)
class TransferStats:

    iterations: int = 0
    offloads: int = 0
    prefetches: int = 0
    offloaded_bytes: int = 0
    prefetched_bytes: int = 0
    transfer_time_s: float = 0.0   # copying
    stall_time_s: float = 0.0      # the consumer (host or compute stream) waiting for a copy
    ram_bytes: int = 0             # host buffers in RAM
    disk_bytes: int = 0            # host buffers in the spill file
    spilled_bytes: int = 0         # copied to or from the spill file

    @property
    def moved_bytes(self) -> int:
        return self.offloaded_bytes + self.prefetched_bytes

    def since(self, earlier: TransferStats) -> TransferStats:
        return TransferStats(self.iterations - earlier.iterations, self.offloads - earlier.offloads,
                             self.prefetches - earlier.prefetches, self.offloaded_bytes - earlier.offloaded_bytes,
                             self.prefetched_bytes - earlier.prefetched_bytes,
                             self.transfer_time_s - earlier.transfer_time_s, self.stall_time_s - earlier.stall_time_s,
                             self.ram_bytes, self.disk_bytes, self.spilled_bytes - earlier.spilled_bytes)

    @property
    def bandwidth(self) -> float:
        return self.moved_bytes / self.transfer_time_s if self.transfer_time_s > 0 else 0.0

    @property
    def hidden_fraction(self) -> float:
        """Share of copy time nobody waited for."""
        if self.transfer_time_s <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.stall_time_s / self.transfer_time_s))


class HostStore:
    """Host buffers plus the engine for `backend`; past `limit_bytes` they spill to `spill_dir`."""

    def __init__(self, limit_bytes: int | None = None, t0: float | None = None, trace: list | None = None,
                 spill_dir: str | os.PathLike | None = None, backend: Any = None):
        if limit_bytes is not None and limit_bytes < 0:
            raise OptionError(f"host limit must be >= 0 bytes, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.t0 = time.perf_counter() if t0 is None else t0
        self.trace = trace
        self.spill_dir = spill_dir
        self.engine: TransferEngine = (StreamTransfers(backend)
                                       if backend is not None and backend.capabilities.stream_copies
                                       else ThreadTransfers())
        self._buffers: dict[str, np.ndarray] = {}
        self._on_disk: set[str] = set()
        self._pending_offload: dict[str, _Job] = {}
        self._pending_prefetch: dict[str, _Job] = {}
        self._unsettled: list[_Job] = []  # stream engine: waited on, settled at `end_iteration`
        self._spill: list = []        # [the open spill file], shared with the finalizer
        self._spill_size = 0
        self._stats = TransferStats()
        self._finalizer = weakref.finalize(self, _close_spill, self._spill)
        self.untimed_copies = 0   # copies replayed inside a CUDA graph: counted, not timed

    @property
    def _thread(self) -> threading.Thread | None:
        return getattr(self.engine, "thread", None)

    def _buffer_for(self, tid: str, like: np.ndarray) -> np.ndarray:
        buf = self._buffers.get(tid)
        if buf is not None and buf.shape == like.shape and buf.dtype == like.dtype:
            return buf
        if buf is not None:
            raise TransferError(f"tensor '{tid}' was offloaded before as {buf.shape} {buf.dtype}, now as "
                                f"{like.shape} {like.dtype}: one host store serves one plan")
        nbytes = like.nbytes
        st = self._stats
        if self.limit_bytes is None or st.ram_bytes + nbytes <= self.limit_bytes:
            buf = self.engine.empty(like.shape, like.dtype)
            st.ram_bytes += nbytes
        else:
            buf = self._spill_buffer(like.shape, like.dtype, nbytes)
            self._on_disk.add(tid)
            st.disk_bytes += nbytes
        self._buffers[tid] = buf
        return buf

    def _spill_buffer(self, shape, dtype, nbytes: int) -> np.ndarray:
        if not self._spill:
            self._spill.append(tempfile.TemporaryFile(prefix="minidl-host-", dir=self.spill_dir))
        f = self._spill[0]
        offset = self._spill_size
        self._spill_size = offset + -(-max(nbytes, 1) // _PAGE) * _PAGE
        os.ftruncate(f.fileno(), self._spill_size)
        return np.memmap(f, dtype=dtype, mode="r+", offset=offset, shape=shape)

    def on_disk(self, tid: str) -> bool:
        return tid in self._on_disk

    def host_copy(self, tid: str) -> np.ndarray:
        """The host buffer of `tid` (valid once its offload is settled)."""
        return self._buffers[tid]

    def store(self, tid: str, values: np.ndarray) -> None:
        """Set the host copy of `tid` now (a tensor homed on the host by the weights decision)."""
        if tid in self._pending_offload or tid in self._pending_prefetch:
            raise TransferError(f"store of '{tid}' while a copy of it is in flight")
        np.copyto(self._buffer_for(tid, np.asarray(values)), values)

    def offload(self, tid: str, src: np.ndarray, step_index: int) -> None:
        if tid in self._pending_offload:
            raise TransferError(f"tensor '{tid}' is offloaded twice without a release in between")
        dst = self._buffer_for(tid, src)
        self._submit(_Job("offload", tid, src, dst, step_index, src.nbytes), self._pending_offload)

    def wait_offload(self, tid: str) -> None:
        job = self._pending_offload.pop(tid, None)
        if job is None:
            raise TransferError(f"release of '{tid}', which has no offload in flight")
        self._wait(job)

    def prefetch(self, tid: str, dst: np.ndarray, step_index: int) -> None:
        """Start copying `tid` into the device block `dst`."""
        src = self._buffers.get(tid)
        if src is None:
            raise TransferError(f"prefetch of '{tid}', which was never offloaded")
        if tid in self._pending_prefetch:
            raise TransferError(f"tensor '{tid}' is prefetched twice without a wait in between")
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise TransferError(f"prefetch of '{tid}': host copy is {src.shape} {src.dtype}, device block is "
                                f"{dst.shape} {dst.dtype}")
        self._submit(_Job("prefetch", tid, src, dst, step_index, dst.nbytes), self._pending_prefetch)

    def wait_prefetch(self, tid: str) -> None:
        job = self._pending_prefetch.pop(tid, None)
        if job is None:
            raise TransferError(f"wait for '{tid}', which has no prefetch in flight")
        self._wait(job)

    def end_iteration(self) -> None:
        """End of a step: drain the copies nobody waited on (none may touch a reused block), settle, raise."""
        jobs, self._unsettled = self._unsettled, []
        leftovers = list(self._pending_offload.values()) + list(self._pending_prefetch.values())
        self._pending_offload.clear()
        self._pending_prefetch.clear()
        for job in leftovers:
            job.leftover = True
            self.engine.wait(job)
        jobs += leftovers
        for job in jobs:
            self._settle(job)
        for job in jobs:
            if job.error is not None:
                raise _failure(job, job.error) from job.error
        self._stats.iterations += 1

    def _submit(self, job: _Job, pending: dict[str, _Job]) -> None:
        if not self.engine.alive:
            raise TransferError(f"the {self.engine.name} is not running (the store was closed)")
        job.submitted = time.perf_counter()
        try:
            self.engine.start(job)
        except Exception as e:
            raise _failure(job, e) from e
        pending[job.tensor] = job

    def _wait(self, job: _Job) -> None:
        self.engine.wait(job)
        if not self.engine.times_at_wait:
            self._unsettled.append(job)
            return
        self._settle(job)
        if job.error is not None:
            raise _failure(job, job.error) from job.error

    def _settle(self, job: _Job) -> None:
        self.engine.settle(job)
        st = self._stats
        st.transfer_time_s += job.end - job.start
        if not job.leftover:
            st.stall_time_s += job.stall
        if job.kind == "offload":
            st.offloads += 1
            st.offloaded_bytes += job.nbytes
        else:
            st.prefetches += 1
            st.prefetched_bytes += job.nbytes
        if job.tensor in self._on_disk:
            st.spilled_bytes += job.nbytes
        if self.trace is not None:
            self.trace.append(TraceEvent(f"{job.kind} {job.tensor}", "transfer", job.start - self.t0,
                                         job.end - job.start, job.step, -1))
        # a finished job must not keep a device view alive
        job.src = job.dst = None  # type: ignore[assignment]

    # -- CUDA graphs (runtime/capture.py)
    @property
    def capturable(self) -> str | None:
        """None if the copies can be captured in a CUDA graph, else why not."""
        if not isinstance(self.engine, StreamTransfers):
            return f"host copies run on the {self.engine.name}, which a graph cannot contain"
        if self.limit_bytes is not None:
            return "a host limit (--host-limit) may put copies on the disk tier, which a graph cannot contain"
        return None

    def drop_captured(self) -> list[tuple[str, str, int]]:
        """Forget the copies issued during a graph capture; returns their (kind, tensor, bytes)."""
        jobs = self._unsettled + list(self._pending_offload.values()) + list(self._pending_prefetch.values())
        self._unsettled = []
        self._pending_offload.clear()
        self._pending_prefetch.clear()
        forget = getattr(self.engine, "forget", None)
        for job in jobs:
            if forget is not None:
                forget(job)
        return [(job.kind, job.tensor, job.nbytes) for job in jobs]

    def count_replayed(self, copies: list[tuple[str, str, int]]) -> None:
        """Count one replay of a graph's copies (bytes only)."""
        st = self._stats
        for kind, _, nbytes in copies:
            if kind == "offload":
                st.offloads += 1
                st.offloaded_bytes += nbytes
            else:
                st.prefetches += 1
                st.prefetched_bytes += nbytes
        self.untimed_copies += len(copies)

    def stats(self) -> TransferStats:
        s = self._stats
        return TransferStats(s.iterations, s.offloads, s.prefetches, s.offloaded_bytes, s.prefetched_bytes,
                             s.transfer_time_s, s.stall_time_s, s.ram_bytes, s.disk_bytes, s.spilled_bytes)

    def reset_stats(self) -> None:
        """Zero the counters, not the buffers (e.g. to leave out the page-faulting first step)."""
        s = self._stats
        self._stats = TransferStats(ram_bytes=s.ram_bytes, disk_bytes=s.disk_bytes)

    @property
    def in_flight(self) -> int:
        return len(self._pending_offload) + len(self._pending_prefetch)

    def close(self) -> None:
        self.engine.close()
        if self._finalizer.alive:
            self._finalizer()
        self._buffers.clear()

    def __enter__(self) -> "HostStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def transfer_json(host: HostStore | None, iterations: int | None = None,
                  since: TransferStats | None = None) -> dict:
    """The measured copies as JSON, bytes per training step; `since`: only after those statistics."""
    s = host.stats() if host is not None else TransferStats()
    if since is not None:
        s = s.since(since)
    n = iterations if iterations else max(s.iterations, 1)
    untimed = host.untimed_copies if host is not None else 0
    # copies inside CUDA graphs have no times: a hidden share of the others alone would mislead
    hidden = None if untimed else s.hidden_fraction
    return {"offloaded_bytes": s.offloaded_bytes // n, "prefetched_bytes": s.prefetched_bytes // n,
            "transfer_hidden_fraction": hidden, "untimed_copies": untimed, "copy_bandwidth_bytes_per_s": s.bandwidth,
            "transfer_time_s": s.transfer_time_s / n, "transfer_stall_s": s.stall_time_s / n,
            "host_ram_bytes": s.ram_bytes, "host_disk_bytes": s.disk_bytes}


def copies_line(transfer: dict, step_time_s: float, over: str) -> str:
    """The copies' cost in one line, the wait as a share of the step (2 MiB "0% hidden" in 0.4 ms of an 80 ms
    step costs nothing); `transfer` and `step_time_s` cover the steps `over` names."""
    if transfer["transfer_hidden_fraction"] is None:
        return "copies inside CUDA graphs (not timed: --cuda-graph off measures their overlap)"
    moved = transfer["offloaded_bytes"] + transfer["prefetched_bytes"]
    wait = transfer["transfer_stall_s"]
    share = wait / step_time_s if step_time_s > 0 else 0.0
    return (f"copies: {format_bytes(moved)} a step at {transfer['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
            f"({transfer['transfer_time_s'] * 1e3:.1f} ms), {transfer['transfer_hidden_fraction']:.0%} hidden behind "
            f"compute; a step waited {wait * 1e3:.1f} ms for them, {share:.1%} of its {step_time_s * 1e3:.1f} ms "
            f"(means over {over})")
