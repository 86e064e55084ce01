"""The host store and the transfer engine: where offloaded tensors wait, and the thread that moves them.

SuperNeurons' tensor cache evicts device tensors to pinned host memory and brings them back before backward
needs them. Two pieces make that work, and this module holds both:

* **The host store** keeps one host buffer per offloaded tensor. Buffers are allocated the first time a
  tensor is offloaded and *reused* every later iteration: the route is static, so the same tensors move every
  step, and allocating (on a GPU: pinning) fresh host memory each time would cost more than the copies. On a
  GPU these would be pinned (page-locked) buffers, which is what lets the DMA engine copy without the CPU; on
  the CPU backend they are plain numpy arrays in RAM.

* **The transfer engine** copies on its own "stream": one worker thread fed by a FIFO queue. On the CPU a
  copy is `np.copyto`, which releases the GIL for the length of the copy, so the copy really runs beside the
  layer kernels (numpy releases the GIL in its kernels too). Each copy is a `_Job` carrying a
  `threading.Event` that is set when the copy has landed. The executor never waits when it *starts* a copy;
  it waits only when the data is about to matter:

  - `wait_offload(tid)` before the device block of an offloaded tensor is freed (the plan's RELEASE event):
    freeing earlier would let the next allocation overwrite bytes the thread is still reading;
  - `wait_prefetch(tid)` before the first step that reads a prefetched tensor (the plan's WAIT event):
    running the kernel earlier would let it read a block that is still being written.

  One FIFO queue means one copy at a time, in the order the plan issued them, which is also what the
  simulator assumes about the link. A copy that fails (a shape mismatch, a full disk) does not kill the
  thread: the error is stored on the job and raised in the executor's thread as a `TransferError` at the
  next wait on that tensor, or at the end of the iteration for a copy nobody waited on.

* **The disk tier.** With `limit_bytes` set, host buffers are allocated in RAM until that many bytes are
  taken; every further buffer lives in a memory-mapped scratch file instead (`np.memmap` over a temporary
  file that is deleted when the store closes). That lets a CPU user train a network whose offloaded
  activations exceed RAM: file-backed pages can be written back and dropped by the kernel under memory
  pressure, whereas anonymous memory could only go to swap. The cost: while the page cache still has room a
  spilled copy runs at nearly memcpy speed (plus page faults the first time); once RAM is really short the
  kernel writes those pages to disk and the prefetch reads them back, so the copy runs at disk bandwidth
  (hundreds of MB/s to a few GB/s instead of ~10 GB/s) and will usually no longer hide behind compute.
  Which buffers spill is decided once, first come first served, and stays fixed: the earliest offloaded
  tensors (which are prefetched last, so have the most time to come back) stay in RAM.

Statistics (`stats()`) are measured, not estimated: bytes copied each way, the time the thread spent copying,
and the time the executor spent blocked in a wait. The share of transfer time hidden behind compute is
`1 - blocked / copying`: a wait that returns at once means the copy ran entirely while layers computed.
"""
from __future__ import annotations

import mmap
import os
import queue
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np

from ..errors import MinidlError

__all__ = ["HostStore", "TransferError", "TransferStats", "transfer_json"]

_PAGE = max(mmap.ALLOCATIONGRANULARITY, 4096)


class TransferError(MinidlError, RuntimeError):
    """A host <-> device copy failed, or the plan asked for a wait that has no copy behind it."""


@dataclass(slots=True, eq=False)
class _Job:
    """One copy on the transfer stream. `done` is set by the worker once `dst` holds `src`'s bytes."""

    kind: str                 # "offload" (device -> host) or "prefetch" (host -> device)
    tensor: str
    src: np.ndarray
    dst: np.ndarray
    step: int
    nbytes: int
    done: threading.Event = field(default_factory=threading.Event)
    submitted: float = 0.0
    start: float = 0.0
    end: float = 0.0
    error: BaseException | None = None


def _worker(jobs: "queue.Queue[_Job | None]") -> None:
    """The transfer stream: copy jobs one at a time, in FIFO order, until the `None` sentinel.

    The function holds no reference to the HostStore, only to the queue, so a store that is dropped without
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
        job.done.set()


def _shutdown(jobs: "queue.Queue[_Job | None]", thread: threading.Thread, spill: list) -> None:
    jobs.put(None)
    if thread is not threading.current_thread():
        thread.join(timeout=30)
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
    transfer_time_s: float = 0.0   # the worker's time spent copying
    stall_time_s: float = 0.0      # the executor's time spent blocked in a wait
    ram_bytes: int = 0             # host buffers in RAM
    disk_bytes: int = 0            # host buffers in the memory-mapped spill file
    spilled_bytes: int = 0         # bytes copied to or from the disk tier

    @property
    def moved_bytes(self) -> int:
        return self.offloaded_bytes + self.prefetched_bytes

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
    """Host buffers for offloaded tensors plus the transfer thread that fills and drains them.

    `limit_bytes`: host RAM the store may use (None: unlimited); buffers beyond it go to a memory-mapped file
    in `spill_dir` (default: the system temp directory). `t0` and `trace`: when `trace` is a list, each finished
    copy is appended to it as a `TraceEvent` on the "transfer" track, timed relative to `t0`.
    """

    def __init__(self, limit_bytes: int | None = None, t0: float | None = None, trace: list | None = None,
                 spill_dir: str | os.PathLike | None = None):
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"host limit must be >= 0 bytes, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.t0 = time.perf_counter() if t0 is None else t0
        self.trace = trace
        self.spill_dir = spill_dir
        self._buffers: dict[str, np.ndarray] = {}
        self._on_disk: set[str] = set()
        self._pending_offload: dict[str, _Job] = {}
        self._pending_prefetch: dict[str, _Job] = {}
        self._spill: list = []        # [the open spill file], a list so the finalizer can close it
        self._spill_size = 0
        self._stats = TransferStats()
        self._jobs: "queue.Queue[_Job | None]" = queue.Queue()
        self._thread = threading.Thread(target=_worker, args=(self._jobs,), name="minidl-transfer", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._jobs, self._thread, self._spill)

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
            buf = np.empty(like.shape, like.dtype)
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
        """The host buffer of `tid` (for tests and debugging; its contents are valid once the offload landed)."""
        return self._buffers[tid]

    # -- the four operations the executor's events call -------------------------------------------------------
    def offload(self, tid: str, src: np.ndarray, step_index: int) -> None:
        """Start copying the device tensor `src` to the host. Returns at once."""
        if tid in self._pending_offload:
            raise TransferError(f"tensor '{tid}' is offloaded twice without a release in between")
        dst = self._buffer_for(tid, src)
        self._submit(_Job("offload", tid, src, dst, step_index, src.nbytes), self._pending_offload)

    def wait_offload(self, tid: str) -> None:
        """Block until the offload of `tid` has landed: only then may its device block be freed."""
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
        """Block until the prefetch of `tid` has landed: only then may a kernel read it."""
        job = self._pending_prefetch.pop(tid, None)
        if job is None:
            raise TransferError(f"wait for '{tid}', which has no prefetch in flight")
        self._wait(job)

    def end_iteration(self) -> None:
        """Drain the stream at the end of a training (or evaluation) step and account its copies.

        Copies nobody waited on (an evaluation runs only the forward half of the plan, so its offloads are
        never prefetched) are waited on here, so no copy can outlive the step that issued it and touch a
        device block the next step reuses. Their errors are raised here.
        """
        leftovers = list(self._pending_offload.values()) + list(self._pending_prefetch.values())
        self._pending_offload.clear()
        self._pending_prefetch.clear()
        for job in leftovers:
            self._wait(job, count_stall=False)
        self._stats.iterations += 1

    # -- internals ------------------------------------------------------------------------------------------
    def _submit(self, job: _Job, pending: dict[str, _Job]) -> None:
        if not self._thread.is_alive():
            raise TransferError("the transfer thread is not running (the store was closed)")
        pending[job.tensor] = job
        job.submitted = time.perf_counter()
        self._jobs.put(job)

    def _wait(self, job: _Job, count_stall: bool = True) -> None:
        t = time.perf_counter()
        while not job.done.wait(timeout=1.0):
            if not self._thread.is_alive():
                raise TransferError(f"the transfer thread died before the {job.kind} of '{job.tensor}' landed")
        if count_stall:
            self._stats.stall_time_s += time.perf_counter() - t
        self._account(job)
        if job.error is not None:
            raise TransferError(f"{job.kind} of '{job.tensor}' (issued at step {job.step}) failed: "
                                f"{type(job.error).__name__}: {job.error}") from job.error

    def _account(self, job: _Job) -> None:
        st = self._stats
        st.transfer_time_s += job.end - job.start
        if job.kind == "offload":
            st.offloads += 1
            st.offloaded_bytes += job.nbytes
        else:
            st.prefetches += 1
            st.prefetched_bytes += job.nbytes
        if job.tensor in self._on_disk:
            st.spilled_bytes += job.nbytes
        if self.trace is not None:
            from ..executor import TraceEvent

            self.trace.append(TraceEvent(f"{job.kind} {job.tensor}", "transfer", job.start - self.t0,
                                         job.end - job.start, job.step, -1))
        # Drop the job's array references: a finished job must not keep a device view alive.
        job.src = job.dst = None  # type: ignore[assignment]

    # -- reporting and lifetime -----------------------------------------------------------------------------
    def stats(self) -> TransferStats:
        """A copy of the statistics so far."""
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
        """Stop the thread and delete the spill file. Pending copies are drained first."""
        if self._finalizer.alive:
            self._finalizer()
        self._buffers.clear()

    def __enter__(self) -> "HostStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def transfer_json(host: HostStore | None, iterations: int | None = None) -> dict:
    """The measured transfer statistics as JSON keys (per training step where the key is a byte count).

    `iterations` divides the byte counts (the number of training steps the stats cover; default: the store's
    own count of iterations, which includes evaluation passes).
    """
    s = host.stats() if host is not None else TransferStats()
    n = iterations if iterations else max(s.iterations, 1)
    return {"offloaded_bytes": s.offloaded_bytes // n, "prefetched_bytes": s.prefetched_bytes // n,
            "transfer_hidden_fraction": s.hidden_fraction, "copy_bandwidth_bytes_per_s": s.bandwidth,
            "transfer_time_s": s.transfer_time_s / n, "transfer_stall_s": s.stall_time_s / n,
            "host_ram_bytes": s.ram_bytes, "host_disk_bytes": s.disk_bytes}
