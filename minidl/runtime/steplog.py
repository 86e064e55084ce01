"""The per-step log of a training run (`minidl train --log PATH`): one CSV row per step, written as it ends.

Why a file of its own and not the JSON: the JSON is the run's summary (a median step time, a final loss), printed
once at the end; a loss curve, a slow step, or the copies of one step need every step, and a run stopped by
Ctrl-C or a divergence keeps the rows of the steps it completed (each row is flushed when written). Columns:

- `iteration`: steps completed after this one (the checkpoint's iteration: a resumed run continues the count);
- `loss`, `lr` (the learning rate this step used), `step_time_s`, `images_per_s` (of this process's batch;
  `tokens_per_s` for a language model);
- `offloaded_bytes`, `prefetched_bytes`, `copy_time_s`, `copy_wait_s`: this step's host copies as the transfer
  engine measured them (0 without any), the wait being the time the step stood still for them.
"""
from __future__ import annotations

import csv
from pathlib import Path

COLUMNS = ("iteration", "loss", "lr", "step_time_s", "{unit}_per_s", "offloaded_bytes", "prefetched_bytes",
           "copy_time_s", "copy_wait_s")


def columns(session) -> tuple[str, ...]:
    """`COLUMNS` with the rate named after what `session` trains on (`Session.throughput_unit`)."""
    return tuple(c.format(unit=session.throughput_unit[0]) for c in COLUMNS)


class StepLog:
    """`on_step` for `Session.fit` that appends a row per step to a CSV file (created, or replaced, on open)."""

    def __init__(self, path: str | Path, session):
        self.path, self.session = Path(path), session
        self._file = open(self.path, "w", newline="")   # noqa: SIM115 - closed by close(), after the last step
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
