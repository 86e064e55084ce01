"""BERT (Devlin et al. 2018) with its masked-LM head, as HuggingFace's `BertForMaskedLM` (post-norm, exact GELU,
eps 1e-12, the decoder tied to word_embeddings with a bias of its own). Every tensor of it but the token-type table
(one segment per sequence): base 109,512,762 parameters (HF 109,514,298). q, k, v are one (3 C) projection; no
dropout on attention probabilities.
"""
from __future__ import annotations

import minidl as dl
from minidl.layers import (
    GELU,
    IGNORE_INDEX,
    Add,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    PositionEmbedding,
    SelfAttention,
    SoftmaxCrossEntropy,
)

from .common import check_positive, transformer_size

#: size -> (layers, heads, width); "96" is Harmony's BERT-96
BERT_CONFIGS: dict[str, tuple[int, int, int]] = {"base": (12, 12, 768), "large": (24, 16, 1024), "96": (96, 16, 1024)}
BERT_VOCAB = 30522
BERT_POSITIONS = 512
EPS = 1e-12


def bert(size: str = "base", layers: int | None = None, heads: int | None = None, width: int | None = None,
         seq: int = BERT_POSITIONS, batch: int = 8, vocab: int = BERT_VOCAB, positions: int = BERT_POSITIONS,
         dropout: float = 0.1, keep_scores: bool = True, dtype="float32") -> dl.Network:
    """BERT of `size` on (batch, seq) tokens; targets: the original token where masked, -100 elsewhere."""
    layers, heads, width = transformer_size("bert", BERT_CONFIGS, size, layers, heads, width)
    check_positive("bert", seq=seq, batch=batch, vocab=vocab, positions=positions)
    name = f"bert_{size}" if (layers, heads, width) == BERT_CONFIGS[size] else "bert"
    net = dl.Network(name.replace("bert_96", "bert96"), dtype=dtype)
    tokens = net.input((batch, seq), dtype="int64", name="tokens")
    targets = net.input((batch, seq), dtype="int64", name="targets")
    h = Embedding(vocab, width, std=0.02, name="word_embeddings")(tokens)
    h = PositionEmbedding(max(positions, seq), std=0.02, name="position_embeddings")(h)
    h = LayerNorm(EPS, name="embeddings.ln")(h)
    h = Dropout(dropout, name="embeddings.drop")(h)
    for i in range(layers):
        b = f"layer{i}"
        a = Linear(3 * width, flatten=False, name=f"{b}.attention.qkv")(h)
        a = SelfAttention(heads, keep_scores=keep_scores, name=f"{b}.attention")(a)
        a = Linear(width, flatten=False, name=f"{b}.attention.out")(a)
        a = Dropout(dropout, name=f"{b}.attention.drop")(a)
        h = LayerNorm(EPS, name=f"{b}.attention.ln")(Add(name=f"{b}.attention.add")(h, a))
        m = Linear(4 * width, flatten=False, name=f"{b}.intermediate")(h)
        m = GELU("none", name=f"{b}.gelu")(m)
        m = Linear(width, flatten=False, name=f"{b}.output")(m)
        m = Dropout(dropout, name=f"{b}.output.drop")(m)
        h = LayerNorm(EPS, name=f"{b}.output.ln")(Add(name=f"{b}.output.add")(h, m))
    h = Linear(width, flatten=False, name="mlm.transform")(h)
    h = GELU("none", name="mlm.gelu")(h)
    h = LayerNorm(EPS, name="mlm.ln")(h)
    logits = Linear(vocab, flatten=False, name="mlm.decoder")(h)
    net.set_loss(SoftmaxCrossEntropy(ignore_index=IGNORE_INDEX, name="loss")(logits, targets))
    net.tie("mlm.decoder.weight", to="word_embeddings.weight")
    return net
