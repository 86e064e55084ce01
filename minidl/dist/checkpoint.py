"""Checkpoints in data-parallel training: rank 0 writes, every rank reads.

Replicas are bit-identical, so rank 0's copy is the whole state (BN running statistics: rank 0's); a barrier
holds the others until it is complete. The data position counts global batches, so a resume keeps ranks x batch.
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
        except Exception as e:  # the others must not wait at the barrier forever
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
    """Refuse to resume a data-parallel checkpoint with another global batch (it would replay other samples)."""
    saved, saved_ranks = meta.get("global_batch"), int(meta.get("ranks", 1))
    if saved is None or (ranks == 1 and saved_ranks == 1) or int(saved) == batch * ranks:
        return
    hint = f": use --batch {int(saved) // ranks}" if int(saved) % ranks == 0 else ""
    raise DistError(f"checkpoint {path} was written with a global batch of {saved} ({saved_ranks} rank(s)); "
                    f"resuming with {ranks} rank(s) x batch {batch} = {batch * ranks} would replay other samples"
                    + hint)
