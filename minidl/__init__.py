"""minidl: a small deep-learning framework whose executor virtualizes device memory.

Names are imported when first used, so `minidl --help` loads only what it runs.
"""
from __future__ import annotations

from importlib import import_module

__version__ = "0.1.0"

# name -> the module that defines it ("" for a subpackage of this name)
_EXPORTS = {
    "layers": "",
    "BudgetError": "core.errors", "CheckpointError": "core.errors", "DataError": "core.errors",
    "DivergenceError": "core.errors", "GraphError": "core.errors", "HostMemoryError": "core.errors",
    "MinidlError": "core.errors", "OptionError": "core.errors", "ResidencyError": "core.errors",
    "Role": "core.tensors", "TensorSpec": "core.tensors",
    "Network": "graph.network", "Symbol": "graph.network",
    "Phase": "graph.route", "Route": "graph.route", "Step": "graph.route",
    "format_bytes": "memory.pool", "parse_size": "memory.pool",
    "SGD": "optim", "Adam": "optim", "Optimizer": "optim",
    "RunConfig": "runtime.session", "Session": "runtime.session", "TrainResult": "runtime.session",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'minidl' has no attribute {name!r}")
    value = import_module(f"{__name__}.{where or name}")
    if where:
        value = getattr(value, name)
    globals()[name] = value   # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
