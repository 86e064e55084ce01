"""minidl's user cache folder (`$MINIDL_CACHE_DIR`, else the platform's), one sub-folder per kind of entry built
once and loaded later. Deleting it is always safe: every entry is rebuilt on its next use."""
from __future__ import annotations

import functools
import os
import sys
import tempfile
import warnings


def _platform_root() -> str:
    """minidl's folder in the platform's user cache folder (XDG on Linux)."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.expanduser(os.path.join("~", "AppData", "Local"))
        return os.path.join(base, "minidl", "Cache")
    if sys.platform == "darwin":
        return os.path.expanduser(os.path.join("~", "Library", "Caches", "minidl"))
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # XDG: a relative value is ignored
        base = os.path.expanduser(os.path.join("~", ".cache"))
    return os.path.join(base, "minidl")


def cache_root() -> str:
    """The user cache folder as an absolute path; not created here."""
    root = os.environ.get("MINIDL_CACHE_DIR") or _platform_root()
    return os.path.abspath(os.path.expanduser(root))


def cache_folder(kind: str) -> str:
    """The sub-folder of one kind ('numba', 'cupy', 'cudnn', 'autotune')."""
    return os.path.join(cache_root(), kind)


@functools.lru_cache(maxsize=None)
def writable(folder: str, otherwise: str) -> bool:
    """Whether `folder` can be made and written (once per process); if not, a warning says what happens `otherwise`."""
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        warnings.warn(f"minidl: the cache folder {folder} cannot be written ({e.strerror}); {otherwise}. Set "
                      "MINIDL_CACHE_DIR to a writable folder.", RuntimeWarning, stacklevel=3)
        return False
    return True
