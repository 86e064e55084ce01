"""minidl: a small deep-learning framework whose executor virtualizes device memory.

    import minidl as dl
    net = dl.Network()
    x = net.input((8, 3, 32, 32)); y = net.input((8,), dtype="int64", name="label")
    ...
"""
from . import layers
from .errors import BudgetError, GraphError, MinidlError, ResidencyError
from .graph import Network, Symbol
from .route import Phase, Route, Step
from .tensors import Role, TensorSpec

__version__ = "0.1.0"

__all__ = ["BudgetError", "GraphError", "MinidlError", "Network", "Phase", "ResidencyError", "Role", "Route",
           "Step", "Symbol", "TensorSpec", "layers", "__version__"]
