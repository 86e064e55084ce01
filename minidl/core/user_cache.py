"""minidl's user cache folder: what a run builds once and later runs load (numba's machine code, cupy's compiled
kernels, cuDNN's execution plans, measured algorithm times), one sub-folder per kind.

* `$MINIDL_CACHE_DIR` when set;
* else the platform's user cache folder: `$XDG_CACHE_HOME/minidl` (`~/.cache/minidl` by default) on Linux,
  `~/Library/Caches/minidl` on macOS, `%LOCALAPPDATA%\\minidl\\Cache` on Windows.

Deleting the folder is always safe: every entry is rebuilt on its next use.
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile
import warnings


def _platform_root() -> str:
    """minidl's folder in the platform's user cache folder (the XDG base directory spec on Linux)."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.expanduser(os.path.join("~", "AppData", "Local"))
        return os.path.join(base, "minidl", "Cache")
    if sys.platform == "darwin":
        return os.path.expanduser(os.path.join("~", "Library", "Caches", "minidl"))
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the spec: a relative value is ignored
        base = os.path.expanduser(os.path.join("~", ".cache"))
    return os.path.join(base, "minidl")


def cache_root() -> str:
    """The user cache folder (the order of precedence above), as an absolute path; not created here."""
    root = os.environ.get("MINIDL_CACHE_DIR") or _platform_root()
    return os.path.abspath(os.path.expanduser(root))


def cache_folder(kind: str) -> str:
    """The sub-folder of `cache_root()` that holds one kind of entry ('numba', 'cupy', 'cudnn', 'autotune')."""
    return os.path.join(cache_root(), kind)


@functools.lru_cache(maxsize=None)
def writable(folder: str, otherwise: str) -> bool:
    """Whether `folder` exists or can be made, and takes a file (checked once per folder and process); where not,
    a warning names the folder and says what happens `otherwise`."""
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        warnings.warn(f"minidl: the cache folder {folder} cannot be written ({e.strerror}); {otherwise}. Set "
                      "MINIDL_CACHE_DIR to a writable folder.", RuntimeWarning, stacklevel=3)
        return False
    return True
