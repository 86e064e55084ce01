"""Which group of ranks this process belongs to, and how a rank's failure ends the job everywhere.

Rule: the environment is read here, at the command's entry, and nowhere deeper; mpi4py (whose import initializes
MPI) is imported only when a launcher's variable is set (Hydra/Intel MPI: PMI_SIZE, Open MPI, PMIx).
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Mapping, TypeVar

from ..core.errors import DistError, exit_status
from .comm import DEFAULT_TIMEOUT_S, Communicator, PeerFailed

T = TypeVar("T")

LAUNCHER_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def launched_by_mpi(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return any(v in env for v in LAUNCHER_VARS)


def communicator(mode: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                 environ: Mapping[str, str] | None = None) -> Communicator | None:
    """`--dist MODE`'s ranks: None for one plain process ('off', or 'auto' outside mpiexec), else the launcher's
    MPI communicator; NCCL goes on top once the GPU backend exists (`with_nccl`)."""
    if mode not in ("auto", "off", "mpi", "nccl"):
        raise DistError(f"--dist must be auto, off, mpi or nccl, got {mode!r}")
    if mode == "off" or (mode == "auto" and not launched_by_mpi(environ)):
        return None
    try:
        from .comm import MPIComm

        return MPIComm(timeout_s=timeout_s)
    except ImportError as e:
        raise DistError(f"--dist {mode}: mpi4py cannot be imported ({e}): pip install 'minidl[mpi]' (or mpi4py "
                        f"built against your cluster's MPI)") from e


def with_nccl(comm: Communicator | None, backend, mode: str = "auto") -> Communicator | None:
    """NCCL over `comm` when the ranks run on GPUs ('auto' with a CUDA backend, or 'nccl'); else `comm`."""
    on_gpu = backend is not None and backend.capabilities.device == "gpu"
    if comm is None or not (mode == "nccl" or (mode == "auto" and on_gpu)):
        return comm
    if not on_gpu:
        raise DistError("--dist nccl needs --backend cuda (NCCL reduces buffers in GPU memory)")
    from .nccl import NCCLComm

    return NCCLComm(comm, backend)


def guarded(comm: Communicator | None, fn: Callable[[], T]) -> T:
    """Run one rank's work so that a failure stops every rank with a message instead of a hang: this rank's own
    error fails the job with one process's exit status (`errors.exit_status`); a peer's is named, then this stops."""
    if comm is None or comm.size == 1:
        return fn()
    try:
        out = fn()
        comm.check_peers()
        comm.close()
        return out
    except PeerFailed as e:
        print(f"minidl: {e}", file=sys.stderr, flush=True)
        comm.stop(1)
        raise
    except BaseException as e:
        comm.fail(f"{type(e).__name__}: {e}", exit_status(e))
        raise
