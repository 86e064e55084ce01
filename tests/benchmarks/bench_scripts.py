"""Loading a script of benchmarks/ as a module, for the tests of its pieces (benchmarks/ is not a package, and
putting it on sys.path would let its modules' names, such as `compression`, shadow others)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def script(name: str) -> Path:
    return BENCHMARKS / f"{name}.py"


def load(name: str) -> ModuleType:
    """benchmarks/NAME.py, executed as module NAME (registered in sys.modules while it runs: dataclasses
    resolve their module's annotations through it)."""
    spec = importlib.util.spec_from_file_location(name, script(name))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
