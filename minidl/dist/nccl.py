"""NCCL between GPUs (one per rank): the same buckets and ordered sums, the all-gather on the device.

Not yet run on a GPU: checked against cupy's `cupy.cuda.nccl` and tested on the host with a recording fake
(tests/dist/test_nccl_host.py); two ranks need two GPUs. MPI carries NCCL's unique id and keeps barriers, the
loss's mean and the failure protocol. The in-place all-gather (send = recv + rank * count) runs on its own stream
after an event on the compute stream; `wait` polls its done event with a timeout (a dead rank leaves NCCL waiting
forever), then makes the compute stream wait too, so the reducer's sum reads the gathered rows.
"""
from __future__ import annotations

import time

import numpy as np

from ..core.errors import DistError
from .comm import POLL_S, Communicator, Request

_NCCL_TYPES = {np.dtype(np.float32): "NCCL_FLOAT32", np.dtype(np.float64): "NCCL_FLOAT64",
               np.dtype(np.float16): "NCCL_FLOAT16"}


class NCCLComm(Communicator):
    kind = "nccl"

    @property
    def reduction(self) -> str:
        return "gather"  # NCCL has no all-to-all

    def __init__(self, mpi: Communicator, backend, nccl=None, cupy=None):
        """`mpi`: the ranks' MPI communicator; `backend`: this rank's CUDA backend; `nccl`/`cupy`: test fakes."""
        super().__init__(mpi.rank, mpi.size, mpi.timeout_s)
        if cupy is None:
            import cupy
        if nccl is None:
            from cupy.cuda import nccl
        self.mpi, self.be, self.cp, self.nccl = mpi, backend, cupy, nccl
        uid = nccl.get_unique_id() if mpi.rank == 0 else None
        uid = mpi.bcast(uid)
        try:
            self.comm = nccl.NcclCommunicator(mpi.size, uid, mpi.rank)
        except Exception as e:  # e.g. two ranks on one GPU
            raise DistError(f"rank {mpi.rank} of {mpi.size}: NCCL could not start ({type(e).__name__}: {e}); one "
                            f"GPU per rank is needed (a 1-GPU machine runs only `mpiexec -n 1`)") from e
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def start_allgather(self, buf, second: bool = False) -> Request:
        kind = _NCCL_TYPES.get(np.dtype(buf.dtype))
        if kind is None or not buf.flags.c_contiguous or buf.shape[0] != self.size:
            raise DistError(f"rank {self.rank}: NCCL all-gather needs a C-contiguous float16/32/64 buffer with "
                            f"{self.size} rows, got {buf.dtype} {buf.shape}")
        count = int(np.prod(buf.shape[1:]))
        ready = self.cp.cuda.Event(disable_timing=True)
        ready.record(self.be.compute)  # after the reducer packed this rank's row
        self.stream.wait_event(ready)
        recv = buf.data.ptr
        send = recv + self.rank * count * buf.dtype.itemsize  # in place
        self.comm.allGather(send, recv, count, getattr(self.nccl, kind), self.stream.ptr)
        done = self.cp.cuda.Event(disable_timing=True)
        done.record(self.stream)
        return Request(done)

    def test(self, req: Request) -> bool:
        if not req.done:
            self.mpi.check_peers()
            req.done = bool(req.handle.done)
        return req.done

    def wait(self, req: Request, what: str) -> None:
        t0 = time.perf_counter()
        while not self.test(req):
            if time.perf_counter() - t0 > self.timeout_s:
                self.comm.abort()
                raise DistError(f"rank {self.rank} of {self.size}: {what} (NCCL) did not complete within "
                                f"{self.timeout_s:g} s (--comm-timeout): another rank stopped answering")
            time.sleep(POLL_S)
        self.be.compute.wait_event(req.handle)

    # host-side collectives, failures and shutdown: MPI's
    def mean(self, value: float) -> float:
        return self.mpi.mean(value)

    def any(self, flag: bool) -> bool:
        return self.mpi.any(flag)

    def barrier(self) -> None:
        self.mpi.barrier()

    def bcast(self, obj):
        return self.mpi.bcast(obj)

    def exchange(self, data: bytes, what: str) -> list[bytes]:
        return self.mpi.exchange(data, what)

    def check_peers(self) -> None:
        self.mpi.check_peers()

    def fail(self, message: str, code: int = 1) -> None:
        self.mpi.fail(message, code)

    def stop(self, code: int = 1) -> None:
        self.mpi.stop(code)

    def close(self) -> None:
        self.stream.synchronize()
        self.comm.destroy()
        self.mpi.close()
