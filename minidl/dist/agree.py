"""Before the first step, the ranks check that they were started to run the same training.

Each rank plans from its own command line, so each describes its run as a flat record (`Session._run_record`),
the ranks exchange them, and all compare them alike: they stop together with the same `DistError` naming every
differing entry and each rank's value.
"""
from __future__ import annotations

import json

from ..core.errors import DistError
from .comm import Communicator

SHOWN = 6
"""Differing entries named in the message (another network differs in most of its parameters)."""


def differences(records: list[dict]) -> list[str]:
    """Each entry whose value is not the same on every rank, in words: 'seed: 0 on rank 0, 1 on rank 1'."""
    out = []
    for key in sorted(set().union(*records)):
        values = [r.get(key) for r in records]
        if any(v != values[0] for v in values[1:]):
            out.append(f"{key}: " + ", ".join(f"{'absent' if v is None else _show(v)} on rank {i}"
                                              for i, v in enumerate(values)))
    return out


def _show(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def check_same(comm: Communicator, record: dict) -> None:
    """Raise the same `DistError` on every rank unless every rank's `record` is this one."""
    if comm.size == 1:
        return
    mine = json.dumps(record, sort_keys=True).encode()
    records = [json.loads(b.decode()) for b in comm.exchange(mine, "the ranks' agreement on the run's options")]
    diff = differences(records)
    if diff:
        more = f"; and {len(diff) - SHOWN} more" if len(diff) > SHOWN else ""
        raise DistError(f"the {comm.size} ranks were not started with the same training options: "
                        f"{'; '.join(diff[:SHOWN])}{more}. Every rank must run the same network, optimizer, seed, "
                        f"batch, policy and data (give every rank the same command line)")
