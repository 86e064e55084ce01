"""minidl: a small deep-learning framework whose executor virtualizes device memory.

    import minidl as dl
    net = dl.Network()
    x = net.input((8, 3, 32, 32)); y = net.input((8,), dtype="int64", name="label")
    ...
"""
from . import layers
from .core.errors import (
           BudgetError,
           CheckpointError,
           DataError,
           DivergenceError,
           GraphError,
           HostMemoryError,
           MinidlError,
           OptionError,
           ResidencyError,
)
from .core.tensors import Role, TensorSpec
from .graph.network import Network, Symbol
from .graph.route import Phase, Route, Step
from .memory.pool import format_bytes, parse_size
from .optim import SGD, Adam, Optimizer
from .runtime.session import RunConfig, Session, TrainResult

__version__ = "0.1.0"

__all__ = ["Adam", "BudgetError", "CheckpointError", "DataError", "DivergenceError", "GraphError",
           "HostMemoryError", "MinidlError", "Network", "OptionError", "Optimizer", "Phase",
           "ResidencyError", "Role", "Route", "RunConfig", "SGD", "Session", "Step", "Symbol", "TensorSpec",
           "TrainResult", "format_bytes", "layers", "parse_size", "__version__"]
