"""Where numba caches minidl's compiled kernels: `NUMBA_CACHE_DIR` when set, else the user cache folder's `numba`.

Never beside the package: files pip did not install survive an uninstall and the leftover `minidl` folder then
imports as a namespace package ahead of a new install. numba picks a kernel's cache folder when it decorates, so
`njit` sets `numba.config.CACHE_DIR` for that moment only (other numba code keeps its own; every kernel uses this
`njit`: tests/backend/test_cpu_jit_cache.py). An unwritable folder means no disk cache (~30 s of compiling per
process for ResNet-20) and a warning naming it. `compiling(notify)` tells a first run that kernels are compiling.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable

import numba
from numba.core import config
from numba.core import event as numba_event

from . import startup
from .user_cache import cache_folder, writable

_decorating = threading.Lock()  # config.CACHE_DIR is process-wide: one decoration at a time
_kernels: set = set()  # the dispatchers `njit` made: the kernels `compiling` watches


def cache_dir() -> str:
    """The folder the kernels' machine code is cached in."""
    if config.CACHE_DIR:
        return config.CACHE_DIR
    return cache_folder("numba")


def njit(**options):
    """`numba.njit(**options)` caching in `cache_dir()`."""
    def decorate(fn):
        kernel = _decorate(fn, options)
        _kernels.add(kernel)
        return kernel
    return decorate


def _decorate(fn, options: dict):
    with _decorating:
        config.reload_config()  # a NUMBA_CACHE_DIR set after numba's import counts, as numba reads it
        if not options.get("cache") or config.CACHE_DIR:
            return numba.njit(**options)(fn)
        folder = cache_dir()
        if not writable(folder, "the CPU kernels are compiled again in every process"):
            return numba.njit(**{**options, "cache": False})(fn)
        config.CACHE_DIR = folder
        try:
            return numba.njit(**options)(fn)
        finally:
            config.CACHE_DIR = ""


class _FirstCompile(numba_event.Listener):
    """Calls back at the start of the first compile of a minidl kernel, in any thread."""

    def __init__(self, callback: Callable[[], None]):
        self.callback, self.fired = callback, False
        self._lock = threading.Lock()

    def on_start(self, event) -> None:
        if event.data.get("dispatcher") not in _kernels:
            return
        with self._lock:
            fired, self.fired = self.fired, True
        if not fired:
            self.callback()

    def on_end(self, event) -> None:
        pass


@contextmanager
def compiling(notify: Callable[[], None]):
    """While active, `notify()` once, when numba starts compiling a minidl kernel (not loading a cached one)."""
    listener = _FirstCompile(notify)
    with numba_event.install_listener("numba:compile", listener):
        yield listener


class _CompileTimer(numba_event.Listener):
    """Times numba's compiler lock (compile or cache load) as the `kernels` startup phase; outermost hold only."""

    def __init__(self):
        self._local = threading.local()

    def on_start(self, event) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._local.timed = startup.CLOCK.enter("kernels")
        self._local.depth = depth + 1

    def on_end(self, event) -> None:
        self._local.depth = getattr(self._local, "depth", 1) - 1
        if self._local.depth == 0 and getattr(self._local, "timed", False):
            startup.CLOCK.leave("kernels")


numba_event.register("numba:compiler_lock", _CompileTimer())
