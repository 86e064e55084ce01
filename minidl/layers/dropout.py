"""Dropout with a replayable mask.

The mask is a pure function of (key, element index) through a counter-based RNG (splitmix64), so nothing is
stored between forward and backward: backward, and any recomputation of forward, regenerate the very same
mask. The executor derives the key from the run's seed, the layer's position and the iteration.
"""
from __future__ import annotations

from . import args
from .base import Layer


class Dropout(Layer):
    type_name = "dropout"
    uses_rng_key = True

    def __init__(self, p: float = 0.5, name: str | None = None):
        super().__init__(name)
        # p = 1 would zero every value and divide by 1 - p = 0 (PyTorch returns zeros; here it is refused)
        self.p = args.real(type(self).__name__, name, "p", p, 0.0, 1.0, hi_open=True)

    def kernels(self):
        return ("dropout_forward", "dropout_backward", "copy")

    def infer_shape(self, in_shapes):
        return in_shapes[0]

    def config(self):
        return {"p": self.p}

    def forward(self, be, inputs, out, params, ctx):
        if ctx.training and self.p > 0:
            be.dropout_forward(inputs[0], out, self.p, ctx.rng_key)
        else:
            be.copy(out, inputs[0])

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        # the gradient of what forward computed: in evaluation forward is the identity, so backward is too
        if ctx.training and self.p > 0:
            be.dropout_backward(dout, dinputs[0], self.p, ctx.rng_key)
        else:
            be.copy(dinputs[0], dout)
