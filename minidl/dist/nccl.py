"""NCCL between GPUs: the same buckets, the same ordered reduction, the all-gather on the device.

**Not yet run on a GPU.** Its calls were checked against cupy's `cupy.cuda.nccl` bindings and are tested on the
host against a recording fake (tests/dist/test_nccl_host.py). A machine with one GPU can run only a single-rank
NCCL job (NCCL refuses two ranks on one device), so even there the 2-rank path needs a machine with two GPUs.

How it works, rank by rank (one GPU per rank: the CLI picks device = the rank's index on its node):
- Setup: MPI starts the ranks and carries NCCL's unique id from rank 0 to the others (`bcast`); failures,
  barriers and the loss's mean stay on MPI (`MPIComm`), so the failure protocol is the same as on the CPU.
- `start_allgather(buf)`: `buf` is the bucket's arena view (a cupy array, one row per rank) whose row `rank`
  the reducer just packed on the compute stream. The all-gather runs on a stream of its own, after an event
  recorded on the compute stream (so it reads the packed row), in place: NCCL's in-place all-gather is
  `sendbuff = recvbuff + rank * count`. A `done` event is recorded after it.
- `test`: the event's state (no blocking). `wait`: poll the event with the same timeout as MPI (a rank that
  died leaves NCCL waiting forever on the device, so the host must not block without one), then make the
  compute stream wait for it too, so the ordered sum the reducer enqueues next reads the gathered rows.
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
        return "gather"  # NCCL has no all-to-all collective: buckets are reduced by the all-gather of whole rows

    def __init__(self, mpi: Communicator, backend, nccl=None, cupy=None):
        """`mpi`: the MPI communicator the ranks were started with; `backend`: this rank's CUDA backend (its
        compute stream orders the collectives). `nccl`/`cupy`: injected by host tests (default: cupy's)."""
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

    # Host-side collectives, failures and shutdown: MPI's.
    def mean(self, value: float) -> float:
        return self.mpi.mean(value)

    def any(self, flag: bool) -> bool:
        return self.mpi.any(flag)

    def barrier(self) -> None:
        self.mpi.barrier()

    def bcast(self, obj):
        return self.mpi.bcast(obj)

    def exchange(self, data: bytes, what: str) -> list[bytes]:
        return self.mpi.exchange(data, what)  # host bytes: NCCL gathers device buffers only

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
