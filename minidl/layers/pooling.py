"""Pooling: MaxPool2d, AvgPool2d (PyTorch semantics, NCHW) and GlobalAvgPool ((N, C, H, W) -> (N, C)).

MaxPool2d's backward needs only its input (usually kept anyway by its producer) and re-derives each window's
argmax: keeping the output (cuDNN) or int64 indices (PyTorch) would hold a quarter to half of the input more.
"""
from __future__ import annotations

import math

from . import args
from .base import Layer

Pair = tuple[int, int]


def pool_output_size(size: int, k: int, stride: int, pad: int, dilation: int, ceil_mode: bool) -> int:
    """PyTorch's pooling_output_shape (with ceil_mode the last window starts inside the input or left padding)."""
    span = dilation * (k - 1) + 1
    num = size + 2 * pad - span + ((stride - 1) if ceil_mode else 0)
    out = num // stride + 1  # Python's // rounds toward -inf, like PyTorch's div_rtn
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _check_window(in_shapes, kernel: Pair, stride: Pair, padding: Pair, dilation: Pair,
                  ceil_mode: bool, all_padding: bool = False) -> tuple[int, int, int, int]:
    """The output shape of a valid 2-D pooling window; ValueError otherwise."""
    s = in_shapes[0]
    if len(s) != 4:
        raise ValueError(f"expects a 4-D input (N, C, H, W), got shape {s}")
    for what, v, least in (("kernel_size", kernel, 1), ("stride", stride, 1), ("dilation", dilation, 1),
                           ("padding", padding, 0)):
        if min(v) < least:
            raise ValueError(f"{what} must be {'positive' if least else 'non-negative'}, got {v}")
    if padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
        raise ValueError(f"padding {padding} must be at most half the kernel size {kernel} (as in PyTorch)")
    out_hw = tuple(pool_output_size(s[2 + a], kernel[a], stride[a], padding[a], dilation[a], ceil_mode)
                   for a in range(2))
    if min(out_hw) <= 0:
        raise ValueError(f"input {s[2]}x{s[3]} is too small for kernel {kernel}, stride {stride}, padding "
                         f"{padding}, dilation {dilation}: the output would be {out_hw[0]}x{out_hw[1]}")
    for a in range(2):
        # a window wider than the padded input is a mistake (AvgPool2d(100000) on 8x8), not a clip
        span = dilation[a] * (kernel[a] - 1) + 1
        if span > s[2 + a] + 2 * padding[a]:
            raise ValueError(f"kernel {kernel} (dilation {dilation}) spans {span} along "
                             f"{'HW'[a]}, more than the padded input {s[2 + a]} + 2 x {padding[a]}")
        if all_padding:
            o = _window_in_padding(s[2 + a], kernel[a], stride[a], padding[a], dilation[a], out_hw[a])
            if o is not None:
                raise ValueError(f"output {'row' if a == 0 else 'column'} {o} pools a window that lies entirely "
                                 f"in the padding (input {s[2]}x{s[3]}, kernel {kernel}, stride {stride}, padding "
                                 f"{padding}, dilation {dilation}): its maximum would be -inf")
    return (s[0], s[1], out_hw[0], out_hw[1])


def _window_in_padding(size: int, k: int, stride: int, pad: int, dilation: int, out: int) -> int | None:
    """The first output index whose window misses [0, size), else None; O(out), whatever the kernel size."""
    for o in range(out):
        start = o * stride - pad
        j0 = max(0, -(start // dilation)) if start < 0 else 0
        if j0 >= k or start + j0 * dilation >= size:
            return o
    return None


class MaxPool2d(Layer):
    """Max pooling; padding acts as -inf."""

    type_name = "maxpool"
    needs_inputs = (0,)
    needs_output = False

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
                 name: str | None = None):
        super().__init__(name)
        who = (type(self).__name__, name)
        self.kernel_size = args.int_pair(*who, "kernel_size", kernel_size, 1)
        self.stride = self.kernel_size if stride is None else args.int_pair(*who, "stride", stride, 1)
        self.padding = args.int_pair(*who, "padding", padding, 0)
        self.dilation = args.int_pair(*who, "dilation", dilation, 1)
        self.ceil_mode = args.flag(*who, "ceil_mode", ceil_mode)

    def kernels(self):
        return ("maxpool2d_forward", "maxpool2d_backward")

    def infer_shape(self, in_shapes):
        return _check_window(in_shapes, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode,
                             all_padding=True)

    def flops(self, in_shapes, out_shape):
        return math.prod(out_shape) * self.kernel_size[0] * self.kernel_size[1]

    def backward_flops(self, in_shapes, out_shape):
        return 3 * self.flops(in_shapes, out_shape)  # recompute the maxima, then compare and route

    def config(self):
        return {"kernel_size": self.kernel_size, "stride": self.stride, "padding": self.padding,
                "dilation": self.dilation, "ceil_mode": self.ceil_mode}

    def forward(self, be, inputs, out, params, ctx):
        be.maxpool2d_forward(inputs[0], out, self.kernel_size, self.stride, self.padding, self.dilation)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        if dinputs[0] is None:
            return
        be.maxpool2d_backward(inputs[0], dout, dinputs[0], self.kernel_size, self.stride, self.padding,
                              self.dilation)


class AvgPool2d(Layer):
    """Average pooling (padding counts as zeros; `count_include_pad` chooses the divisor, as in PyTorch)."""

    type_name = "avgpool"

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True,
                 name: str | None = None):
        super().__init__(name)
        who = (type(self).__name__, name)
        self.kernel_size = args.int_pair(*who, "kernel_size", kernel_size, 1)
        self.stride = self.kernel_size if stride is None else args.int_pair(*who, "stride", stride, 1)
        self.padding = args.int_pair(*who, "padding", padding, 0)
        self.ceil_mode = args.flag(*who, "ceil_mode", ceil_mode)
        self.count_include_pad = args.flag(*who, "count_include_pad", count_include_pad)

    def kernels(self):
        return ("avgpool2d_forward", "avgpool2d_backward")

    def infer_shape(self, in_shapes):
        return _check_window(in_shapes, self.kernel_size, self.stride, self.padding, (1, 1), self.ceil_mode)

    def flops(self, in_shapes, out_shape):
        return math.prod(out_shape) * (self.kernel_size[0] * self.kernel_size[1] + 1)

    def config(self):
        return {"kernel_size": self.kernel_size, "stride": self.stride, "padding": self.padding,
                "ceil_mode": self.ceil_mode, "count_include_pad": self.count_include_pad}

    def forward(self, be, inputs, out, params, ctx):
        be.avgpool2d_forward(inputs[0], out, self.kernel_size, self.stride, self.padding, self.count_include_pad)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        if dinputs[0] is None:
            return
        be.avgpool2d_backward(dout, dinputs[0], self.kernel_size, self.stride, self.padding,
                              self.count_include_pad)


class GlobalAvgPool(Layer):
    """Mean over each plane: (N, C, H, W) -> (N, C), so a Linear can follow directly."""

    type_name = "gap"

    def kernels(self):
        return ("global_avgpool_forward", "global_avgpool_backward")

    def infer_shape(self, in_shapes):
        s = in_shapes[0]
        if len(s) != 4:
            raise ValueError(f"expects a 4-D input (N, C, H, W), got shape {s}")
        return (s[0], s[1])

    def flops(self, in_shapes, out_shape):
        return math.prod(in_shapes[0])

    def backward_flops(self, in_shapes, out_shape):
        return math.prod(in_shapes[0])

    def forward(self, be, inputs, out, params, ctx):
        be.global_avgpool_forward(inputs[0], out)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        if dinputs[0] is not None:
            be.global_avgpool_backward(dout, dinputs[0])
