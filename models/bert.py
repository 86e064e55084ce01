"""BERT (Devlin et al. 2018) with its masked-language-model head, as HuggingFace's `BertForMaskedLM` builds it.

    tokens (B, T) -> word_embeddings (vocabulary x C) + position_embeddings -> LayerNorm -> dropout
      -> L encoder layers (post-norm): x = LN(x + dropout(out(attention(qkv(x))))),
                                       x = LN(x + dropout(output(gelu(intermediate(x)))))
      -> MLM head: LN(gelu(transform(x))) -> decoder (C -> vocabulary, its weight tied to word_embeddings, a bias
         of its own) -> per-token cross-entropy against targets (B, T), -100 where a token is not predicted

Sizes (layers, heads, width): base 12/12/768, large 24/16/1024, and Harmony's BERT-96: large with 96 layers;
30,522 tokens, 512 positions, intermediate 4 C, exact GELU, layer norm eps 1e-12, tables N(0, 0.02^2).

Parameters: every tensor of `BertForMaskedLM` but the token-type table (2 x C): these networks read one
segment per sequence (no second input), so base is 109,512,762 (HF 109,514,298), large 335,172,410 (HF
335,174,458; the released BERT-large without its pooler and NSP head). q, k and v are one (3 C) projection
here, the same parameters as BERT's three. The dropout BERT applies to attention probabilities is left out, as
in `gpt2`.
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

#: size -> (layers, heads, width); "96" is Harmony's BERT-96 (BERT-large, 96 layers).
BERT_CONFIGS: dict[str, tuple[int, int, int]] = {"base": (12, 12, 768), "large": (24, 16, 1024), "96": (96, 16, 1024)}
BERT_VOCAB = 30522
BERT_POSITIONS = 512
EPS = 1e-12


def bert(size: str = "base", layers: int | None = None, heads: int | None = None, width: int | None = None,
         seq: int = BERT_POSITIONS, batch: int = 8, vocab: int = BERT_VOCAB, positions: int = BERT_POSITIONS,
         dropout: float = 0.1, keep_scores: bool = True, dtype="float32") -> dl.Network:
    """BERT of `size` (see the module doc) with its masked-LM head, on batches of `batch` sequences of `seq` tokens:
    inputs "tokens" and "targets", (batch, seq) int64 (targets: the original token where it was masked, -100
    elsewhere). The position table has max(positions, seq) rows."""
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
