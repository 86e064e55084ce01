"""`minidl train --log PATH`: one CSV row per step, flushed as it ends, so a stopped run keeps its rows.
`iteration` is the checkpoint's (a resume continues it); the copy columns are the transfer engine's for this step.
"""
from __future__ import annotations

import csv
from pathlib import Path

COLUMNS = ("iteration", "loss", "lr", "step_time_s", "{unit}_per_s", "offloaded_bytes", "prefetched_bytes",
           "copy_time_s", "copy_wait_s")


def columns(session) -> tuple[str, ...]:
    """`COLUMNS` with the rate named after `Session.throughput_unit`."""
    return tuple(c.format(unit=session.throughput_unit[0]) for c in COLUMNS)


class StepLog:
    """`on_step` for `Session.fit` writing a row per step to a new CSV file."""

    def __init__(self, path: str | Path, session):
        self.path, self.session = Path(path), session
        self._file = open(self.path, "w", newline="")   # noqa: SIM115 - closed by close()
        self._csv = csv.writer(self._file)
        self._csv.writerow(columns(session))
        self._per_step = session.batch * session.throughput_unit[1]
        self._file.flush()
        self._last = self._copies()

    def _copies(self) -> tuple[int, int, float, float]:
        host = self.session.executor.host
        if host is None:
            return 0, 0, 0.0, 0.0
        s = host.stats()
        return s.offloaded_bytes, s.prefetched_bytes, s.transfer_time_s, s.stall_time_s

    def __call__(self, k: int, loss: float, seconds: float) -> None:
        now = self._copies()
        off, pre, t, wait = (a - b for a, b in zip(now, self._last))
        self._last = now
        s = self.session
        lr = getattr(s.optimizer, "lr", "")
        self._csv.writerow([s.iteration, repr(float(loss)), lr, f"{seconds:.6f}",
                            f"{self._per_step / seconds:.2f}" if seconds > 0 else "", off, pre, f"{t:.6f}",
                            f"{wait:.6f}"])
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
