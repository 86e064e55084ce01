"""minidl: a small deep-learning framework whose executor virtualizes device memory.

    import minidl as dl
    net = dl.Network()
    x = net.input((8, 3, 32, 32)); y = net.input((8,), dtype="int64", name="label")
    ...
"""
from . import layers
from .errors import (
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
from .graph import Network, Symbol
from .memory.pool import format_bytes, parse_size
from .optim import SGD, Adam, Optimizer
from .route import Phase, Route, Step
from .session import Session, TrainResult
from .tensors import Role, TensorSpec

__version__ = "0.1.0"

__all__ = ["Adam", "BudgetError", "CheckpointError", "DataError", "DivergenceError", "GraphError",
           "HostMemoryError", "MinidlError", "Network", "OptionError", "Optimizer", "Phase",
           "ResidencyError", "Role", "Route", "SGD", "Session", "Step", "Symbol", "TensorSpec", "TrainResult",
           "format_bytes", "layers", "parse_size", "__version__"]
