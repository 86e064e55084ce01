"""LRN: local response normalization across channels (AlexNet, GoogLeNet), torch's local_response_norm.

    y_c = x_c / (k + alpha/size * sum_{j = c - size//2}^{c + (size-1)//2} x_j^2) ^ beta   (zero outside [0, C))

Backward reads the input (to rebuild the per-element scale, which is never stored) and the output.
"""
from __future__ import annotations

import math

from . import args
from .base import Layer


class LRN(Layer):
    type_name = "lrn"
    needs_inputs = (0,)
    needs_output = True

    def __init__(self, size: int = 5, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0,
                 name: str | None = None):
        super().__init__(name)
        who = (type(self).__name__, name)
        self.size = args.integer(*who, "size", size, 1)
        self.alpha = args.real(*who, "alpha", alpha, 0.0)
        self.beta = args.real(*who, "beta", beta, -math.inf)
        self.k = args.real(*who, "k", k, 0.0, lo_open=True)  # the scale k + alpha * sum(x^2) must stay positive

    def kernels(self):
        return ("lrn_forward", "lrn_backward")

    def infer_shape(self, in_shapes):
        s = in_shapes[0]
        if len(s) != 4:
            raise ValueError(f"expects a 4-D input (N, C, H, W), got shape {s}")
        if self.k <= 0:
            raise ValueError(f"k must be positive (the scale must stay positive), got {self.k}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be non-negative, got {self.alpha}")
        return s

    def flops(self, in_shapes, out_shape):
        # square, window sum (size adds), scale and shift, power (~4), multiply
        return math.prod(out_shape) * (self.size + 8)

    def config(self):
        return {"size": self.size, "alpha": self.alpha, "beta": self.beta, "k": self.k}

    def forward(self, be, inputs, out, params, ctx):
        be.lrn_forward(inputs[0], out, self.size, self.alpha, self.beta, self.k)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        if dinputs[0] is not None:
            be.lrn_backward(inputs[0], out, dout, dinputs[0], self.size, self.alpha, self.beta, self.k)
