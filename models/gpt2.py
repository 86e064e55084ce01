"""GPT-2 (Radford et al. 2019) as HuggingFace's `GPT2LMHeadModel`: pre-norm, tanh GELU, eps 1e-5, the head tied to
wte; small has 124,439,808 parameters. No dropout on attention probabilities (the attention layer has none).
"""
from __future__ import annotations

import minidl as dl
from minidl.layers import (
    GELU,
    IGNORE_INDEX,
    Add,
    CausalSelfAttention,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    PositionEmbedding,
    SoftmaxCrossEntropy,
)

from .common import check_positive, transformer_size

#: size -> (layers, heads, width)
GPT2_CONFIGS: dict[str, tuple[int, int, int]] = {
    "small": (12, 12, 768), "medium": (24, 16, 1024), "large": (36, 20, 1280), "xl": (48, 25, 1600)}
GPT2_VOCAB = 50257
GPT2_POSITIONS = 1024
def gpt2(size: str = "small", layers: int | None = None, heads: int | None = None, width: int | None = None,
         seq: int = GPT2_POSITIONS, batch: int = 8, vocab: int = GPT2_VOCAB, positions: int = GPT2_POSITIONS,
         dropout: float = 0.1, tied: bool = True, keep_scores: bool = True, dtype="float32") -> dl.Network:
    """GPT-2 of `size` on (batch, seq) tokens; `tied=False` gives the head a table of its own; `keep_scores=False`
    makes attention rebuild its scores in backward."""
    layers, heads, width = transformer_size("gpt2", GPT2_CONFIGS, size, layers, heads, width)
    check_positive("gpt2", seq=seq, batch=batch, vocab=vocab, positions=positions)
    net = dl.Network(f"gpt2_{size}" if (layers, heads, width) == GPT2_CONFIGS[size] else "gpt2", dtype=dtype)
    tokens = net.input((batch, seq), dtype="int64", name="tokens")
    targets = net.input((batch, seq), dtype="int64", name="targets")
    h = Embedding(vocab, width, std=0.02, name="wte")(tokens)
    h = PositionEmbedding(max(positions, seq), std=0.02, name="wpe")(h)
    h = Dropout(dropout, name="drop")(h)
    for i in range(layers):
        b = f"h{i}"
        a = LayerNorm(name=f"{b}.ln_1")(h)
        a = Linear(3 * width, flatten=False, name=f"{b}.attn.c_attn")(a)
        a = CausalSelfAttention(heads, keep_scores=keep_scores, name=f"{b}.attn")(a)
        a = Linear(width, flatten=False, name=f"{b}.attn.c_proj")(a)
        a = Dropout(dropout, name=f"{b}.attn.drop")(a)
        h = Add(name=f"{b}.add_1")(h, a)
        m = LayerNorm(name=f"{b}.ln_2")(h)
        m = Linear(4 * width, flatten=False, name=f"{b}.mlp.c_fc")(m)
        m = GELU("tanh", name=f"{b}.mlp.gelu")(m)
        m = Linear(width, flatten=False, name=f"{b}.mlp.c_proj")(m)
        m = Dropout(dropout, name=f"{b}.mlp.drop")(m)
        h = Add(name=f"{b}.add_2")(h, m)
    h = LayerNorm(name="ln_f")(h)
    logits = Linear(vocab, bias=False, flatten=False, name="lm_head")(h)
    net.set_loss(SoftmaxCrossEntropy(ignore_index=IGNORE_INDEX, name="loss")(logits, targets))
    if tied:
        net.tie("lm_head.weight", to="wte.weight")
    return net
