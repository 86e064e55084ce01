"""Where the compiled kernels are cached (`minidl/core/jit_cache.py`): the user cache folder, never the
package's folder (a leftover `__pycache__` there turns an uninstalled minidl into a namespace package that hides
the next install). Each case runs in a fresh interpreter, since numba picks the folder when a kernel module is
imported, with the environment variables of that case."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import minidl

PACKAGE = Path(minidl.__file__).resolve().parent

# Every module of the package that caches compiled code, found by what it says, so a new one cannot be missed.
KERNEL_MODULES = sorted(
    "minidl." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
    for p in PACKAGE.rglob("*.py") if "cache=True" in p.read_text() and p.name != "jit_cache.py")

PROBE = """
import importlib, json, sys
if sys.argv[1] == "numba-first":
    import numba  # noqa: F401 - numba imported (and configured) before minidl
from numba.core.dispatcher import Dispatcher
from numba.core import config
folders = {}
for name in sys.argv[2:]:
    module = importlib.import_module(name)
    for attr, value in vars(module).items():
        if isinstance(value, Dispatcher) and value.__module__ == name:
            folders[f"{name}.{attr}"] = value.stats.cache_path
from minidl.backend.cpu import update_jit as cpu_update_jit
cpu_update_jit._part(10, 0, 2)  # one small kernel compiled (or loaded) and so written to its cache
print(json.dumps({"folders": folders, "config_after": config.CACHE_DIR}))
"""


def _probe(env_changes: dict, numba_first: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "MINIDL_CACHE_DIR")}
    env.update(env_changes)
    r = subprocess.run([sys.executable, "-c", PROBE, "numba-first" if numba_first else "minidl-first",
                        *KERNEL_MODULES], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["stderr"] = r.stderr
    return out


def _cache_files_since(folder: Path, start: float) -> list[Path]:
    return [p for p in folder.rglob("*.nb[ic]") if p.stat().st_mtime >= start]


def test_kernel_modules_found():
    assert "minidl.backend.cpu.norm_jit" in KERNEL_MODULES and "minidl.backend.cpu.gemm_jit" in KERNEL_MODULES


@pytest.mark.parametrize("numba_first", [False, True], ids=["minidl-first", "numba-first"])
def test_every_kernel_is_cached_in_minidl_cache_dir(tmp_path, numba_first):
    start = time.time() - 1
    out = _probe({"MINIDL_CACHE_DIR": str(tmp_path)}, numba_first)
    folder = tmp_path / "numba"
    assert len(out["folders"]) > 50, out["folders"]
    outside = {k: v for k, v in out["folders"].items() if not v.startswith(str(folder) + os.sep)}
    assert not outside, f"kernels cached outside {folder}: {outside}"
    assert any(folder.rglob("update_jit._part-*.nbi")), "the compiled kernel was not cached there"
    assert not _cache_files_since(PACKAGE, start), "numba wrote cache files inside the package"
    assert out["config_after"] == "", "numba's cache setting was left changed for the rest of the process"


def test_numba_cache_dir_wins(tmp_path):
    out = _probe({"NUMBA_CACHE_DIR": str(tmp_path / "numba-own"), "MINIDL_CACHE_DIR": str(tmp_path / "minidl")})
    assert all(v.startswith(str(tmp_path / "numba-own") + os.sep) for v in out["folders"].values()), out["folders"]
    assert out["config_after"] == str(tmp_path / "numba-own")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="XDG_CACHE_HOME is the Linux convention")
def test_default_is_the_user_cache_folder(tmp_path):
    out = _probe({"XDG_CACHE_HOME": str(tmp_path)})
    folder = str(tmp_path / "minidl" / "numba")
    assert all(v.startswith(folder + os.sep) for v in out["folders"].values()), out["folders"]


def test_unwritable_folder_compiles_without_disk_cache(tmp_path):
    start = time.time() - 1
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = _probe({"MINIDL_CACHE_DIR": str(blocker)})
    assert "cannot be written" in out["stderr"] and "MINIDL_CACHE_DIR" in out["stderr"]
    assert set(out["folders"].values()) == {None}, out["folders"]  # numba's "no disk cache"
    assert not _cache_files_since(PACKAGE, start), "numba wrote cache files inside the package"


def test_a_kernel_is_cached_under_the_digest_of_what_it_imports(tmp_path):
    """numba checks a cached kernel against its own file only: norm_jit's kernels inline half_jit's conversions,
    so their folder must change when half_jit does."""
    from minidl.backend.cpu import norm_jit  # noqa: F401 - imported so its sources resolve
    from minidl.core import jit_cache

    sources = jit_cache.module_sources("minidl.backend.cpu.norm_jit")
    assert {"minidl.backend.cpu.norm_jit", "minidl.backend.cpu.half_jit"} <= set(sources.values())
    out = _probe({"MINIDL_CACHE_DIR": str(tmp_path)})
    norm = {k: v for k, v in out["folders"].items() if k.startswith("minidl.backend.cpu.norm_jit.")}
    assert norm and all(f"src-{jit_cache.source_digest('minidl.backend.cpu.norm_jit')}" in Path(v).parts
                        for v in norm.values()), norm


def test_the_digest_changes_with_any_imported_source(tmp_path):
    from minidl.core import jit_cache

    kernel, helper = tmp_path / "k_jit.py", tmp_path / "h_jit.py"
    kernel.write_text("from .h_jit import f\n")
    helper.write_text("def f(x):\n    return x\n")
    files = {str(kernel): "p.k_jit", str(helper): "p.h_jit"}
    before = jit_cache.digest(files)
    helper.write_text("def f(x):\n    return x + 1\n")
    assert jit_cache.digest(files) != before and len(before) == jit_cache.DIGEST_CHARS
