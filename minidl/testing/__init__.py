"""Test helpers for a layer's author: `run_layer`, `directional_gradcheck`, `torch_twin` (a network in PyTorch)."""
from .layers import LayerRun, directional_gradcheck, run_layer

__all__ = ["LayerRun", "directional_gradcheck", "run_layer"]
