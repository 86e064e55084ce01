"""Where numba keeps the compiled CPU kernels (`cpu_*_jit`): a user cache folder, never the package's folder.

Why. With `cache=True` numba writes each kernel's index and machine code (.nbi, .nbc files) into the
`__pycache__` folder beside the module that defines it, when that folder is writable. For an installed minidl
that is site-packages/minidl/backend/__pycache__, ~100 files pip never installed and so never removes: after
`pip install .` and one training run, `pip install -e .` (the README's two commands, in that order) uninstalls
the package but leaves that folder, and the leftover `minidl` folder, without its `__init__.py`, imports as a
namespace package ahead of the editable install: every `minidl` command (even `--version`) then fails with
"cannot import name '__version__' from 'minidl' (unknown location)". In a checkout the same files litter the
source tree. So every minidl kernel is cached in `cache_dir()`:

* `NUMBA_CACHE_DIR` (`numba.config.CACHE_DIR`) when set: numba's own documented setting wins;
* else the `numba` folder of minidl's user cache folder (`core.user_cache`: `$MINIDL_CACHE_DIR/numba` when that
  variable is set, else `~/.cache/minidl/numba` or the platform's equivalent).

numba keeps one sub-folder per source folder (named after it, with a hash of its full path), so two installs
or checkouts never share entries, and an entry is used only while its source file's contents are unchanged.

How. numba chooses a function's cache folder once, when the decorator runs (`Dispatcher.enable_caching`), and
takes it from `numba.config.CACHE_DIR` (what NUMBA_CACHE_DIR sets) before its beside-the-source default.
`njit` below is numba's `njit` that sets that value while it decorates one minidl kernel and puts it back
right after. So it holds whether numba was imported before minidl or by it (a setting made before numba's
import would miss the first case), and the cache of any other numba code in the process (the user's, another
library's) stays where numba puts it. Every `cpu_*_jit` module and the codec's kernels (`codec.sz_jit`) decorate
with this `njit` (tests/backend/test_cpu_jit_cache.py checks every kernel's folder). Where the folder cannot be
created or written, the kernels are compiled without a disk cache (every process compiles them again: ~30 s for
ResNet-20's) rather than into the package, and a warning names the folder.

`compiling(notify)`: while active, `notify()` runs once when numba starts compiling one of these kernels (numba's
"numba:compile" event fires only on a compile; a kernel loaded from the cache raises none), so a first run can
say what its long first step is doing (`runtime.progress`).
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
    """The folder the kernels' machine code is cached in (the order of precedence above)."""
    if config.CACHE_DIR:
        return config.CACHE_DIR
    return cache_folder("numba")


def njit(**options):
    """`numba.njit(**options)` for a minidl kernel: with `cache=True`, its machine code is kept in
    `cache_dir()`, never beside this package's files."""
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
    """Calls `notify()` at the start of the first compile of a minidl kernel (in whichever thread compiles)."""

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
    """While active, `notify()` once, when numba starts compiling a minidl kernel (never for a cached one)."""
    listener = _FirstCompile(notify)
    with numba_event.install_listener("numba:compile", listener):
        yield listener


class _CompileTimer(numba_event.Listener):
    """Times numba's compiler lock (held while a kernel is compiled or loaded from its cache) as the `kernels`
    startup phase. The lock is re-entrant: only the outermost hold on each thread counts."""

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
