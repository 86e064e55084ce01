"""2-D convolution (NCHW, PyTorch's weight layout and default initialization).

The layer declares its algorithms and exact workspaces from the menu the plan is for; the planner picks one
per phase and hands the workspace and the algorithm's name in through the LayerContext.
"""
from __future__ import annotations

import numpy as np

from ..backend.common import conv_output_hw
from ..backend.cpu.conv import ALGOS as CPU_ALGOS
from ..backend.cpu.conv import ConvGeometry, conv_algorithms
from . import args
from .base import Layer, LayerContext, ParamSpec


class Conv2d(Layer):
    """y = conv2d(x, W) + b with W of shape (out_channels, in_channels / groups, kh, kw)."""

    type_name = "conv"
    needs_inputs = (0,)
    checkpoint = True
    half_params = ("weight", "bias")
    accumulates_in_place = True

    def __init__(self, out_channels: int, kernel_size, stride=1, padding=0, dilation=1, groups: int = 1,
                 bias: bool = True, name: str | None = None):
        super().__init__(name)
        who = (type(self).__name__, name)
        self.out_channels = args.integer(*who, "out_channels", out_channels, 1)
        self.kernel_size = args.int_pair(*who, "kernel_size", kernel_size, 1)
        self.stride = args.int_pair(*who, "stride", stride, 1)
        self.padding = args.int_pair(*who, "padding", padding, 0)
        self.dilation = args.int_pair(*who, "dilation", dilation, 1)
        self.groups = args.integer(*who, "groups", groups, 1)
        self.bias = args.flag(*who, "bias", bias)

    # -- declarations
    def kernels(self):
        return ("conv2d_forward", "conv2d_backward", "accumulate")

    def infer_shape(self, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise ValueError(f"expects a 4-D input (N, C, H, W), got {len(s)}-D shape {s}")
        for what, v, lo in (("kernel_size", self.kernel_size, 1), ("stride", self.stride, 1),
                            ("padding", self.padding, 0), ("dilation", self.dilation, 1)):
            if min(v) < lo:
                raise ValueError(f"{what} must be >= {lo}, got {v}")
        if self.out_channels <= 0:
            raise ValueError(f"out_channels must be positive, got {self.out_channels}")
        if self.groups <= 0:
            raise ValueError(f"groups must be positive, got {self.groups}")
        n, c, h, w = s
        if c % self.groups:
            raise ValueError(f"input channels {c} (input shape {s}) are not divisible by groups={self.groups}")
        if self.out_channels % self.groups:
            raise ValueError(f"out_channels {self.out_channels} is not divisible by groups={self.groups}")
        ho, wo = conv_output_hw((h, w), self.kernel_size, self.stride, self.padding, self.dilation)
        if ho <= 0 or wo <= 0:
            raise ValueError(f"output size {ho}x{wo} is not positive: input H,W {h}x{w} is too small for kernel "
                             f"{self.kernel_size} with padding {self.padding}, dilation {self.dilation}, "
                             f"stride {self.stride}")
        return (n, self.out_channels, ho, wo)

    def _fan_in(self, in_shapes) -> int:
        kh, kw = self.kernel_size
        return in_shapes[0][1] // self.groups * kh * kw

    def param_specs(self, in_shapes):
        kh, kw = self.kernel_size
        fan_in = self._fan_in(in_shapes)
        fan_out = self.out_channels // self.groups * kh * kw
        specs = {"weight": ParamSpec((self.out_channels, in_shapes[0][1] // self.groups, kh, kw),
                                     "kaiming_uniform", fan_in=fan_in, fan_out=fan_out)}
        if self.bias:
            specs["bias"] = ParamSpec((self.out_channels,), "bias_uniform", fan_in=fan_in)
        return specs

    def flops(self, in_shapes, out_shape):
        n, cout, ho, wo = out_shape
        f = 2 * n * cout * ho * wo * self._fan_in(in_shapes)
        return f + (n * cout * ho * wo if self.bias else 0)

    def backward_flops(self, in_shapes, out_shape):
        return 2 * self.flops(in_shapes, out_shape)

    def _geometry(self, in_shapes, out_shape) -> ConvGeometry:
        n, c, h, w = in_shapes[0]
        return ConvGeometry(n, c, h, w, self.out_channels, *self.kernel_size, *out_shape[2:], self.groups,
                            tuple(self.stride), tuple(self.padding), tuple(self.dilation))

    def algorithms(self, in_shape=None, winograd: bool = True) -> list[str]:
        """The CPU algorithms this configuration can run (`winograd`: Winograd on the menu); with
        `in_shape` exactly, without it those the configuration alone decides."""
        shape = None if in_shape is None else tuple(in_shape)
        key = (shape, winograd)
        cache = self.__dict__.setdefault("_algorithms", {})  # called on every step: worked out once per shape
        if key not in cache:
            geom = None if shape is None else self._geometry([shape], self.infer_shape([shape]))
            cache[key] = conv_algorithms(self.kernel_size, self.stride, self.padding, self.dilation, self.groups,
                                         geom, winograd)
        return cache[key]

    def workspace_options(self, phase, in_shapes, out_shape, itemsize, menu, accumulate=frozenset()):
        """`menu`'s algorithms for this convolution, fastest first, with exact workspaces;
        `accumulate` {0}: the accumulating backward."""
        w_shape = (self.out_channels, in_shapes[0][1] // self.groups, *self.kernel_size)
        return menu.conv_workspace_options(phase, tuple(in_shapes[0]), w_shape, tuple(out_shape), self.stride,
                                           self.padding, self.dilation, self.groups, np.dtype(f"f{itemsize}"),
                                           accumulate=0 in accumulate)

    def config(self):
        return {"out_channels": self.out_channels, "kernel_size": self.kernel_size, "stride": self.stride,
                "padding": self.padding, "dilation": self.dilation, "groups": self.groups, "bias": self.bias}

    # -- compute
    def _algo(self, ctx: LayerContext, phase: str, in_shape) -> str:
        algo = ctx.algo
        if algo is None:
            if ctx.workspace is None and "gemm_1x1" in self.algorithms(in_shape):
                return "gemm_1x1"
            raise ValueError(f"{self.describe()}: no {phase} algorithm chosen; pick one of "
                             f"{self.algorithms(in_shape)} and hand in its workspace (see workspace_options)")
        # another backend's names: it checks them; a CPU name must be on the CPU's menu, Winograd on or off
        if algo in CPU_ALGOS and algo not in self.algorithms(in_shape) and algo not in self.algorithms(in_shape, False):
            raise ValueError(f"{self.describe()}: {phase} algorithm {algo!r} is not available for this "
                             f"configuration on input {tuple(in_shape)}; have {self.algorithms(in_shape)}")
        return algo

    def forward(self, be, inputs, out, params, ctx):
        be.conv2d_forward(inputs[0], params["weight"], params.get("bias"), out, self.stride, self.padding,
                          self.dilation, self.groups, self._algo(ctx, "fwd", inputs[0].shape), ctx.workspace)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        # at a fork, dinputs[0] already holds the other consumers' contributions: added into
        be.conv2d_backward(inputs[0], params["weight"], dout, dinputs[0], grads.get("weight"), grads.get("bias"),
                           self.stride, self.padding, self.dilation, self.groups,
                           self._algo(ctx, "bwd", inputs[0].shape), ctx.workspace, accumulate=0 in ctx.accumulate)
