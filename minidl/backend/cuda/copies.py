"""The CUDA backend's copies: host <-> device staging and fills, and the host store's offloads and prefetches on
copy streams of their own, timed by events mapped onto the host clock (as `DeviceClock` times traced calls).
Rule: a bf16 tensor crosses as its bits (device uint16, host bfloat16: `halves`), never converted on the way."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import halves, launches
from .ops import F32, on_compute


@dataclass(slots=True)
class Transfer:
    """An asynchronous copy between `start` and `done` (copy stream) and `reached`, where compute began to wait
    for it (None while nobody waited): timing events for the copy and the stall."""

    kind: str    # "offload" (device -> host) or "prefetch" (host -> device)
    nbytes: int
    done: Any
    start: Any = None
    reached: Any = None


class CopyOps:
    """Copies and timed host transfers: a mixin of `CUDABackend`, which holds the streams and helpers."""

    # -- memory helpers
    def to_host(self, a) -> np.ndarray:
        """A host copy of device array `a` (bf16 bits come back as bfloat16)."""
        if isinstance(a, np.ndarray):
            return a
        self.compute.synchronize()
        return a.get(stream=self.compute).view(halves.host_dtype(a.dtype))

    @on_compute
    def copy_in(self, dst, src) -> None:
        """dst = src (host values or a device array); into a half dst, rounded once from float32 (the loaders'
        dtype) to nearest even, as the CPU's `copy_in`, a device source by `copy`'s kernel."""
        if isinstance(src, self.cp.ndarray):
            self.copy(dst, src.reshape(dst.shape))
            return
        # not np.ascontiguousarray: it makes a 0-d source 1-d, which cupy's set() refuses for a 0-d view
        half = halves.half_of(dst)
        if half is None:
            host = np.asarray(src, dtype=dst.dtype).reshape(dst.shape)
        else:
            with np.errstate(over="ignore", invalid="ignore"):   # fp16 overflows to inf
                host = np.asarray(np.asarray(src, dtype=F32), dtype=halves.host_dtype(dst.dtype))
            host = host.reshape(dst.shape).view(dst.dtype)
        if not host.flags.c_contiguous:
            host = host.copy(order="C")
        # pageable memory is staged before memcpyAsync returns: `host` may die afterwards
        dst.set(host, stream=self.compute)

    @on_compute
    def fill(self, dst, value: float) -> None:
        """dst = value (into bf16 storage as the bits of its rounding)."""
        if halves.half_of(dst) == "bf16":
            value = int(np.asarray(value, F32).astype(halves.BF16).view(np.uint16))
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
        """dst += src; half storage by the kernel's half form (summed in float32, rounded once)."""
        if halves.half_of(dst) is not None or halves.half_of(src) is not None:
            self._check_io("accumulate", dst=dst, src=src)
            self._launch(launches.accumulate(dst, src, self.limits))
        elif dst.dtype == F32 and src.dtype == F32 and dst.flags.c_contiguous and src.flags.c_contiguous:
            self._launch(launches.accumulate(dst, src, self.limits))
        else:
            self.cp.add(dst, src, out=dst)

    @on_compute
    def copy(self, dst, src) -> None:
        """dst = src; a float32 `src` into half storage rounds to nearest even (a weight copy's refresh)."""
        if halves.half_of(dst) is not None and src.dtype == F32:
            self._check_io("copy", dst=dst)
            self._check("copy", src=src)
            self._launch(launches.round_copy(dst, src, self.limits))
            return
        if dst.dtype != src.dtype and (halves.half_of(dst) or halves.half_of(src)):
            raise TypeError(f"copy: {src.dtype} into {dst.dtype}: half storage is copied from its own dtype or "
                            f"rounded from float32")
        self.cp.copyto(dst, src)

    # -- copies between pinned host buffers and device views
    def _upload(self, dst, src: np.ndarray, stream) -> None:
        """Pinned `src` -> `dst` on `stream` by cudaMemcpyAsync: cupy's `set` refuses a capturing stream."""
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(self._ptr(dst), src.ctypes.data, int(src.nbytes), rt.memcpyHostToDevice, stream.ptr)

    def _download(self, src, dst: np.ndarray, stream) -> None:
        """`src` -> pinned `dst` on `stream`, as `_upload`."""
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(dst.ctypes.data, self._ptr(src), int(dst.nbytes), rt.memcpyDeviceToHost, stream.ptr)

    # -- host transfers (offload / prefetch)
    def host_empty(self, shape, dtype) -> np.ndarray:
        """A numpy array in pinned host memory; for a bf16 device array's uint16 dtype a bfloat16 one."""
        return self.cpx.empty_pinned(shape, dtype=halves.host_dtype(dtype))

    def offload_async(self, src, dst: np.ndarray) -> Transfer:
        """`src` -> `dst` on the transfer stream, after the compute work already enqueued. Returns at once."""
        self._check_transfer(src, dst)
        self._anchor()  # every transfer event is later than the anchor
        ready = self._event()
        ready.record(self.compute)
        self.transfer.wait_event(ready)
        start = self._record(self.transfer, timing=True)
        self._download(src, dst, self.transfer)
        return Transfer("offload", int(src.nbytes), self._record(self.transfer, timing=True), start)

    def prefetch_async(self, src: np.ndarray, dst) -> Transfer:
        """`src` -> `dst` on the prefetch stream, after the compute work already enqueued. Returns at once."""
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
        """The compute stream waits for `t` (the host does not); `reached` marks where, to time the stall."""
        t.reached = self._record(self.compute, timing=True)
        self.compute.wait_event(t.done)

    def transfer_sync(self, t: Transfer) -> None:
        """Block the host until `t` has completed."""
        t.done.synchronize()

    def transfer_times(self, t: Transfer) -> tuple[float, float, float]:
        """(start_s, end_s, stall_s) of `t` on `time.perf_counter`'s clock via the anchor: offset approximate,
        durations exact. Blocks."""
        t.done.synchronize()
        anchor, anchor_s = self._anchor()
        ms = self.cp.cuda.get_elapsed_time  # milliseconds
        start_s = anchor_s + ms(anchor, t.start) / 1e3
        end_s = anchor_s + ms(anchor, t.done) / 1e3
        stall_s = 0.0
        if t.reached is not None:
            t.reached.synchronize()  # the compute stream may still be behind
            stall_s = max(0.0, ms(t.reached, t.done) / 1e3)
        return start_s, end_s, stall_s

    def call_clock(self) -> "DeviceClock":
        return DeviceClock(self)

    def _anchor(self) -> tuple[Any, float]:
        """A completed compute-stream event and `perf_counter()` just after it, made once."""
        if self._clock_anchor is None:
            ev = self._record(self.compute, timing=True)
            ev.synchronize()
            self._clock_anchor = (ev, time.perf_counter())
        return self._clock_anchor

    def _event(self, timing: bool = False):
        """A CUDA event; timing only where measured (it costs more)."""
        return self.cp.cuda.Event(disable_timing=not timing)

    def _record(self, stream, timing: bool = False):
        ev = self._event(timing)
        ev.record(stream)
        return ev

    @staticmethod
    def _check_transfer(dev, host) -> None:
        if not isinstance(host, np.ndarray):
            raise TypeError(f"host side of a transfer must be a numpy array, got {type(host).__name__}")
        if tuple(dev.shape) != tuple(host.shape) or np.dtype(dev.dtype) != halves.storage_dtype(host.dtype):
            raise ValueError(f"transfer between {tuple(dev.shape)} {dev.dtype} (device) and {host.shape} "
                             f"{host.dtype} (host): shapes and dtypes must match")
        if not host.flags.c_contiguous:
            raise ValueError("host side of a transfer must be C-contiguous")


class DeviceClock:
    """The GPU's `CallClock`: compute-stream events read as `transfer_times` reads a copy's."""

    def __init__(self, backend):
        self._be = backend
        backend._anchor()   # before any mark

    def mark(self):
        return self._be._record(self._be.compute, timing=True)

    def read(self, start, end) -> tuple[float, float]:
        end.synchronize()
        anchor, anchor_s = self._be._anchor()
        ms = self._be.cp.cuda.get_elapsed_time
        return anchor_s + ms(anchor, start) / 1e3, ms(start, end) / 1e3
