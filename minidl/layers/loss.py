"""Softmax cross-entropy loss: mean over the batch of -log softmax(logits)[label]."""
from __future__ import annotations

import math

import numpy as np

from ..guards import check_labels
from .base import Layer


class SoftmaxCrossEntropy(Layer):
    type_name = "softmax_xent"
    num_inputs = 2
    needs_inputs = (0, 1)
    nondiff_inputs = (1,)
    is_loss = True
    checkpoint = True

    def check_input_dtypes(self, in_dtypes):
        if not np.issubdtype(in_dtypes[0], np.floating):
            raise ValueError(f"logits must be floating, got {np.dtype(in_dtypes[0]).name}")
        if not np.issubdtype(in_dtypes[1], np.integer):
            raise ValueError(f"labels must be integers (declare them with net.input(shape, dtype='int64')), "
                             f"got {np.dtype(in_dtypes[1]).name}")

    def infer_shape(self, in_shapes):
        logits, labels = in_shapes
        if len(logits) != 2:
            raise ValueError(f"logits must be (N, classes), got {logits}; add a Flatten/Linear first")
        if labels != (logits[0],):
            raise ValueError(f"labels must be ({logits[0]},) to match logits {logits}, got {labels}")
        return ()

    def check_values(self, inputs):
        check_labels(inputs[1], inputs[0].shape[1], f"{self.describe()}: labels")

    def flops(self, in_shapes, out_shape):
        return 5 * math.prod(in_shapes[0])

    def forward(self, be, inputs, out, params, ctx):
        be.softmax_xent_forward(inputs[0], inputs[1], out)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        be.softmax_xent_backward(inputs[0], inputs[1], dout, dinputs[0])
