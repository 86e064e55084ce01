"""Joins: Add (residual connections) and Concat along channels (DenseNet, Inception).

Neither backward reads any forward tensor: Add passes its delta through, Concat slices it.
"""
from __future__ import annotations

import math

from .base import Layer


class Add(Layer):
    type_name = "add"
    num_inputs = None
    checkpoint = True

    def kernels(self):
        return ("add_forward", "copy", "add_relu_backward")

    def infer_shape(self, in_shapes):
        first = in_shapes[0]
        for i, s in enumerate(in_shapes[1:], start=1):
            if s != first:
                raise ValueError(f"all inputs must have the same shape; input 0 is {first}, input {i} is {s}")
        return first

    def flops(self, in_shapes, out_shape):
        return (len(in_shapes) - 1) * math.prod(out_shape)

    def backward_flops(self, in_shapes, out_shape):
        return len(in_shapes) * math.prod(out_shape)

    def forward(self, be, inputs, out, params, ctx):
        be.add_forward(inputs, out)

    def forward_relu(self, be, inputs, out, relu_out, params, ctx, keep_out=True):
        """`forward` with ReLU(out) into `relu_out` in the same pass (`out` unwritten unless `keep_out`)."""
        be.add_forward(inputs, out, relu_out=relu_out, keep_y=keep_out)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        for dx in dinputs:
            if dx is not None:
                be.copy(dx, dout)

    def backward_relu(self, be, inputs, dout, dinputs, grads, params, ctx, relu_out, relu_dout):
        """The following ReLU's backward, then `backward`, in one call (`dout` may stay unwritten)."""
        be.add_relu_backward(relu_out, relu_dout, dout, dinputs)


class Concat(Layer):
    """Concatenate NCHW (or NC) tensors along channels (axis 1)."""

    type_name = "concat"
    num_inputs = None
    checkpoint = True

    def kernels(self):
        return ("concat_forward", "concat_backward")

    def infer_shape(self, in_shapes):
        first = in_shapes[0]
        for i, s in enumerate(in_shapes):
            if len(s) != len(first) or s[:1] != first[:1] or s[2:] != first[2:]:
                raise ValueError(f"inputs must agree on every axis but channels (1); input 0 is {first}, "
                                 f"input {i} is {s}")
        # backward needs the channel counts even of inputs without a delta
        self.channels = [s[1] for s in in_shapes]
        return (first[0], sum(self.channels)) + tuple(first[2:])

    def flops(self, in_shapes, out_shape):
        return 0

    def backward_flops(self, in_shapes, out_shape):
        return 0

    def forward(self, be, inputs, out, params, ctx):
        be.concat_forward(inputs, out)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        be.concat_backward(dout, dinputs, self.channels)
