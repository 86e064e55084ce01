"""ReLU. Backward reads only the output (y > 0 <=> x > 0), so the input can die right after forward."""
from __future__ import annotations

import math

from .base import Layer


class ReLU(Layer):
    type_name = "relu"
    needs_output = True

    def infer_shape(self, in_shapes):
        return in_shapes[0]

    def flops(self, in_shapes, out_shape):
        return math.prod(out_shape)

    def forward(self, be, inputs, out, params, ctx):
        be.relu_forward(inputs[0], out)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        be.relu_backward(out, dout, dinputs[0])
