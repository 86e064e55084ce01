"""What `Session.fit` says while it trains: a bar on a terminal, else stderr lines for the one long wait (numba
compiling the CPU kernels). Rules: the compile notice only while numba really compiles; no rate or time left
before a warm step (the first step's time would promise hours).
"""
from __future__ import annotations

import sys
import threading
import time

from ..core.jit_cache import compiling

COMPILING = "compiling the CPU kernels once (cached for the next runs)"
FIRST_STEP_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"  # tqdm's default, no rate, no ETA
REFRESH_S = 1.0  # seconds between redraws of the first step's elapsed time


class StepProgress:
    """`mode` "bar" (tqdm), "lines" (the compile notice) or None; `unit` and `per_step` make the rate."""

    def __init__(self, steps: int, mode: str | None, unit: str, per_step: int, stream=None):
        self.steps, self.mode, self.unit, self.per_step = steps, mode, unit, per_step
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.compiled_at: float | None = None   # perf_counter when a first compile began
        self._bar = None
        self._stop = threading.Event()
        self._watch = None

    def __enter__(self) -> StepProgress:
        if self.mode is None:
            return self
        self._watch = compiling(self._compiling)
        self._watch.__enter__()
        if self.mode == "bar":
            self._bar = self._new_bar(0, FIRST_STEP_FORMAT, leave=False)
            threading.Thread(target=self._tick, daemon=True).start()
        return self

    def _new_bar(self, initial: int, bar_format: str | None, leave: bool = True):
        from tqdm import tqdm

        return tqdm(total=self.steps, initial=initial, unit="step", dynamic_ncols=True, leave=leave,
                    bar_format=bar_format, file=self.stream)

    def _tick(self) -> None:
        """Redraw the first step's elapsed time until it ends."""
        while not self._stop.wait(REFRESH_S):
            bar = self._bar
            if bar is not None and self.done == 0:
                bar.refresh()

    def _compiling(self) -> None:
        self.compiled_at = time.perf_counter()
        if self._bar is not None:
            self._bar.set_postfix_str(COMPILING)
        elif self.mode == "lines":
            print(f"minidl: {COMPILING} ...", file=self.stream, flush=True)

    def step(self, loss: float, seconds: float) -> None:
        self.done += 1
        if self.done == 1:
            self._stop.set()
            if self.compiled_at is not None and self.mode == "lines":
                print(f"minidl: compiled in {time.perf_counter() - self.compiled_at:.0f} s; training "
                      f"{self.steps} steps", file=self.stream, flush=True)
            if self._bar is not None:   # rate and time left of warm steps only
                self._bar.close()
                self._bar = self._new_bar(1, None)
                self._bar.set_postfix(loss=f"{loss:.4f}", refresh=True)
                return
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", rate=f"{self.per_step / seconds:.1f} {self.unit}/s",
                                  refresh=False)
            self._bar.update(1)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.__exit__(*exc)
        if self._bar is not None:
            self._bar.close()
