"""BatchNorm2d with PyTorch's semantics. Training saves the batch statistics as aux (`mean`, `invstd`) and updates
the running ones (buffers, variance unbiased); a recomputation reuses the saved statistics and leaves the running
ones alone: bit-identical output, one running update a step.
"""
from __future__ import annotations

import math

from ..core.errors import GraphError
from . import args
from .base import Layer, ParamSpec


class BatchNorm2d(Layer):
    type_name = "batchnorm"
    needs_inputs = (0,)

    def __init__(self, momentum: float = 0.1, eps: float = 1e-5, affine: bool = True, name: str | None = None):
        super().__init__(name)
        who = (type(self).__name__, name)
        self.momentum = args.real(*who, "momentum", momentum, 0.0, 1.0)
        self.eps = args.real(*who, "eps", eps, 0.0, lo_open=True)
        self.affine = args.flag(*who, "affine", affine)

    def kernels(self):
        return ("batchnorm_forward_train", "batchnorm_forward_apply", "batchnorm_forward_eval", "batchnorm_backward",
                "batchnorm_backward_eval")

    def infer_shape(self, in_shapes):
        s = in_shapes[0]
        if len(s) != 4:
            raise ValueError(f"expects a 4-D input (N, C, H, W), got shape {s}")
        return s

    def check_training(self, in_shapes):
        s = in_shapes[0]
        if s[0] * s[2] * s[3] < 2:  # one value has no batch variance
            raise GraphError(f"{self.describe()} with input {s}: expected more than one value per channel when "
                             f"training (N x H x W = 1; PyTorch refuses it too): a batch variance needs two; use a "
                             f"larger batch, or evaluate (training=False)")

    def param_specs(self, in_shapes):
        c = in_shapes[0][1]
        specs = {}
        if self.affine:
            specs["weight"] = ParamSpec((c,), "ones")
            specs["bias"] = ParamSpec((c,), "zeros")
        specs["running_mean"] = ParamSpec((c,), "zeros", trainable=False)
        specs["running_var"] = ParamSpec((c,), "ones", trainable=False)
        return specs

    def aux_specs(self, in_shapes, training=True):
        c = in_shapes[0][1]
        return {"mean": (c,), "invstd": (c,)} if training else {}

    def flops(self, in_shapes, out_shape):
        # statistics (sum, deviation, square-and-add: 4 per element) + normalization (multiply-add: 2)
        return 6 * math.prod(in_shapes[0])

    def backward_flops(self, in_shapes, out_shape):
        # two reductions (3 per element) + the dx pass (5 per element)
        return 8 * math.prod(in_shapes[0])

    def config(self):
        return {"momentum": self.momentum, "eps": self.eps, "affine": self.affine}

    def forward(self, be, inputs, out, params, ctx):
        x, w, b = inputs[0], params.get("weight"), params.get("bias")
        if not ctx.training:
            be.batchnorm_forward_eval(x, w, b, params["running_mean"], params["running_var"], out, self.eps)
        elif ctx.recompute:
            be.batchnorm_forward_apply(x, w, b, ctx.aux["mean"], ctx.aux["invstd"], out)
        else:
            self.forward_relu(be, inputs, out, None, params, ctx)

    def forward_relu(self, be, inputs, out, relu_out, params, ctx, keep_out=True):
        """The training forward with ReLU(out) into `relu_out` in the same pass (`out` may stay unwritten unless
        `keep_out`); the compiled step's fused BN+ReLU."""
        extra = {} if relu_out is None else {"relu_out": relu_out, **({} if keep_out else {"keep_y": False})}
        be.batchnorm_forward_train(inputs[0], params.get("weight"), params.get("bias"), params["running_mean"],
                                   params["running_var"], out, ctx.aux["mean"], ctx.aux["invstd"], self.momentum,
                                   self.eps, update_running=True, **extra)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        x, w = inputs[0], params.get("weight")
        dx, dw, db = dinputs[0], grads.get("weight"), grads.get("bias")
        if ctx.training:
            be.batchnorm_backward(x, w, dout, ctx.aux["mean"], ctx.aux["invstd"], dx, dw, db)
        else:
            be.batchnorm_backward_eval(x, w, dout, params["running_mean"], params["running_var"], self.eps,
                                       dx, dw, db)

    def backward_relu(self, be, inputs, dout, dinputs, grads, params, ctx, relu_out, relu_dout):
        """The ReLU's backward (into `dout`, as `ReLU.backward` writes it) and then this one, in one call."""
        be.batchnorm_backward(inputs[0], params.get("weight"), dout, ctx.aux["mean"], ctx.aux["invstd"], dinputs[0],
                              grads.get("weight"), grads.get("bias"), relu=(relu_out, relu_dout))
