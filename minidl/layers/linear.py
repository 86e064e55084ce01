"""Linear (fully connected), MatMul (a batched product of two tensors) and Flatten."""
from __future__ import annotations

import math

from . import args
from .base import Layer, ParamSpec


class Linear(Layer):
    """y = x W^T + b, W (out_features, in_features). `flatten=True` reads (N, ...) as (N, F); `flatten=False` is
    `torch.nn.Linear` on the last axis. The kernels see one 2-D product either way."""

    type_name = "linear"
    needs_inputs = (0,)
    checkpoint = True
    half_params = ("weight", "bias")

    def __init__(self, out_features: int, bias: bool = True, flatten: bool = True, name: str | None = None):
        super().__init__(name)
        self.out_features = args.integer(type(self).__name__, name, "out_features", out_features, 1)
        self.bias = args.flag(type(self).__name__, name, "bias", bias)
        self.flatten = args.flag(type(self).__name__, name, "flatten", flatten)

    def kernels(self):
        return ("linear_forward", "linear_backward")

    def infer_shape(self, in_shapes):
        s = in_shapes[0]
        if len(s) < 2:
            raise ValueError(f"expects a batched input (N, features...), got {s}")
        if self.out_features <= 0:
            raise ValueError(f"out_features must be positive, got {self.out_features}")
        return (s[0], self.out_features) if self.flatten else s[:-1] + (self.out_features,)

    def _in_features(self, shape) -> int:
        return math.prod(shape[1:]) if self.flatten else shape[-1]

    def _matrix(self, a):
        """`a` as the kernels' 2-D matrix (a view)."""
        if a is None:
            return None
        return a.reshape(a.shape[0], -1) if self.flatten else a.reshape(-1, a.shape[-1])

    def param_specs(self, in_shapes):
        fin = self._in_features(in_shapes[0])
        specs = {"weight": ParamSpec((self.out_features, fin), "kaiming_uniform", fan_in=fin,
                                     fan_out=self.out_features)}
        if self.bias:
            specs["bias"] = ParamSpec((self.out_features,), "bias_uniform", fan_in=fin)
        return specs

    def flops(self, in_shapes, out_shape):
        return 2 * math.prod(in_shapes[0]) * self.out_features

    def config(self):
        return {"out_features": self.out_features, "bias": self.bias, "flatten": self.flatten}

    def forward(self, be, inputs, out, params, ctx):
        be.linear_forward(self._matrix(inputs[0]), params["weight"], params.get("bias"), self._matrix(out))

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        be.linear_backward(self._matrix(inputs[0]), params["weight"], self._matrix(dout), self._matrix(dinputs[0]),
                           grads.get("weight"), grads.get("bias"))


class MatMul(Layer):
    """`torch.matmul` on equal batch axes (a b^T with `transpose_b`); backward reads both inputs."""

    type_name = "matmul"
    num_inputs = 2
    needs_inputs = (0, 1)
    checkpoint = True

    def __init__(self, transpose_b: bool = False, name: str | None = None):
        super().__init__(name)
        self.transpose_b = args.flag(type(self).__name__, name, "transpose_b", transpose_b)

    def kernels(self):
        return ("matmul_forward", "matmul_backward")

    def infer_shape(self, in_shapes):
        a, b = in_shapes
        if len(a) < 2 or len(b) != len(a) or a[:-2] != b[:-2]:
            raise ValueError(f"expects a (..., M, K) and b (..., K, N) with the same batch axes, got {a} and {b}")
        k_b, n = (b[-1], b[-2]) if self.transpose_b else (b[-2], b[-1])
        if a[-1] != k_b:
            raise ValueError(f"the inner sizes differ: a {a} has K={a[-1]}, b {b} has K={k_b}"
                             f"{' (transpose_b: its last axis)' if self.transpose_b else ''}")
        return a[:-1] + (n,)

    def flops(self, in_shapes, out_shape):
        return 2 * math.prod(out_shape) * in_shapes[0][-1]

    def config(self):
        return {"transpose_b": self.transpose_b}

    def backend_ops(self):
        return ("matmul_forward", "matmul_backward")

    def _b(self, b):
        return b.swapaxes(-1, -2) if self.transpose_b else b

    def forward(self, be, inputs, out, params, ctx):
        be.matmul_forward(inputs[0], self._b(inputs[1]), out)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        db = dinputs[1]
        be.matmul_backward(inputs[0], self._b(inputs[1]), dout, dinputs[0], None if db is None else self._b(db))


class Flatten(Layer):
    """(N, C, H, W) -> (N, C*H*W), a copy: every tensor keeps a single owner in the pool."""

    type_name = "flatten"

    def kernels(self):
        return ("copy",)

    def infer_shape(self, in_shapes):
        s = in_shapes[0]
        if len(s) < 2:
            raise ValueError(f"expects a batched input, got {s}")
        return (s[0], math.prod(s[1:]))

    def flops(self, in_shapes, out_shape):
        return 0

    def backward_flops(self, in_shapes, out_shape):
        return 0

    def forward(self, be, inputs, out, params, ctx):
        be.copy(out, inputs[0].reshape(out.shape))

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        be.copy(dinputs[0], dout.reshape(dinputs[0].shape))
