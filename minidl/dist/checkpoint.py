"""Checkpoints in data-parallel training: rank 0 writes, every rank reads.

Every replica holds the same parameters and optimizer state (the reducer keeps them bit-identical), so one copy
is the whole state: rank 0 writes it (atomically, through `checkpoint.save_checkpoint`), and a barrier keeps the
other ranks from going on, and possibly reading it, before it is complete. BN running statistics are rank 0's
(docs/multi-process.md: batch statistics are per rank, as in PyTorch DDP). On resume every rank loads the same file; the
data position is counted in global batches, so a resume must keep the global batch (ranks x batch) the
checkpoint was written with, or the replayed data order would differ.
"""
from __future__ import annotations

from pathlib import Path

from ..core.errors import DistError


def save_on_rank0(comm, write, path) -> Path:
    """Run `write()` on rank 0 only; every rank returns after it finished (a barrier), with its path."""
    out = None
    failure = None
    if comm.rank == 0:
        try:
            out = write()
        except Exception as e:  # the others must not wait at the barrier forever: fail the job, naming why
            failure = e
            comm.fail(f"writing checkpoint {path} failed: {type(e).__name__}: {e}")
    if failure is not None:
        raise failure
    comm.barrier()
    if out is None:
        p = Path(path)
        out = p if p.suffix == ".npz" else p.with_name(p.name + ".npz")
    return out


def check_resume(meta: dict, batch: int, ranks: int, path) -> None:
    """A data-parallel checkpoint records its global batch; resuming with another one would replay other samples.
    (A single process resuming a single-process checkpoint keeps its old freedom to change the batch.)"""
    saved, saved_ranks = meta.get("global_batch"), int(meta.get("ranks", 1))
    if saved is None or (ranks == 1 and saved_ranks == 1) or int(saved) == batch * ranks:
        return
    hint = f": use --batch {int(saved) // ranks}" if int(saved) % ranks == 0 else ""
    raise DistError(f"checkpoint {path} was written with a global batch of {saved} ({saved_ranks} rank(s)); "
                    f"resuming with {ranks} rank(s) x batch {batch} = {batch * ranks} would replay other samples"
                    + hint)
