"""Multi-head scaled dot-product self-attention, causal (GPT's) or not (BERT's).

Input (B, T, 3C): q, k, v side by side (nanoGPT's `c_attn`); head h uses channels [h D, (h + 1) D). Backward reads
the input and P = softmax(q k^T / sqrt(D)) (B, H, T, T), a planned, rebuildable aux (`probs`): a plan, or
`keep_scores=False`, may drop it, and backward then rebuilds P per sample from q and k (FlashAttention's trade) with
the same bits, so the gradients are the same. A layer built with `keep_scores=False` keeps them in no plan: the
backend may then run a fused attention that never forms P (cuDNN's SDPA in a half mode on CUDA), the same in every
plan, so a memory policy never changes which attention runs.
"""
from __future__ import annotations

import math

from . import args
from .base import Layer


class SelfAttention(Layer):
    """Bidirectional self-attention (BERT's); `causal=True` masks the keys after each query."""

    type_name = "attention"
    needs_inputs = (0,)
    checkpoint = True  # two batched products per head: expensive to rebuild, like a linear's output
    half_aux = ("probs",)
    rebuildable_aux = ("probs",)

    def __init__(self, num_heads: int, keep_scores: bool = True, causal: bool = False, name: str | None = None):
        super().__init__(name)
        self.num_heads = args.integer(type(self).__name__, name, "num_heads", num_heads, 1)
        self.keep_scores = args.flag(type(self).__name__, name, "keep_scores", keep_scores)
        self.causal = args.flag(type(self).__name__, name, "causal", causal)

    def kernels(self):
        return ("attention_forward", "attention_backward")

    def infer_shape(self, in_shapes):
        s = in_shapes[0]
        if len(s) != 3:
            raise ValueError(f"expects q, k, v side by side as (B, T, 3C), got shape {s}")
        if s[2] % (3 * self.num_heads):
            raise ValueError(f"the last axis ({s[2]}) must be 3 C with C a multiple of num_heads="
                             f"{self.num_heads} (q, k, v of C = {s[2] / 3:g} channels each)")
        return (s[0], s[1], s[2] // 3)

    def aux_specs(self, in_shapes, training=True):
        b, t, _ = in_shapes[0]
        return {"probs": (b, self.num_heads, t, t)} if training and self.keep_scores else {}

    def flops(self, in_shapes, out_shape):
        b, t, c = out_shape
        return 4 * b * t * t * c + 5 * b * self.num_heads * t * t  # q k^T and P v; scale, mask, softmax

    def backward_flops(self, in_shapes, out_shape):
        b, t, c = out_shape
        rebuild = 0 if self.keep_scores else self.flops(in_shapes, out_shape) - 2 * b * t * t * c  # q k^T, softmax
        return 8 * b * t * t * c + 4 * b * self.num_heads * t * t + rebuild  # dv, dP, dq, dk; softmax's backward

    def config(self):
        return {"num_heads": self.num_heads, "keep_scores": self.keep_scores, "causal": self.causal}

    def backend_ops(self):
        return ("attention_forward", "attention_backward")

    def _heads(self, a, c: int):
        """(B, T, H*D) -> its (B, H, T, D) view (no copy)."""
        b, t = a.shape[:2]
        return a.reshape(b, t, self.num_heads, c // self.num_heads).transpose(0, 2, 1, 3)

    def _qkv(self, a):
        c = a.shape[2] // 3
        return [self._heads(a[:, :, i * c:(i + 1) * c], c) for i in range(3)]

    def forward(self, be, inputs, out, params, ctx):
        q, k, v = self._qkv(inputs[0])
        c = out.shape[2]
        be.attention_forward(q, k, v, ctx.aux.get("probs"), self._heads(out, c),
                             1.0 / math.sqrt(c // self.num_heads), self.causal, fused=not self.keep_scores)

    def backward(self, be, inputs, out, dout, dinputs, grads, params, ctx):
        q, k, v = self._qkv(inputs[0])
        dq, dk, dv = self._qkv(dinputs[0])
        c = dout.shape[2]
        be.attention_backward(q, k, v, ctx.aux.get("probs"), self._heads(dout, c), dq, dk, dv,
                              1.0 / math.sqrt(c // self.num_heads), self.causal, fused=not self.keep_scores)


class CausalSelfAttention(SelfAttention):
    """GPT's attention: each position attends to itself and the positions before it."""

    def __init__(self, num_heads: int, keep_scores: bool = True, name: str | None = None):
        super().__init__(num_heads, keep_scores, causal=True, name=name)

    def config(self):
        return {"num_heads": self.num_heads, "keep_scores": self.keep_scores}
