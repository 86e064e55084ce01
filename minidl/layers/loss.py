"""Softmax cross-entropy, the mean over rows of -log softmax(logits)[label], classes on the last axis. As PyTorch's
`F.cross_entropy(..., ignore_index=i)`: ignored rows count for nothing (all ignored: NaN)."""
from __future__ import annotations

import math

import numpy as np

from ..core.guards import check_labels
from . import args
from .base import Layer, last_axis_rows

IGNORE_INDEX = -100  # PyTorch's default ignore_index


class SoftmaxCrossEntropy(Layer):
    type_name = "softmax_xent"
    num_inputs = 2
    needs_inputs = (0, 1)
    nondiff_inputs = (1,)
    is_loss = True
    checkpoint = True

    def __init__(self, ignore_index: int | None = None, name: str | None = None):
        super().__init__(name)
        self.ignore_index = (None if ignore_index is None else
                             args.integer(type(self).__name__, name, "ignore_index", ignore_index, -2**63))

    def check_input_dtypes(self, in_dtypes):
        if not np.issubdtype(in_dtypes[0], np.floating):
            raise ValueError(f"logits must be floating, got {np.dtype(in_dtypes[0]).name}")
        if not np.issubdtype(in_dtypes[1], np.integer):
            raise ValueError(f"labels must be integers (declare them with net.input(shape, dtype='int64')), "
                             f"got {np.dtype(in_dtypes[1]).name}")

    def infer_shape(self, in_shapes):
        logits, labels = in_shapes
        if len(logits) < 2:
            raise ValueError(f"logits must be (N, classes) or (N, ..., classes), got {logits}; add a "
                             f"Flatten/Linear first")
        if labels != logits[:-1]:
            raise ValueError(f"labels must be {logits[:-1]} (one per row of logits {logits}, classes on the last "
                             f"axis), got {labels}")
        return ()

    def check_values(self, inputs):
        self.check_label_values(inputs[1], inputs[0].shape[-1], f"{self.describe()}: labels")

    def check_label_values(self, labels, classes: int, where: str, shape=None) -> np.ndarray:
        """The labels, integers in [0, classes) or `ignore_index`."""
        return check_labels(labels, classes, where, shape, ignore_index=self.ignore_index)

    def flops(self, in_shapes, out_shape):
        return 5 * math.prod(in_shapes[0])

    def config(self):
        return {} if self.ignore_index is None else {"ignore_index": self.ignore_index}

    def backend_ops(self):
        return () if self.ignore_index is None else ("softmax_xent_ignore_forward", "softmax_xent_ignore_backward")

    def kernels(self):
        return ("softmax_xent_forward", "softmax_xent_backward") + self.backend_ops()

    def forward(self, be, inputs, out, params, ctx):
        r, k = last_axis_rows(inputs[0].shape)
        logits, labels = inputs[0].reshape(r, k), inputs[1].reshape(r)
        if self.ignore_index is None:
            be.softmax_xent_forward(logits, labels, out)
        else:
            be.softmax_xent_ignore_forward(logits, labels, out, self.ignore_index)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        r, k = last_axis_rows(inputs[0].shape)
        logits, labels, dlogits = inputs[0].reshape(r, k), inputs[1].reshape(r), dinputs[0].reshape(r, k)
        if self.ignore_index is None:
            be.softmax_xent_backward(logits, labels, dout, dlogits)
        else:
            be.softmax_xent_ignore_backward(logits, labels, dout, dlogits, self.ignore_index)
