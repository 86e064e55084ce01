"""Where numba caches minidl's compiled kernels: `NUMBA_CACHE_DIR` when set, else the user cache folder's `numba`.

Never beside the package: files pip did not install survive an uninstall and the leftover `minidl` folder then
imports as a namespace package ahead of a new install. numba picks a kernel's cache folder when it decorates, so
`njit` sets `numba.config.CACHE_DIR` for that moment only (other numba code keeps its own; every kernel uses this
`njit`: tests/backend/test_cpu_jit_cache.py). An unwritable folder means no disk cache (~30 s of compiling per
process for ResNet-20) and a warning naming it. `compiling(notify)` tells a first run that kernels are compiling.
numba checks a cached kernel against its own file's time stamp only, so a kernel module's folder is named by a
digest of its source and of the minidl modules it imports, through other kernel modules (`source_digest`): a
kernel compiled against an older `half_jit` or `lanes` is never loaded.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import os
import sys
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
    """The folder the kernels' machine code is cached in, one `src-<digest>` sub-folder per kernel module."""
    if config.CACHE_DIR:
        return config.CACHE_DIR
    return cache_folder("numba")


#: Hex digits of a source digest in a cache folder's name (64 bits: collisions are not a concern).
DIGEST_CHARS = 16


def _package_root() -> str:
    return os.path.dirname(os.path.abspath(sys.modules["minidl"].__file__))


def _package_imports(path: str, package: str) -> dict[str, str]:
    """The minidl modules (file -> module name) that the file `path` of package `package` imports."""
    root, here, out = _package_root(), package.split("."), {}
    with open(path, "rb") as fh:
        tree = ast.parse(fh.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            parts = base + (node.module.split(".") if node.module else [])
            names = [parts + [a.name] for a in node.names] + [parts]  # `from p import m` may name a module m
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        found = {}
        for name in names:
            if name and name[0] == "minidl":
                stem = os.path.join(root, *name[1:])
                for f in (stem + ".py", os.path.join(stem, "__init__.py")):
                    if os.path.isfile(f):
                        found[f] = ".".join(name)
        if isinstance(node, ast.ImportFrom) and len(found) > 1:  # `from . import m`: the module, not the package
            found = {f: n for f, n in found.items() if n != ".".join(parts)}
        out.update(found)
    return out


def module_sources(module: str) -> dict[str, str]:
    """The files (-> module names) of kernel module `module` and of the minidl modules it imports, followed
    through the kernel modules (`*_jit`) only: what a kernel compiles in is kernels and constants it imports."""
    start = os.path.abspath(sys.modules[module].__file__)
    seen: dict[str, str] = {}
    todo = {start: module}
    while todo:
        f, name = todo.popitem()
        if f in seen:
            continue
        seen[f] = name
        if f == start or name.endswith("_jit"):
            package = name if f.endswith("__init__.py") else name.rpartition(".")[0]
            todo.update(_package_imports(f, package))
    return seen


def digest(sources: dict[str, str]) -> str:
    """A digest of the files `sources` (path -> module name), named and in name order."""
    h = hashlib.sha256()
    for f, name in sorted(sources.items(), key=lambda kv: kv[1]):
        with open(f, "rb") as fh:
            h.update(name.encode() + b"\0" + fh.read() + b"\0")
    return h.hexdigest()[:DIGEST_CHARS]


@functools.lru_cache(maxsize=None)
def source_digest(module: str) -> str:
    """The digest of `module_sources(module)`: a kernel's cache folder changes with any of them."""
    return digest(module_sources(module))


def njit(**options):
    """`numba.njit(**options)` caching in `cache_dir()`'s folder for the kernel's module."""
    def decorate(fn):
        kernel = _decorate(fn, options)
        _kernels.add(kernel)
        return kernel
    return decorate


def _decorate(fn, options: dict):
    with _decorating:
        config.reload_config()  # a NUMBA_CACHE_DIR set after numba's import counts, as numba reads it
        if not options.get("cache"):
            return numba.njit(**options)(fn)
        own = config.CACHE_DIR
        folder = os.path.join(cache_dir(), "src-" + source_digest(fn.__module__))
        if not writable(folder, "the CPU kernels are compiled again in every process"):
            return numba.njit(**{**options, "cache": False})(fn)
        config.CACHE_DIR = folder
        try:
            return numba.njit(**options)(fn)
        finally:
            config.CACHE_DIR = own


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
