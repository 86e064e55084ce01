"""Measuring the host link of a CUDA device, for the simulator's measured profile (`memory/calibrate.py`).

With device events on the backend's two copy streams: each direction alone and while the other runs (what the
duplex model uses), best of `repeats`; the per-copy latency, the median of small copies. Runs only where a GPU
is (`CUDABackend.measure_link`); host tests give `LinkMeasurement`s directly.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

#: Bytes of the latency copies (their bytes negligible).
LATENCY_BYTES = 4096
#: Bytes of the bandwidth copies (the link's steady state).
BANDWIDTH_BYTES = 256 << 20


@dataclass(slots=True, frozen=True)
class LinkMeasurement:
    """Host link figures in bytes/s and seconds."""

    h2d_bw: float           # host -> device alone
    d2h_bw: float           # device -> host alone
    duplex_h2d_bw: float    # host -> device while a device -> host copy runs
    duplex_d2h_bw: float    # device -> host while a host -> device copy runs
    latency_s: float        # per-copy cost besides the bytes (median of small copies, both directions)
    nbytes: int = BANDWIDTH_BYTES
    device: str = ""

    def to_json(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def measure_link(be, nbytes: int = BANDWIDTH_BYTES, repeats: int = 3, latency_repeats: int = 21) -> LinkMeasurement:
    """Measure `be`'s host link on its copy streams (d2h `transfer`, h2d `prefetch_stream`); blocks the
    host: run before training, never inside a step."""
    cp = be.cp
    n = int(nbytes) // 4
    dev_a, dev_b = cp.empty(n, np.float32), cp.empty(n, np.float32)
    host_a, host_b = be.host_empty((n,), np.float32), be.host_empty((n,), np.float32)
    host_a[...] = 1.0
    d2h, h2d = be.transfer, be.prefetch_stream

    def timed(stream, copy) -> tuple:
        start = cp.cuda.Event()
        end = cp.cuda.Event()
        start.record(stream)
        copy(stream)
        end.record(stream)
        return start, end

    def seconds(pair) -> float:
        pair[1].synchronize()
        return cp.cuda.get_elapsed_time(*pair) / 1e3

    def to_host(stream, src=dev_a, dst=host_b):
        src.get(stream=stream, out=dst, blocking=False)

    def to_device(stream, src=host_a, dst=dev_b):
        dst.set(src, stream=stream)

    be.synchronize()
    alone_d2h = min(seconds(timed(d2h, to_host)) for _ in range(repeats))
    alone_h2d = min(seconds(timed(h2d, to_device)) for _ in range(repeats))
    both_d2h, both_h2d = [], []
    for _ in range(repeats):
        a = timed(d2h, to_host)
        b = timed(h2d, to_device)
        both_d2h.append(seconds(a))
        both_h2d.append(seconds(b))
    small = LATENCY_BYTES // 4
    s_dev, s_host = dev_a[:small], host_b[:small]
    lat = [seconds(timed(d2h, lambda s: to_host(s, s_dev, s_host))) for _ in range(latency_repeats)]
    lat += [seconds(timed(h2d, lambda s: to_device(s, host_a[:small], s_dev))) for _ in range(latency_repeats)]
    be.synchronize()
    nb = n * 4
    return LinkMeasurement(nb / alone_h2d, nb / alone_d2h, nb / max(both_h2d), nb / max(both_d2h),
                           statistics.median(lat), nb, getattr(be, "gpu_name", ""))
