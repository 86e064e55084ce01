"""Dropout whose mask is a pure function of (key, element index) (splitmix64): nothing is stored, backward and
recomputation regenerate it. The key comes from the seed, the layer's position and the iteration."""
from __future__ import annotations

from . import args
from .base import Layer


class Dropout(Layer):
    type_name = "dropout"
    uses_rng_key = True

    def __init__(self, p: float = 0.5, name: str | None = None):
        super().__init__(name)
        # p = 1 would divide by 1 - p = 0 (PyTorch returns zeros; refused here)
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
        # in evaluation forward is the identity, so backward is too
        if ctx.training and self.p > 0:
            be.dropout_backward(dout, dinputs[0], self.p, ctx.rng_key)
        else:
            be.copy(dinputs[0], dout)
