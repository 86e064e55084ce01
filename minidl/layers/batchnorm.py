"""BatchNorm2d: per-channel normalization over (N, H, W), PyTorch semantics.

Training normalizes with the batch statistics, saves them as aux tensors (`mean`, `invstd`: C values each, the
only thing backward needs beside the input) and folds them into the running statistics (variance unbiased).
Evaluation normalizes with the running statistics. The running statistics are buffers (`trainable=False`
parameters): they live with the parameters, are updated in place and never receive a gradient.

Recomputation (`ctx.recompute`) re-normalizes with the saved statistics and leaves the running statistics
alone, so a recomputed output is bit-identical to the first one and a step has exactly one running update.
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
        if s[0] * s[2] * s[3] < 2:  # training normalizes by the batch variance, which one value does not have
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
        """The training forward, and with `relu_out` also ReLU(out) written there in the same pass: what the
        compiled step runs for a BN whose output feeds a ReLU next (`minidl.runtime.program`, on backends whose
        `capabilities.fuses` has `batchnorm_relu`). `out` is written as by `forward` (unless `keep_out` is False:
        nothing else reads it, and the backend may leave it unwritten), `relu_out` as `ReLU.forward(out)` would."""
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
        """The training backward of a batch norm whose output feeds a ReLU, with that ReLU's backward first in
        the same call: dout (this layer's output gradient) is written as `ReLU.backward` would write it from
        relu_out and relu_dout, then used. What the compiled step runs where it folds the pair
        (`minidl.runtime.program`, on backends whose `capabilities.fuses` has `batchnorm_relu`)."""
        be.batchnorm_backward(inputs[0], params.get("weight"), dout, ctx.aux["mean"], ctx.aux["invstd"], dinputs[0],
                              grads.get("weight"), grads.get("bias"), relu=(relu_out, relu_dout))
