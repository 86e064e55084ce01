"""What `pip install .` (not editable) installs: every package of the source tree is listed in pyproject.toml's
[tool.setuptools] packages, which names them one by one; a package missing there is absent from an installed
minidl (its command fails with ImportError) while every editable checkout, and so every other test, still has it."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_installed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: ROOT / path for name, path in cfg["package-dir"].items()}
    on_disk = set()
    for name, root in dirs.items():
        for init in root.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(root).parts
            sub = ".".join((name, *rel))
            # a folder under minidl/ that package-dir maps elsewhere is not this package
            if not any(sub != n and sub.startswith(n + ".") and dirs[n] != root for n in dirs):
                on_disk.add(sub)
    assert on_disk <= set(cfg["packages"]), f"packages not installed: {sorted(on_disk - set(cfg['packages']))}"
