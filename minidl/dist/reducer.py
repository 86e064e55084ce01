"""The gradient reducer: runs a plan's ALLREDUCE and REDUCED events on a communicator.

ALLREDUCE packs the bucket's gradients into this rank's row and starts the collective; `progress()`, after every
backward step, tests it (MPI progresses only inside MPI calls); REDUCED waits, divides by N, copies back. Every
element is ((g_0 + g_1) + ...) + g_{N-1} on every rank (`decisions/allreduce.py`): `gather` adds rows 1..N-1 into
row 0; `ring` sums row 1's N chunks into this rank's chunk of row 0, then all-gathers row 0. Hidden share per step
= 1 - exposed / union of in-flight intervals; completion is seen only at a test, so in-flight time reads long.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..core.vocab import TraceEvent
from .comm import Communicator, Request


@dataclass(slots=True)
class _Pending:
    req: Request
    step: int
    start: float
    buf: object = None
    scattered: bool = True   # ring: False while the all-to-all runs
    done: float | None = None


@dataclass(slots=True)
class ReduceStats:
    """Totals: in-flight seconds (union per step), seconds the update waited, buckets."""

    inflight_s: float = 0.0
    exposed_s: float = 0.0
    buckets: int = 0
    steps: int = 0
    bytes_per_step: int = 0   # gradient bytes this rank sends a step

    @property
    def hidden_fraction(self) -> float:
        return 1.0 - self.exposed_s / self.inflight_s if self.inflight_s > 0 else 1.0

    def to_json(self) -> dict:
        return {"allreduce_inflight_s": self.inflight_s, "allreduce_exposed_s": self.exposed_s,
                "allreduce_hidden_fraction": self.hidden_fraction, "allreduce_buckets": self.buckets,
                "allreduce_buckets_per_step": self.buckets // self.steps if self.steps else 0,
                "allreduce_bytes_per_step": self.bytes_per_step}


@dataclass(slots=True)
class GradientReducer:
    comm: Communicator
    be: object
    t0: float = 0.0
    trace: list | None = None
    reduction: str = "gather"
    stats: ReduceStats = field(default_factory=ReduceStats)
    _pending: dict[str, _Pending] = field(default_factory=dict)
    _intervals: list[tuple[float, float]] = field(default_factory=list)
    _step_bytes: int = 0

    def start(self, bucket: str, buf, grads: list, step: int) -> None:
        n, ring = self.comm.size, self.reduction == "ring"
        if (buf.shape[0] != n and not ring) or (ring and (buf.shape[0] != 2 or buf.shape[1] % n)):
            raise ValueError(f"{bucket} is {buf.shape}, not a '{self.reduction}' bucket for {n} ranks: the plan "
                             f"was made for another world size or reduction")
        row = buf[0] if ring else buf[self.comm.rank]
        off = 0
        for g in grads:
            self.be.copy(row[off:off + g.size].reshape(g.shape), g)
            off += g.size
        if off < row.size:
            self.be.fill(row[off:], 0.0)  # padding to N equal chunks
        self._step_bytes += off * row.dtype.itemsize
        req = self.comm.start_alltoall(buf[0], buf[1]) if ring else self.comm.start_allgather(buf)
        self._pending[bucket] = _Pending(req, step, time.perf_counter(), buf, scattered=not ring)

    def _gather_sums(self, p: _Pending) -> None:
        """Ring, all-to-all done: row 1's chunks summed in rank order into ours of row 0, then its all-gather."""
        n = self.comm.size
        chunks = p.buf[1].reshape(n, -1)
        mine = p.buf[0].reshape(n, -1)[self.comm.rank]
        self.be.copy(mine, chunks[0])
        for r in range(1, n):
            self.be.accumulate(mine, chunks[r])
        p.req = self.comm.start_allgather(p.buf[0].reshape(n, -1), second=True)
        p.scattered = True

    def progress(self) -> None:
        """Test the pending collectives; `ring` all-gathers start in bucket order, as MPI needs to match them."""
        in_order = True
        for p in self._pending.values():  # in start order
            if p.done is not None:
                continue
            if self.comm.test(p.req):
                if p.scattered:
                    p.done = time.perf_counter()
                elif in_order:
                    self._gather_sums(p)
            in_order = in_order and p.scattered

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def finish(self, bucket: str, buf, grads: list, step: int) -> None:
        p = self._pending.pop(bucket)
        t = time.perf_counter()
        if p.done is None:
            if not p.scattered:
                self.comm.wait(p.req, f"the reduce-scatter of {bucket}")
                self._gather_sums(p)
            self.comm.wait(p.req, f"the all-reduce of {bucket}")
            p.done = time.perf_counter()
            self.stats.exposed_s += p.done - t
        self._intervals.append((p.start, p.done))
        if self.trace is not None:
            self.trace.append(TraceEvent(f"allreduce {bucket}", "allreduce", p.start - self.t0, p.done - p.start,
                                         p.step, 0))
        n = self.comm.size
        acc = buf[0]
        if self.reduction == "gather":
            for r in range(1, n):  # rank order
                self.be.accumulate(acc, buf[r])
        if n > 1:
            _divide(self.be, acc, n)
        off = 0
        for g in grads:
            self.be.copy(g, acc[off:off + g.size].reshape(g.shape))
            off += g.size
        self.stats.buckets += 1

    def end_iteration(self) -> None:
        """Close a step: the union of its in-flight intervals."""
        if self._pending:
            raise RuntimeError(f"all-reduces still pending at the end of a step: {sorted(self._pending)}")
        total, end = 0.0, float("-inf")
        for s, e in sorted(self._intervals):
            if e > end:
                total += e - max(s, end)
                end = e
        self.stats.inflight_s += total
        self.stats.steps += 1
        self.stats.bytes_per_step, self._step_bytes = self._step_bytes, 0
        self._intervals.clear()


def _divide(be, a, n: int) -> None:
    """a /= n on the backend's compute stream."""
    with be.compute_scope():
        a /= n
