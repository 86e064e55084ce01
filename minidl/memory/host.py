"""The host store and its transfer engines: where offloaded tensors wait, and what moves them.

SuperNeurons' tensor cache evicts device tensors to pinned host memory and brings them back before backward
needs them. Three pieces make that work, and this module holds them:

* **The host store** (`HostStore`) keeps one host buffer per offloaded tensor. Buffers are allocated the first
  time a tensor is offloaded and *reused* every later iteration: the route is static, so the same tensors move
  every step, and allocating (on a GPU: pinning) fresh host memory each time would cost more than the copies.
  The engine allocates them: pinned (page-locked) buffers on a GPU, which is what lets the DMA engine copy
  without the CPU; plain numpy arrays in RAM on the CPU backend.

* **A transfer engine** starts copies and waits for them. The executor never waits when it *starts* a copy; it
  waits only when the data is about to matter:

  - `wait_offload(tid)` before the device block of an offloaded tensor is freed (the plan's RELEASE event):
    freeing earlier would let the next allocation overwrite bytes the copy is still reading;
  - `wait_prefetch(tid)` before the first step that reads a prefetched tensor (the plan's WAIT event):
    running the kernel earlier would let it read a block that is still being written.

  Both engines copy one tensor at a time, in the order the plan issued them (one FIFO "stream"), which is what
  the simulator assumes about the link and what queues a tensor's prefetch behind its own offload. They differ
  in who runs the kernels, and so in *who* must wait:

  - `ThreadTransfers` (the CPU backend, and any backend without `offload_async`): one worker thread fed by a
    FIFO queue copies with `np.copyto`, which releases the GIL for the length of the copy, so the copy really
    runs beside the layer kernels (numpy releases the GIL in its kernels too). The kernels run on the host
    thread itself, so "no kernel before the copy has landed" means the *host* blocks in a wait. A copy that
    fails (a shape mismatch, a full disk) does not kill the thread: the error is stored on the job and raised
    in the executor's thread as a `TransferError` at the next wait on that tensor, or at the end of the
    iteration for a copy nobody waited on.
  - `StreamTransfers(backend)` (the CUDA backend): the backend enqueues each copy on its transfer stream
    (`offload_async`, `prefetch_async`) between pinned host buffers (`host_empty`) and device blocks. Here the
    host only *enqueues* kernels; they run later, in order, on the device's compute stream. The ordering that
    matters is therefore between two device streams, and a wait is device-side: `transfer_wait` makes the
    compute stream wait for the copy's event and returns at once. Blocking the host instead would be correct
    but harmful: while it sleeps it enqueues nothing, the compute stream runs dry, and the copy stops hiding
    behind compute. The host blocks once per step, in `end_iteration`, which *settles* every copy of the step:
    `transfer_sync`, then `transfer_times` for the copy's device-measured start, end and stall. A copy the
    backend refuses raises a `TransferError` at once; one that fails on the device, at the settle.

* **The disk tier.** With `limit_bytes` set, host buffers are allocated in RAM until that many bytes are
  taken; every further buffer lives in a memory-mapped scratch file instead (`np.memmap` over a temporary
  file that is deleted when the store closes). That lets a user train a network whose offloaded activations
  exceed RAM: file-backed pages can be written back and dropped by the kernel under memory pressure, whereas
  anonymous memory could only go to swap. The cost: while the page cache still has room a spilled copy runs at
  nearly memcpy speed (plus page faults the first time); once RAM is really short the kernel writes those
  pages to disk and the prefetch reads them back, so the copy runs at disk bandwidth (hundreds of MB/s to a
  few GB/s instead of ~10 GB/s) and will usually no longer hide behind compute. Both engines use the same
  memory maps; on a GPU they are pageable memory, which the driver stages through its own pinned buffer, so
  those copies are slower again and not fully asynchronous. Which buffers spill is decided once, first come
  first served, and stays fixed: the earliest offloaded tensors (which are prefetched last, so have the most
  time to come back) stay in RAM.

Statistics (`stats()`) are measured, not estimated: bytes copied each way, the time spent copying, and the
stall: how long the consumer of a copy waited for it (the host blocked in a wait on the thread engine, the
compute stream idle at a `transfer_wait` on the stream engine). The share of transfer time hidden behind
compute is `1 - stall / copying`: a wait that finds its copy done means the copy ran entirely while layers
computed. The thread engine knows a copy's times as soon as it has landed, so its copies are counted at the
wait; the stream engine learns them only when the copy is settled, so its copies are counted at
`end_iteration`. Copies nobody waited on (drained by `end_iteration`) count as copied but never as a stall:
no step was waiting for them.
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
    """One copy on the transfer stream, from issue until it is settled and accounted.

    `handle` is what the engine waits on: a `threading.Event` the worker sets once `dst` holds `src`'s bytes
    (thread engine), or the backend's transfer object (stream engine). `start`, `end` and `stall` are filled in
    by the engine on the `time.perf_counter` clock; `leftover` marks a copy nobody waited on, drained at the
    end of the iteration (its stall is not counted).
    """

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


# ---------------------------------------------------------------------------------------------------------
# Transfer engines
# ---------------------------------------------------------------------------------------------------------

class TransferEngine(Protocol):
    """What the host store needs from a transfer engine: buffers, and copies it can start, wait on and settle.

    A job goes through `start` (returns at once), `wait` (the executor's RELEASE or WAIT event, or the drain at
    the end of the iteration), then `settle` (at the wait where `times_at_wait`, else at `end_iteration`),
    after which its `start`, `end`, `stall` and `error` are final and the store accounts it.
    """

    name: str            # for messages: "transfer thread", "transfer stream"
    times_at_wait: bool  # a copy's times are known when `wait` returns, so it can be accounted there

    def empty(self, shape, dtype) -> np.ndarray: ...
    def start(self, job: _Job) -> None: ...
    def wait(self, job: _Job) -> None: ...
    def settle(self, job: _Job) -> None: ...
    @property
    def alive(self) -> bool: ...
    def close(self) -> None: ...


def _worker(jobs: "queue.Queue[_Job | None]") -> None:
    """The thread engine's stream: copy jobs one at a time, in FIFO order, until the `None` sentinel.

    The function holds no reference to the engine, only to the queue, so an engine that is dropped without
    `close()` can still be garbage collected (its finalizer sends the sentinel).
    """
    while True:
        job = jobs.get()
        if job is None:
            return
        job.start = time.perf_counter()
        try:
            np.copyto(job.dst, job.src, casting="no")  # releases the GIL for the whole copy
        except BaseException as e:  # noqa: BLE001 - handed to the executor's thread, never swallowed
            job.error = e
        job.end = time.perf_counter()
        job.handle.set()


def _stop_worker(jobs: "queue.Queue[_Job | None]", thread: threading.Thread) -> None:
    jobs.put(None)  # behind every queued copy: the worker drains the queue, then returns
    if thread is not threading.current_thread():
        thread.join(timeout=30)


class ThreadTransfers:
    """Copies with `np.copyto` on one worker thread; a wait blocks the host until the copy has landed.

    For backends whose device arrays are host arrays (the CPU backend): the host thread runs the kernels, so it
    is the host that must not run ahead of a copy. Buffers are plain `np.empty` arrays. The worker stamps each
    job's start and end and sets its event; `wait` blocks on that event and records the blocked time as the
    job's stall. By then everything about the copy is known, so `settle` has nothing left to do.
    """

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
        """Nothing to do: the copy landed before `wait` returned, and the worker stamped its times and error."""

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def close(self) -> None:
        """Stop the worker once it has finished every queued copy."""
        self._finalizer()


def _sync_outstanding(backend, outstanding: dict) -> None:
    for handle in list(outstanding.values()):
        backend.transfer_sync(handle)
    outstanding.clear()


class StreamTransfers:
    """Copies on a device backend's transfer stream, between pinned host buffers and device blocks.

    The backend provides `host_empty(shape, dtype)` (pinned buffers: only page-locked memory can be copied by
    the DMA engine while the host goes on), `offload_async(src, dst)` / `prefetch_async(src, dst)` (enqueue
    the copy, return a handle), `transfer_wait(handle)` (make the compute stream wait for the copy; the host
    does not block), `transfer_sync(handle)` (block the host until the copy is done) and
    `transfer_times(handle)` -> (start_s, end_s, stall_s) on the `time.perf_counter` clock, valid once synced.

    `wait` is device-side because the device runs the kernels that must not overtake the copy: the host
    merely enqueues them, and keeping it free to do so is what lets the copies hide behind compute. The cost is
    that the copy's times exist only on the device; `settle` (at the end of the iteration) is where the host
    blocks once and reads them.
    """

    name = "transfer stream"
    times_at_wait = False

    def __init__(self, backend):
        self.backend = backend
        self._outstanding: dict[int, Any] = {}  # id(job) -> handle, for every copy started and not yet settled
        self._finalizer = weakref.finalize(self, _sync_outstanding, backend, self._outstanding)
        self._finalizer.atexit = False  # at interpreter exit the device goes away with the process

    def empty(self, shape, dtype) -> np.ndarray:
        return self.backend.host_empty(shape, dtype)

    def start(self, job: _Job) -> None:
        copy = self.backend.offload_async if job.kind == "offload" else self.backend.prefetch_async
        job.handle = copy(job.src, job.dst)
        self._outstanding[id(job)] = job.handle

    def wait(self, job: _Job) -> None:
        self.backend.transfer_wait(job.handle)

    def settle(self, job: _Job) -> None:
        """Block until the copy is done, then read its device-measured times (a device error lands on the job)."""
        self._outstanding.pop(id(job), None)
        try:
            self.backend.transfer_sync(job.handle)
            job.start, job.end, job.stall = self.backend.transfer_times(job.handle)
        except Exception as e:  # noqa: BLE001 - raised by the store as a TransferError naming the copy
            job.error = e

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def forget(self, job: _Job) -> None:
        """Drop a copy captured in a CUDA graph: its handle's events are the graph's, never to be synchronized."""
        self._outstanding.pop(id(job), None)

    def close(self) -> None:
        """Wait for every copy still on the stream: none may outlive the buffers it reads or writes."""
        self._finalizer()


# ---------------------------------------------------------------------------------------------------------
# The host store
# ---------------------------------------------------------------------------------------------------------

def _close_spill(spill: list) -> None:
    for f in spill:
        try:
            f.close()  # a TemporaryFile: closing deletes it
        except OSError:
            pass
    spill.clear()


@dataclass(slots=True)
class TransferStats:
    """What the transfer engine measured since the store was created (or since `reset_stats`)."""

    iterations: int = 0
    offloads: int = 0
    prefetches: int = 0
    offloaded_bytes: int = 0
    prefetched_bytes: int = 0
    transfer_time_s: float = 0.0   # time spent copying (the worker's, or the transfer stream's)
    stall_time_s: float = 0.0      # time the consumer waited for a copy (the host, or the compute stream)
    ram_bytes: int = 0             # host buffers in RAM
    disk_bytes: int = 0            # host buffers in the memory-mapped spill file
    spilled_bytes: int = 0         # bytes copied to or from the disk tier

    @property
    def moved_bytes(self) -> int:
        return self.offloaded_bytes + self.prefetched_bytes

    def since(self, earlier: TransferStats) -> TransferStats:
        """What was measured after `earlier` (a `HostStore.stats()` taken before): counts and times subtracted,
        the host buffers' sizes as they are now."""
        return TransferStats(self.iterations - earlier.iterations, self.offloads - earlier.offloads,
                             self.prefetches - earlier.prefetches, self.offloaded_bytes - earlier.offloaded_bytes,
                             self.prefetched_bytes - earlier.prefetched_bytes,
                             self.transfer_time_s - earlier.transfer_time_s, self.stall_time_s - earlier.stall_time_s,
                             self.ram_bytes, self.disk_bytes, self.spilled_bytes - earlier.spilled_bytes)

    @property
    def bandwidth(self) -> float:
        """Achieved copy bandwidth, bytes per second of copying (0.0 when nothing moved)."""
        return self.moved_bytes / self.transfer_time_s if self.transfer_time_s > 0 else 0.0

    @property
    def hidden_fraction(self) -> float:
        """Share of copy time the executor did not wait for (1.0 when nothing moved: nothing was exposed)."""
        if self.transfer_time_s <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.stall_time_s / self.transfer_time_s))


class HostStore:
    """Host buffers for offloaded tensors plus the transfer engine that fills and drains them.

    `limit_bytes`: host RAM the store may use (None: unlimited); buffers beyond it go to a memory-mapped file
    in `spill_dir` (default: the system temp directory). `t0` and `trace`: when `trace` is a list, each
    accounted copy is appended to it as a `TraceEvent` on the "transfer" track, timed relative to `t0`.
    `backend`: a backend with `offload_async` (the CUDA backend) gets a `StreamTransfers` engine on its
    transfer stream; anything else, the CPU backend or None, a `ThreadTransfers` engine.
    """

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
        self._unsettled: list[_Job] = []  # waited on, to be settled at the end of the iteration (stream engine)
        self._spill: list = []        # [the open spill file], a list so the finalizer can close it
        self._spill_size = 0
        self._stats = TransferStats()
        self._finalizer = weakref.finalize(self, _close_spill, self._spill)
        self.untimed_copies = 0   # copies replayed inside a CUDA graph (minidl/runtime/capture.py): counted, not timed

    @property
    def _thread(self) -> threading.Thread | None:
        """The thread engine's worker (None for a stream engine)."""
        return getattr(self.engine, "thread", None)

    # -- host buffers ---------------------------------------------------------------------------------------
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
        """A region of the spill file, mapped as an array (page-aligned so regions never share a page)."""
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
        """The host buffer of `tid` (for tests and debugging). Its contents are valid once the offload landed:
        after `wait_offload` on the thread engine, after `end_iteration` on the stream engine."""
        return self._buffers[tid]

    def store(self, tid: str, values: np.ndarray) -> None:
        """Set the host copy of `tid` to `values` now (synchronously): the home of a tensor that starts on the
        host (a parameter or optimizer slot homed there by the weights decision)."""
        if tid in self._pending_offload or tid in self._pending_prefetch:
            raise TransferError(f"store of '{tid}' while a copy of it is in flight")
        np.copyto(self._buffer_for(tid, np.asarray(values)), values)

    # -- the four operations the executor's events call -------------------------------------------------------
    def offload(self, tid: str, src: np.ndarray, step_index: int) -> None:
        """Start copying the device tensor `src` to the host. Returns at once."""
        if tid in self._pending_offload:
            raise TransferError(f"tensor '{tid}' is offloaded twice without a release in between")
        dst = self._buffer_for(tid, src)
        self._submit(_Job("offload", tid, src, dst, step_index, src.nbytes), self._pending_offload)

    def wait_offload(self, tid: str) -> None:
        """Wait until the offload of `tid` has landed: only then may its device block be freed."""
        job = self._pending_offload.pop(tid, None)
        if job is None:
            raise TransferError(f"release of '{tid}', which has no offload in flight")
        self._wait(job)

    def prefetch(self, tid: str, dst: np.ndarray, step_index: int) -> None:
        """Start copying `tid` from the host into the (freshly allocated) device block `dst`. Returns at once.

        The copy is queued behind the tensor's own offload (one FIFO stream), so it can never read a host
        buffer that is still being filled, even if the plan released nothing in between.
        """
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
        """Wait until the prefetch of `tid` has landed: only then may a kernel read it."""
        job = self._pending_prefetch.pop(tid, None)
        if job is None:
            raise TransferError(f"wait for '{tid}', which has no prefetch in flight")
        self._wait(job)

    def end_iteration(self) -> None:
        """Drain the stream at the end of a training (or evaluation) step, then settle and account its copies.

        Copies nobody waited on (an evaluation runs only the forward half of the plan, so its offloads are
        never prefetched) are waited on here, so no copy can outlive the step that issued it and touch a
        device block the next step reuses. Then every copy not yet settled is: on the stream engine that is
        where the host blocks, once per step, and learns the copies' times. A failed copy raises here, after
        all of them were settled and counted.
        """
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

    # -- internals ------------------------------------------------------------------------------------------
    def _submit(self, job: _Job, pending: dict[str, _Job]) -> None:
        if not self.engine.alive:
            raise TransferError(f"the {self.engine.name} is not running (the store was closed)")
        job.submitted = time.perf_counter()
        try:
            self.engine.start(job)
        except Exception as e:  # the backend refused the copy: name it
            raise _failure(job, e) from e
        pending[job.tensor] = job

    def _wait(self, job: _Job) -> None:
        """The executor's wait: host- or device-side, as the engine does it; accounted now if the engine can."""
        self.engine.wait(job)
        if not self.engine.times_at_wait:
            self._unsettled.append(job)
            return
        self._settle(job)
        if job.error is not None:
            raise _failure(job, job.error) from job.error

    def _settle(self, job: _Job) -> None:
        """Make the copy's times and error final (the engine), then count it and put it on the trace."""
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
        # Drop the job's array references: a finished job must not keep a device view alive.
        job.src = job.dst = None  # type: ignore[assignment]

    # -- CUDA graphs (minidl/runtime/capture.py) --------------------------------------------------------------------
    @property
    def capturable(self) -> str | None:
        """None if this store's copies can be captured in a CUDA graph, else why not: the copies must be stream
        copies (a device backend) between fixed pinned buffers, so no buffer may be on the disk tier."""
        if not isinstance(self.engine, StreamTransfers):
            return f"host copies run on the {self.engine.name}, which a graph cannot contain"
        if self.limit_bytes is not None:
            return "a host limit (--host-limit) may put copies on the disk tier, which a graph cannot contain"
        return None

    def drop_captured(self) -> list[tuple[str, str, int]]:
        """Forget the copies issued while a graph was captured (nothing ran: their events belong to the graph and
        can never be synchronized or timed). Returns (kind, tensor, bytes) of each, in order."""
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
        """Account one replay of a graph's copies: counts and bytes (their times stay unmeasured; the step's
        `end_iteration` counts the iteration)."""
        st = self._stats
        for kind, _, nbytes in copies:
            if kind == "offload":
                st.offloads += 1
                st.offloaded_bytes += nbytes
            else:
                st.prefetches += 1
                st.prefetched_bytes += nbytes
        self.untimed_copies += len(copies)

    # -- reporting and lifetime -----------------------------------------------------------------------------
    def stats(self) -> TransferStats:
        """A copy of the statistics so far (on the stream engine: up to the last `end_iteration`)."""
        s = self._stats
        return TransferStats(s.iterations, s.offloads, s.prefetches, s.offloaded_bytes, s.prefetched_bytes,
                             s.transfer_time_s, s.stall_time_s, s.ram_bytes, s.disk_bytes, s.spilled_bytes)

    def reset_stats(self) -> None:
        """Zero the counters (not the buffers): e.g. to leave the first, page-faulting iteration out."""
        s = self._stats
        self._stats = TransferStats(ram_bytes=s.ram_bytes, disk_bytes=s.disk_bytes)

    @property
    def in_flight(self) -> int:
        return len(self._pending_offload) + len(self._pending_prefetch)

    def close(self) -> None:
        """Stop the engine and delete the spill file. Pending copies are finished first."""
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
    """The measured transfer statistics as JSON keys (per training step where the key is a byte count).

    `iterations` divides the byte counts (the number of training steps the stats cover; default: the store's
    own count of iterations, which includes evaluation passes). `since`: only what was measured after those
    statistics (e.g. the first step's, which compiles kernels and faults in fresh host buffers).
    """
    s = host.stats() if host is not None else TransferStats()
    if since is not None:
        s = s.since(since)
    n = iterations if iterations else max(s.iterations, 1)
    untimed = host.untimed_copies if host is not None else 0
    # copies replayed inside CUDA graphs have no times: a hidden fraction of the others alone would mislead
    hidden = None if untimed else s.hidden_fraction
    return {"offloaded_bytes": s.offloaded_bytes // n, "prefetched_bytes": s.prefetched_bytes // n,
            "transfer_hidden_fraction": hidden, "untimed_copies": untimed, "copy_bandwidth_bytes_per_s": s.bandwidth,
            "transfer_time_s": s.transfer_time_s / n, "transfer_stall_s": s.stall_time_s / n,
            "host_ram_bytes": s.ram_bytes, "host_disk_bytes": s.disk_bytes}


def copies_line(transfer: dict, step_time_s: float, over: str) -> str:
    """What the measured copies cost this run, in one line: how much moved and how fast, how much of it hid behind
    compute, and how long a step waited for it, as a share of the step.

    Why the wait and not the hidden share alone: "0% hidden behind compute" reads as a failure, yet 2 MiB copied in
    0.4 ms of an 80 ms step costs nothing that matters, while 50% hidden of copies that take as long as the compute
    is a slow run. No verdict on the budget: it also costs recomputation and smaller workspaces, which only a
    measured step without it could weigh. `transfer`: `transfer_json`'s keys and `step_time_s` the mean step
    time, both over the same steps, which `over` names ("the 149 steps after the first": the first compiles
    kernels)."""
    if transfer["transfer_hidden_fraction"] is None:
        return "copies inside CUDA graphs (not timed: --cuda-graph off measures their overlap)"
    moved = transfer["offloaded_bytes"] + transfer["prefetched_bytes"]
    wait = transfer["transfer_stall_s"]
    share = wait / step_time_s if step_time_s > 0 else 0.0
    return (f"copies: {format_bytes(moved)} a step at {transfer['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
            f"({transfer['transfer_time_s'] * 1e3:.1f} ms), {transfer['transfer_hidden_fraction']:.0%} hidden behind "
            f"compute; a step waited {wait * 1e3:.1f} ms for them, {share:.1%} of its {step_time_s * 1e3:.1f} ms "
            f"(means over {over})")
