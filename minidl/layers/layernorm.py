"""LayerNorm over the last axis (PyTorch's `nn.LayerNorm(C)`): each row of C values normalized by its own mean
and variance (biased), then scaled and shifted per feature.

Training and evaluation compute the same thing (no running statistics). Forward saves the per-row mean and
1/std as aux tensors (one value per row each: what backward reads beside the input), so backward does not redo
the reductions, and a recomputed forward (`ctx.recompute`) applies the saved statistics and gives the same bits.
"""
from __future__ import annotations

import math

from . import args
from .base import Layer, ParamSpec, last_axis_rows


class LayerNorm(Layer):
    type_name = "layernorm"
    needs_inputs = (0,)

    def __init__(self, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 name: str | None = None):
        super().__init__(name)
        who = (type(self).__name__, name)
        self.eps = args.real(*who, "eps", eps, 0.0, lo_open=True)
        self.elementwise_affine = args.flag(*who, "elementwise_affine", elementwise_affine)
        self.bias = args.flag(*who, "bias", bias)

    def kernels(self):
        return ("layernorm_forward", "layernorm_forward_apply", "layernorm_backward")

    def infer_shape(self, in_shapes):
        s = in_shapes[0]
        if len(s) < 2:
            raise ValueError(f"expects an input (N, ..., C) normalized over its last axis, got shape {s}")
        return s

    def param_specs(self, in_shapes):
        c = in_shapes[0][-1]
        specs = {}
        if self.elementwise_affine:
            specs["weight"] = ParamSpec((c,), "ones")
            if self.bias:
                specs["bias"] = ParamSpec((c,), "zeros")
        return specs

    def aux_specs(self, in_shapes, training=True):
        return {"mean": in_shapes[0][:-1], "rstd": in_shapes[0][:-1]} if training else {}

    def flops(self, in_shapes, out_shape):
        return 7 * math.prod(in_shapes[0])  # mean, deviation, square-and-add; subtract, scale, affine

    def backward_flops(self, in_shapes, out_shape):
        return 11 * math.prod(in_shapes[0])

    def config(self):
        return {"eps": self.eps, "elementwise_affine": self.elementwise_affine, "bias": self.bias}

    def backend_ops(self):
        return ("layernorm_forward", "layernorm_forward_apply", "layernorm_backward")

    def forward(self, be, inputs, out, params, ctx):
        r, c = last_axis_rows(out.shape)
        x, y = inputs[0].reshape(r, c), out.reshape(r, c)
        if not ctx.training:  # evaluation: no statistics are saved (no aux tensors)
            be.layernorm_forward(x, params.get("weight"), params.get("bias"), y, None, None, self.eps)
            return
        mean, rstd = ctx.aux["mean"].reshape(r), ctx.aux["rstd"].reshape(r)
        if ctx.recompute:
            be.layernorm_forward_apply(x, params.get("weight"), params.get("bias"), mean, rstd, y)
        else:
            be.layernorm_forward(x, params.get("weight"), params.get("bias"), y, mean, rstd, self.eps)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        r, c = last_axis_rows(dout.shape)
        dx = dinputs[0].reshape(r, c) if dinputs[0] is not None else None
        be.layernorm_backward(inputs[0].reshape(r, c), params.get("weight"), dout.reshape(r, c),
                              ctx.aux["mean"].reshape(r), ctx.aux["rstd"].reshape(r), dx, grads.get("weight"),
                              grads.get("bias"))
