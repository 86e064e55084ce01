"""Communicators: what data-parallel training needs of a group of ranks, and nothing more.

Rules: collectives are nonblocking (`test` drives progress: MPI progresses only inside MPI calls); every wait has
a timeout, and every error names this rank, the other and what was awaited; sums run in rank order on every rank.
`fail` tells every rank on a communicator of its own, then aborts the job.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from ..core.errors import DistError

POLL_S = 2e-4
"""Seconds between tests while waiting: short against a step, yet no spinning on a core another rank needs."""

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a rank waits for a collective before deciding another rank hung (`--comm-timeout`)."""

FAIL_GRACE_S = 10.0
"""Seconds a failing rank waits for acknowledgements before aborting the job."""

_FAIL_TAG, _ACK_TAG = 17, 18
_MSG_BYTES = 4096


class PeerFailed(DistError):
    """Another rank reported that it failed: this one stops too."""


class Request:
    """A started collective: the library's handle, and whether it was seen complete."""

    __slots__ = ("handle", "done")

    def __init__(self, handle=None, done: bool = False):
        self.handle, self.done = handle, done


class Communicator:
    """A single process: every collective is already complete."""

    kind = "local"

    def __init__(self, rank: int = 0, size: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.rank, self.size, self.timeout_s = int(rank), int(size), float(timeout_s)
        self.local_rank = self.rank  # index among its node's ranks (its GPU)

    @property
    def reduction(self) -> str:
        """Default bucket reduction: `gather` up to 2 ranks (one collective, no more memory), `ring` beyond."""
        return "gather" if self.size <= 2 else "ring"

    def start_allgather(self, buf, second: bool = False) -> Request:
        """`second`: `ring`'s all-gather, on a communicator of its own (MPI matches collectives by start order)."""
        return Request(done=True)

    def start_alltoall(self, send, recv) -> Request:
        recv[...] = send
        return Request(done=True)

    def test(self, req: Request) -> bool:
        return req.done

    def wait(self, req: Request, what: str) -> None:
        req.done = True

    def mean(self, value: float) -> float:
        return float(value)

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is on any (a collective)."""
        return bool(flag)

    def barrier(self) -> None:
        pass

    def exchange(self, data: bytes, what: str) -> list[bytes]:
        """Every rank's `data` in rank order (lengths, then padded bytes)."""
        n = self.size
        lens = np.zeros((n, 1), np.int64)
        lens[self.rank, 0] = len(data)
        self.wait(self.start_allgather(lens), what)
        buf = np.zeros((n, max(int(lens.max()), 1)), np.uint8)
        buf[self.rank, :len(data)] = np.frombuffer(data, np.uint8)
        self.wait(self.start_allgather(buf), what)
        return [bytes(buf[r, :int(lens[r, 0])]) for r in range(n)]

    def bcast(self, obj):
        """Rank 0's `obj` on every rank (NCCL's unique id)."""
        return obj

    def check_peers(self) -> None:
        """Raise if another rank reported a failure."""

    def fail(self, message: str, code: int = 1) -> None:
        """Report that this rank cannot go on."""

    def stop(self, code: int = 1) -> None:
        """End this rank after a peer's failure."""

    def close(self) -> None:
        """Release what the communicator holds."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


class MPIComm(Communicator):
    """Over an mpi4py communicator, with duplicates for collectives and failure notices."""

    kind = "mpi"

    def __init__(self, comm=None, timeout_s: float = DEFAULT_TIMEOUT_S):
        from mpi4py import MPI

        self.MPI = MPI
        base = comm if comm is not None else MPI.COMM_WORLD
        super().__init__(base.Get_rank(), base.Get_size(), timeout_s)
        self.base = base
        self.local_rank = base.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        self.comm = base.Dup()   # collectives
        self.comm2 = base.Dup()  # the second halves of `ring` reductions
        self.ctl = base.Dup()    # failure notices and acknowledgements
        self._notice = bytearray(_MSG_BYTES)
        self._notice_req = self.ctl.Irecv([self._notice, MPI.BYTE], source=MPI.ANY_SOURCE, tag=_FAIL_TAG)
        self._status = MPI.Status()

    def start_allgather(self, buf, second: bool = False) -> Request:
        if not (isinstance(buf, np.ndarray) and buf.flags.c_contiguous and buf.shape[0] == self.size):
            raise DistError(f"rank {self.rank}: all-gather buffer must be a C-contiguous array with {self.size} "
                            f"rows, got {type(buf).__name__} {getattr(buf, 'shape', None)}")
        return Request((self.comm2 if second else self.comm).Iallgather(self.MPI.IN_PLACE, buf))

    def start_alltoall(self, send, recv) -> Request:
        for a in (send, recv):
            if not (isinstance(a, np.ndarray) and a.flags.c_contiguous and a.size % self.size == 0):
                raise DistError(f"rank {self.rank}: all-to-all buffers must be C-contiguous arrays of {self.size} "
                                f"equal chunks, got {type(a).__name__} {getattr(a, 'shape', None)}")
        return Request(self.comm.Ialltoall(send, recv))

    def test(self, req: Request) -> bool:
        if not req.done:
            self.check_peers()
            req.done = bool(req.handle.Test())
        return req.done

    def wait(self, req: Request, what: str) -> None:
        t0 = time.perf_counter()
        while not self.test(req):
            if time.perf_counter() - t0 > self.timeout_s:
                raise DistError(f"rank {self.rank} of {self.size}: {what} did not complete within "
                                f"{self.timeout_s:g} s (--comm-timeout): another rank stopped answering")
            time.sleep(POLL_S)

    def mean(self, value: float) -> float:
        buf = np.zeros((self.size, 1), np.float64)
        buf[self.rank, 0] = value
        self.wait(self.start_allgather(buf), "the mean of the loss")
        total = 0.0
        for r in range(self.size):  # rank order: the same bits on every rank
            total += float(buf[r, 0])
        return total / self.size

    def any(self, flag: bool) -> bool:
        buf = np.zeros((self.size, 1), np.float64)
        buf[self.rank, 0] = float(bool(flag))
        self.wait(self.start_allgather(buf), "the agreement to stop")
        return bool(buf.any())

    def barrier(self) -> None:
        self.wait(Request(self.comm.Ibarrier()), "a barrier")

    def bcast(self, obj):
        return self.comm.bcast(obj, root=0)

    def check_peers(self) -> None:
        if self._notice_req is None or not self._notice_req.Test(self._status):
            return
        src = self._status.Get_source()
        n = self._status.Get_count(self.MPI.BYTE)
        self._notice_req = None
        msg = bytes(self._notice[:n]).decode(errors="replace")
        self.ctl.Send([b"ack", self.MPI.BYTE], dest=src, tag=_ACK_TAG)
        raise PeerFailed(f"rank {self.rank} of {self.size}: stopping because rank {src} failed: {msg}")

    def fail(self, message: str, code: int = 1) -> None:
        """Tell every other rank, wait for acknowledgements (a rank that failed too counts), abort the job."""
        MPI = self.MPI
        print(f"minidl: rank {self.rank} of {self.size}: {message}; stopping every rank", file=sys.stderr,
              flush=True)
        data = message.encode()[:_MSG_BYTES]
        peers = [r for r in range(self.size) if r != self.rank]
        sends = [self.ctl.Isend([data, MPI.BYTE], dest=r, tag=_FAIL_TAG) for r in peers]
        acks = {r: self.ctl.Irecv([bytearray(8), MPI.BYTE], source=r, tag=_ACK_TAG) for r in peers}
        t0 = time.perf_counter()
        while acks and time.perf_counter() - t0 < FAIL_GRACE_S:
            for r in [r for r, req in acks.items() if req.Test()]:
                del acks[r]
            if self._notice_req is not None and self._notice_req.Test(self._status):
                acks.pop(self._status.Get_source(), None)  # that rank failed as well
                self._notice_req = self.ctl.Irecv([self._notice, MPI.BYTE], source=MPI.ANY_SOURCE, tag=_FAIL_TAG)
            time.sleep(POLL_S)
        del sends
        self.base.Abort(code)

    def stop(self, code: int = 1) -> None:
        """After a peer's failure: abort the job if the failing rank has not within the grace."""
        time.sleep(FAIL_GRACE_S)
        self.base.Abort(code)

    def close(self) -> None:
        """Withdraw the failure-notice receive (MPI warns about one pending at exit)."""
        if self._notice_req is not None:
            self._notice_req.Cancel()
            self._notice_req.Wait()
            self._notice_req = None
        self.barrier()  # past it, nobody can send a notice
