"""Test helpers a layer's author uses: `run_layer` runs one layer's forward and backward on a backend,
`directional_gradcheck` checks its gradients by finite differences; `torch_twin` (imports torch) rebuilds a network
in PyTorch to compare values and gradients."""
from .layers import LayerRun, directional_gradcheck, run_layer

__all__ = ["LayerRun", "directional_gradcheck", "run_layer"]
