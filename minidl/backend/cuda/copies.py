"""The CUDA backend's copies: host <-> device staging and fills (`to_host`, `copy_in`, `fill`, `accumulate`,
`copy`), and the asynchronous offloads and prefetches of the host store, on copy streams of their own, with the
timing events `transfer_times` maps onto the host clock; the same events time a traced step's calls
(`DeviceClock`)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import launches
from .ops import F32, on_compute


@dataclass(slots=True)
class Transfer:
    """An asynchronous device<->host copy on the transfer stream, with the timing events around it.

    `start` and `done` are recorded on the transfer stream just before and just after the copy; `reached` is
    recorded on the compute stream by `transfer_wait`, where compute begins to wait for `done` (None while
    nobody waited). All three are timing-enabled, so `transfer_times` can measure both the copy and the stall.
    """

    kind: str    # "offload" (device -> host) or "prefetch" (host -> device)
    nbytes: int
    done: Any
    start: Any = None
    reached: Any = None


class CopyOps:
    """Copies between host and device and within the arena, and the timed host transfers.

    A mixin of `CUDABackend` (backend.py), which holds the streams, the kernels and the helpers these methods
    call (`_check`, `_launch`, `_graph`...)."""

    # -- memory helpers --------------------------------------------------------------------------------------
    def to_host(self, a) -> np.ndarray:
        if isinstance(a, np.ndarray):
            return a
        self.compute.synchronize()
        return a.get(stream=self.compute)

    @on_compute
    def copy_in(self, dst, src) -> None:
        if isinstance(src, self.cp.ndarray):
            self.cp.copyto(dst, src.reshape(dst.shape))
            return
        # np.asarray + copy, not np.ascontiguousarray: that one returns at least 1-d, so a 0-d source (a loss
        # delta) became shape (1,) and cupy's set() refused it for the 0-d destination.
        host = np.asarray(src, dtype=dst.dtype).reshape(dst.shape)
        if not host.flags.c_contiguous:
            host = host.copy(order="C")
        # Pageable host memory: the copy is staged before memcpyAsync returns, so `host` may die afterwards.
        dst.set(host, stream=self.compute)

    @on_compute
    def fill(self, dst, value: float) -> None:
        dst.fill(value)

    @on_compute
    def fill_loss_scale(self, dst, scale: float) -> None:
        """fp16's seed of the loss's gradient: `scale`, or while a graph is captured its device slot (the scale
        changes between replays: backend/scalars.py)."""
        gs = self.graph_scalars
        if gs is None:
            dst.fill(scale)
        else:
            self.cp.copyto(dst, gs.scale_slot(scale))

    @on_compute
    def unscale(self, g, inv_scale: float) -> None:
        """g *= the float32 inverse loss scale (while a graph is captured, read from its device slot)."""
        gs = self.graph_scalars
        self.cp.multiply(g, np.float32(inv_scale) if gs is None else gs.inv_scale_slot(inv_scale), out=g)

    @on_compute
    def accumulate(self, dst, src) -> None:
        if dst.dtype == F32 and src.dtype == F32 and dst.flags.c_contiguous and src.flags.c_contiguous:
            self._launch(launches.accumulate(dst, src, self.limits))
        else:
            self.cp.add(dst, src, out=dst)

    @on_compute
    def copy(self, dst, src) -> None:
        self.cp.copyto(dst, src)
    # -- copies between pinned host buffers and device views ----------------------------------------------------
    def _upload(self, dst, src: np.ndarray, stream) -> None:
        """Enqueue pinned host array `src` -> device view `dst` on `stream` (checked by `_check_transfer`).

        cudaMemcpyAsync itself, not cupy's `ndarray.set`: cupy refuses every host->device copy on a stream that
        is being captured (a pageable source would go through a staging buffer a graph cannot replay), and the
        host store's buffers and a graph's input buffers are pinned, so their copies belong in the graph."""
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(self._ptr(dst), src.ctypes.data, int(src.nbytes), rt.memcpyHostToDevice, stream.ptr)

    def _download(self, src, dst: np.ndarray, stream) -> None:
        """Enqueue device view `src` -> pinned host array `dst` on `stream`; see `_upload`."""
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(dst.ctypes.data, self._ptr(src), int(dst.nbytes), rt.memcpyDeviceToHost, stream.ptr)

    # -- host transfers (offload / prefetch) -----------------------------------------------------------------
    def host_empty(self, shape, dtype) -> np.ndarray:
        """A numpy array in pinned (page-locked) host memory: the host store's buffers."""
        return self.cpx.empty_pinned(shape, dtype=dtype)

    def offload_async(self, src, dst: np.ndarray) -> Transfer:
        """Copy device view `src` into host array `dst` on the transfer stream, after every kernel already
        enqueued on the compute stream (which may still be writing `src`). Returns at once."""
        self._check_transfer(src, dst)
        self._anchor()  # before the first copy: every transfer event is then later than the anchor
        ready = self._event()
        ready.record(self.compute)
        self.transfer.wait_event(ready)
        start = self._record(self.transfer, timing=True)
        self._download(src, dst, self.transfer)
        return Transfer("offload", int(src.nbytes), self._record(self.transfer, timing=True), start)

    def prefetch_async(self, src: np.ndarray, dst) -> Transfer:
        """Copy host array `src` into device view `dst` on the prefetch stream, after every kernel already
        enqueued on the compute stream (the block's previous tenant may still be in use). Returns at once."""
        self._check_transfer(dst, src)
        self._anchor()
        stream = self.prefetch_stream
        ready = self._event()
        ready.record(self.compute)
        stream.wait_event(ready)
        start = self._record(stream, timing=True)
        self._upload(dst, src, stream)
        return Transfer("prefetch", int(dst.nbytes), self._record(stream, timing=True), start)

    def transfer_wait(self, t: Transfer) -> None:
        """Make the compute stream wait for `t` (device-side: the host does not block). Call before a kernel
        reads a prefetched tensor, and before an offloaded tensor's block is reused.

        The `reached` event marks where compute starts waiting, so `transfer_times` can tell how long it stalled.
        """
        t.reached = self._record(self.compute, timing=True)
        self.compute.wait_event(t.done)

    def transfer_sync(self, t: Transfer) -> None:
        """Block the host until `t` has completed (e.g. before reading or reusing its host buffer)."""
        t.done.synchronize()

    @staticmethod
    def transfer_done(t: Transfer) -> bool:
        return bool(t.done.done)

    def transfer_times(self, t: Transfer) -> tuple[float, float, float]:
        """(start_s, end_s, stall_s) of transfer `t`, in seconds; blocks until the copy (and the compute stream's
        wait for it, if any) has happened.

        These are device times mapped onto the host's `time.perf_counter` clock: the first transfer records an
        anchor event on the compute stream, synchronizes it and reads `perf_counter()` right after (once per
        backend, before any transfer event exists, so every elapsed time read from it is positive), and every
        time is then the anchor's host time plus `get_elapsed_time(anchor, event)`. The offset is approximate
        (the host wakes up a few microseconds after the anchor completes, and the clocks may drift apart over a
        long run), the durations exact: both ends are device timestamps. `stall_s` is how long the compute
        stream sat at `transfer_wait` before the copy completed, elapsed(reached, done), clamped at 0 when the
        copy was done first; 0 when nobody waited.
        """
        t.done.synchronize()
        anchor, anchor_s = self._anchor()
        ms = self.cp.cuda.get_elapsed_time  # milliseconds from its first event to its second
        start_s = anchor_s + ms(anchor, t.start) / 1e3
        end_s = anchor_s + ms(anchor, t.done) / 1e3
        stall_s = 0.0
        if t.reached is not None:
            t.reached.synchronize()  # recorded on the compute stream, which may still be behind
            stall_s = max(0.0, ms(t.reached, t.done) / 1e3)
        return start_s, end_s, stall_s

    def call_clock(self) -> "DeviceClock":
        """Times a traced call by events on the compute stream around the kernels it enqueues."""
        return DeviceClock(self)

    def _anchor(self) -> tuple[Any, float]:
        """A completed compute-stream event and the `perf_counter()` time just after it (made once, by the first
        transfer)."""
        if self._clock_anchor is None:
            ev = self._record(self.compute, timing=True)
            ev.synchronize()
            self._clock_anchor = (ev, time.perf_counter())
        return self._clock_anchor

    def _event(self, timing: bool = False):
        """A CUDA event; timing only where it is measured (a timing event costs more to record and wait on)."""
        return self.cp.cuda.Event(disable_timing=not timing)

    def _record(self, stream, timing: bool = False):
        ev = self._event(timing)
        ev.record(stream)
        return ev

    @staticmethod
    def _check_transfer(dev, host) -> None:
        if not isinstance(host, np.ndarray):
            raise TypeError(f"host side of a transfer must be a numpy array, got {type(host).__name__}")
        if tuple(dev.shape) != tuple(host.shape) or np.dtype(dev.dtype) != host.dtype:
            raise ValueError(f"transfer between {tuple(dev.shape)} {dev.dtype} (device) and {host.shape} "
                             f"{host.dtype} (host): shapes and dtypes must match")
        if not host.flags.c_contiguous:
            raise ValueError("host side of a transfer must be C-contiguous")


class DeviceClock:
    """The GPU's `CallClock` (backend/base.py): a timing event recorded on the compute stream at each mark, read
    once it has completed on the host clock the way `transfer_times` reads a copy's (the backend's anchor event:
    the offset approximate, the duration exact)."""

    def __init__(self, backend):
        self._be = backend
        backend._anchor()   # now, before any mark: every event is then later than the anchor

    def mark(self):
        return self._be._record(self._be.compute, timing=True)

    def read(self, start, end) -> tuple[float, float]:
        end.synchronize()
        anchor, anchor_s = self._be._anchor()
        ms = self._be.cp.cuda.get_elapsed_time
        return anchor_s + ms(anchor, start) / 1e3, ms(start, end) / 1e3
