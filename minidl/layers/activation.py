"""Activations: ReLU, GELU, and softmax over the last axis.

ReLU's backward reads only the output (y > 0 <=> x > 0), so the input can die right after forward; GELU's reads
the input; softmax's reads only its output (dx = y (dy - sum(dy y)))."""
from __future__ import annotations

import math

from . import args
from .base import Layer, last_axis_rows


class ReLU(Layer):
    type_name = "relu"
    needs_output = True

    def kernels(self):
        return ("relu_forward", "relu_backward")

    def infer_shape(self, in_shapes):
        return in_shapes[0]

    def flops(self, in_shapes, out_shape):
        return math.prod(out_shape)

    def forward(self, be, inputs, out, params, ctx):
        be.relu_forward(inputs[0], out)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        be.relu_backward(out, dout, dinputs[0])


class GELU(Layer):
    """x Phi(x) (`approximate='none'`, with erf) or its tanh approximation (`'tanh'`, GPT-2's), as PyTorch's
    `nn.GELU(approximate=...)`. Any shape."""

    type_name = "gelu"
    needs_inputs = (0,)
    FORMS = ("none", "tanh")

    def __init__(self, approximate: str = "none", name: str | None = None):
        super().__init__(name)
        self.approximate = args.choice(type(self).__name__, name, "approximate", approximate, self.FORMS)

    def kernels(self):
        return ("gelu_forward", "gelu_backward")

    def infer_shape(self, in_shapes):
        return in_shapes[0]

    def flops(self, in_shapes, out_shape):
        return 8 * math.prod(out_shape)

    def config(self):
        return {"approximate": self.approximate}

    def backend_ops(self):
        return ("gelu_forward", "gelu_backward")

    def forward(self, be, inputs, out, params, ctx):
        be.gelu_forward(inputs[0], out, self.approximate)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        be.gelu_backward(inputs[0], dout, dinputs[0], self.approximate)


class Softmax(Layer):
    """Softmax over the last axis (`F.softmax(x, dim=-1)`), any shape of at least one axis."""

    type_name = "softmax"
    needs_output = True

    def kernels(self):
        return ("softmax_forward", "softmax_backward")

    def infer_shape(self, in_shapes):
        if len(in_shapes[0]) < 1:
            raise ValueError("expects an input with at least one axis, got a scalar")
        return in_shapes[0]

    def flops(self, in_shapes, out_shape):
        return 4 * math.prod(out_shape)

    def backend_ops(self):
        return ("softmax_forward", "softmax_backward")

    def forward(self, be, inputs, out, params, ctx):
        r, c = last_axis_rows(out.shape)
        be.softmax_forward(inputs[0].reshape(r, c), out.reshape(r, c))

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        r, c = last_axis_rows(out.shape)
        be.softmax_backward(out.reshape(r, c), dout.reshape(r, c), dinputs[0].reshape(r, c))
