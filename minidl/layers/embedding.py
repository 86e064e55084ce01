"""Embeddings: `Embedding`'s backward reads only its indices (no gradient for them); `PositionEmbedding`'s none."""
from __future__ import annotations

import math

import numpy as np

from ..core.errors import DataError
from . import args
from .base import Layer, ParamSpec


class Embedding(Layer):
    """`nn.Embedding`: indices (...) -> rows (..., embedding_dim), the gradient summed over repeated indices.
    Initialized N(0, std^2): 1 is PyTorch's default, GPT-2 and BERT use 0.02."""

    type_name = "embedding"
    needs_inputs = (0,)
    nondiff_inputs = (0,)
    checkpoint = True  # kept, like a linear's output, rather than rebuilt

    def __init__(self, num_embeddings: int, embedding_dim: int, std: float = 1.0, name: str | None = None):
        super().__init__(name)
        who = (type(self).__name__, name)
        self.num_embeddings = args.integer(*who, "num_embeddings", num_embeddings, 1)
        self.embedding_dim = args.integer(*who, "embedding_dim", embedding_dim, 1)
        self.std = args.real(*who, "std", std, 0.0, lo_open=True)

    def check_input_dtypes(self, in_dtypes):
        dt = np.dtype(in_dtypes[0])
        if dt == np.bool_ or not np.issubdtype(dt, np.integer):
            raise ValueError(f"indices must be integers (declare them with net.input(shape, dtype='int64')), "
                             f"got {dt.name}")

    def kernels(self):
        return ("embedding_forward", "embedding_backward")

    def infer_shape(self, in_shapes):
        return tuple(in_shapes[0]) + (self.embedding_dim,)

    def check_values(self, inputs):
        self.check_indices(inputs[0], f"{self.describe()}: indices")

    def check_batch_input(self, k, batch, where):
        self.check_indices(batch, where)

    def check_indices(self, idx: np.ndarray, where: str) -> None:
        """An index outside [0, num_embeddings) is a DataError (numpy would read -1 as the last row)."""
        if idx.size == 0:
            return
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.num_embeddings:
            raise DataError(f"{where}: index {lo if lo < 0 else hi} is outside [0, {self.num_embeddings}) "
                            f"(the embedding has {self.num_embeddings} rows)")

    def param_specs(self, in_shapes):
        return {"weight": ParamSpec((self.num_embeddings, self.embedding_dim), "normal",
                                    fan_in=self.num_embeddings, fan_out=self.embedding_dim, std=self.std)}

    def flops(self, in_shapes, out_shape):
        return 0  # a copy of rows

    def backward_flops(self, in_shapes, out_shape):
        return math.prod(out_shape)  # one addition per value scattered

    def config(self):
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim, "std": self.std}

    def backend_ops(self):
        return ("embedding_forward", "embedding_backward")

    def forward(self, be, inputs, out, params, ctx):
        be.embedding_forward(inputs[0].reshape(-1), params["weight"], out.reshape(-1, self.embedding_dim))

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        if "weight" in grads:
            be.embedding_backward(inputs[0].reshape(-1), dout.reshape(-1, self.embedding_dim), grads["weight"])


class PositionEmbedding(Layer):
    """(B, T, C) -> x + P[:T], GPT's `wpe`; `max_positions` >= T rows, initialized N(0, std^2)."""

    type_name = "pos_embedding"  # fits the summary's 13-character type column
    checkpoint = True  # an add: kept, like `Add`'s output

    def __init__(self, max_positions: int, std: float = 1.0, name: str | None = None):
        super().__init__(name)
        self.max_positions = args.integer(type(self).__name__, name, "max_positions", max_positions, 1)
        self.std = args.real(type(self).__name__, name, "std", std, 0.0, lo_open=True)

    def kernels(self):
        return ("position_embedding_forward", "position_embedding_backward")

    def infer_shape(self, in_shapes):
        s = in_shapes[0]
        if len(s) != 3:
            raise ValueError(f"expects a sequence (B, T, C), got shape {s}")
        if s[1] > self.max_positions:
            raise ValueError(f"the sequence has {s[1]} positions, more than max_positions={self.max_positions}")
        return s

    def param_specs(self, in_shapes):
        c = in_shapes[0][2]
        return {"weight": ParamSpec((self.max_positions, c), "normal", fan_in=self.max_positions, fan_out=c,
                                    std=self.std)}

    def flops(self, in_shapes, out_shape):
        return math.prod(out_shape)

    def config(self):
        return {"max_positions": self.max_positions, "std": self.std}

    def backend_ops(self):
        return ("position_embedding_forward", "position_embedding_backward")

    def forward(self, be, inputs, out, params, ctx):
        be.position_embedding_forward(inputs[0], params["weight"], out)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        be.position_embedding_backward(dout, dinputs[0], grads.get("weight"))
