"""Where a command's time goes before its first training step: one process-wide clock of named phases.

Rules: nothing is recorded before `begin()` (a library user pays one check per phase); time is exclusive (an
inner phase is taken out of the outer one; the rest is `other`); only the thread that began is timed;
`first_step_done()` closes the startup, later phases go to `later`.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator

#: in the order a run meets them (and a report lists them)
PHASES = ("imports", "backend", "inputs", "planning", "arena", "cudnn_graphs", "kernels", "first_step", "capture")
OTHER = "other"


@dataclass(slots=True)
class StartupReport:
    """Seconds per phase to the end of the first step (`parts` sum to `startup_s`) and after it (`later`)."""

    startup_s: float | None
    parts: dict[str, float] = field(default_factory=dict)
    later: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        """One line for a summary: the total and its parts, largest first."""
        if self.startup_s is None:
            return "startup: not measured"
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in
                          sorted(self.parts.items(), key=lambda kv: -kv[1]) if round(v, 1) > 0)
        text = f"startup {self.startup_s:.1f} s to the end of the first step ({parts} s)"
        if self.later:
            text += "; then " + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in self.later.items())
        return text


class StartupClock:
    """The phases of one command; `clock` is injected for tests."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._thread: int | None = None
        self._origin = 0.0
        self._stack: list[list] = []            # [name, entered at, seconds of the phases inside it]
        self._parts: dict[str, float] = {}
        self._startup: StartupReport | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def current(self) -> str | None:
        """The innermost phase running now, for a progress message to name."""
        return self._stack[-1][0] if self._stack else None

    def begin(self, origin: float | None = None) -> None:
        """Start recording on this thread; `origin` (the process's start, None: now) to now is `imports`."""
        now = self._clock()
        self._thread = threading.get_ident()
        self._origin = now if origin is None else min(float(origin), now)
        self._stack, self._parts, self._startup = [], {"imports": now - self._origin}, None

    def stop(self) -> None:
        """Stop recording; what was measured stays readable."""
        self._thread = None
        self._stack = []

    def _mine(self) -> bool:
        return self._thread is not None and threading.get_ident() == self._thread

    def enter(self, name: str) -> bool:
        """Start phase `name`; True if recorded."""
        if not self._mine():
            return False
        self._stack.append([name, self._clock(), 0.0])
        return True

    def leave(self, name: str | None = None) -> None:
        """End the innermost phase (only if it is `name`, when given)."""
        if not self._mine() or not self._stack or (name is not None and self._stack[-1][0] != name):
            return
        name, entered, inner = self._stack.pop()
        spent = self._clock() - entered
        self._parts[name] = self._parts.get(name, 0.0) + spent - inner
        if self._stack:
            self._stack[-1][2] += spent

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.leave(name)

    def phase(self, name: str):
        """A context timing `name` on the clock's thread."""
        return self._timed(name) if self._mine() else nullcontext()

    def first_step_done(self) -> None:
        """Close the startup at the end of the first training step (the first call only)."""
        if not self._mine() or self._startup is not None:
            return
        total = self._clock() - self._origin
        parts = {k: self._parts[k] for k in PHASES if k in self._parts}
        parts.update({k: v for k, v in self._parts.items() if k not in parts})
        parts[OTHER] = max(0.0, total - sum(parts.values()))
        self._startup = StartupReport(total, parts)

    def report(self) -> StartupReport:
        """The startup (startup_s None before `first_step_done`) and the phases timed since."""
        if self._startup is None:
            return StartupReport(None, {k: v for k, v in self._parts.items()})
        done = self._startup.parts
        later = {k: v - done.get(k, 0.0) for k, v in self._parts.items() if v - done.get(k, 0.0) > 0}
        return StartupReport(self._startup.startup_s, dict(done), later)


def process_age() -> float | None:
    """Seconds since this process started, to 1/CLK_TCK (Linux; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, ticks after boot
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


CLOCK = StartupClock()


def phase(name: str):
    """`CLOCK.phase(name)`."""
    return CLOCK.phase(name)


def begin() -> None:
    """Start the process clock from the process's start where known."""
    age = process_age()
    CLOCK.begin(None if age is None else time.perf_counter() - age)
