"""Text for language models: byte-level corpora cut into (input, next-token target) sequences.

* `stdlib_corpus` -- Python's own standard library sources: every machine that runs minidl has them, so a small
  GPT trains on real text with no download. The selection is deterministic (the top-level ``*.py`` files of the
  standard library directory, sorted by name, read until `max_bytes`); a different Python version has different
  files, so the corpus is a function of the interpreter, and its name says which.
* `text_file` -- a user's text file (``--data text:PATH``), read as bytes.

Tokens are bytes (a vocabulary of 256: no tokenizer to ship or to get wrong). A corpus of n tokens is cut into
(n - 1) // T windows of T tokens; a window's targets are its tokens shifted by one (the next token at every
position), so sample k is ``x = tokens[kT : kT + T]``, ``y = tokens[kT + 1 : kT + T + 1]``. The held-out part is
the corpus's last windows (a contiguous stretch: text is not exchangeable sample by sample as images are).
"""
from __future__ import annotations

import math
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..core.errors import DataError
from ..layers import args

__all__ = ["BYTE_VOCAB", "SequenceDataset", "perplexity", "sequences", "stdlib_corpus", "text_file", "unigram_loss"]

BYTE_VOCAB = 256


@dataclass(eq=False)
class SequenceDataset:
    """Windows of a token stream: inputs x and next-token targets y, both (N, T) int64, tokens in
    [0, num_classes). What `BatchIterator` batches and `Session.fit`/`Session.evaluate` take, like an image
    `Dataset`: `sample_shape` is (T,), a network's "tokens" input without its batch axis."""

    x: np.ndarray = field(repr=False)
    y: np.ndarray = field(repr=False)
    num_classes: int = BYTE_VOCAB
    name: str = "text"
    augment: None = None  # text is never augmented (BatchIterator asks)

    def __post_init__(self) -> None:
        x, y = np.asarray(self.x), np.asarray(self.y)
        if x.ndim != 2 or x.shape != y.shape:
            raise DataError(f"{self.name}: inputs and targets must both be (N, T), got {x.shape} and {y.shape}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise DataError(f"{self.name}: no sequences (shape {x.shape})")
        for what, a in (("inputs", x), ("targets", y)):
            if not np.issubdtype(a.dtype, np.integer) or a.min() < 0 or a.max() >= self.num_classes:
                raise DataError(f"{self.name}: {what} must be integers in [0, {self.num_classes})")
        self.x = np.ascontiguousarray(x, np.int64)
        self.y = np.ascontiguousarray(y, np.int64)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return (int(self.x.shape[1]),)

    @property
    def seq(self) -> int:
        return int(self.x.shape[1])

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __repr__(self) -> str:
        return f"SequenceDataset(name={self.name!r}, sequences={len(self)}, seq={self.seq}, vocab={self.num_classes})"


def sequences(tokens: np.ndarray, seq: int, heldout_fraction: float = 0.1, name: str = "text",
              num_classes: int = BYTE_VOCAB) -> tuple[SequenceDataset, SequenceDataset]:
    """(train, held-out) windows of `seq` tokens (see the module doc); the held-out part is the last
    `heldout_fraction` of the windows (at least one). A DataError if the text is too short for two windows."""
    seq = args.integer("sequences", name, "seq", seq, 1)
    tokens = np.asarray(tokens).reshape(-1)
    n = (len(tokens) - 1) // seq
    if n < 2:
        raise DataError(f"{name}: {len(tokens):,} tokens make {n} sequence(s) of {seq} tokens (with the next token "
                        f"as target); at least 2 are needed (one to train on, one held out): use more text or a "
                        f"shorter --seq")
    held = min(n - 1, max(1, round(n * heldout_fraction)))
    x = tokens[:n * seq].reshape(n, seq)
    y = tokens[1:n * seq + 1].reshape(n, seq)
    cut = n - held
    return (SequenceDataset(x[:cut], y[:cut], num_classes, f"{name}/train"),
            SequenceDataset(x[cut:], y[cut:], num_classes, f"{name}/heldout"))


def stdlib_corpus(max_bytes: int = 2_000_000) -> tuple[np.ndarray, str]:
    """(bytes of Python's standard library sources as uint8 tokens, the corpus's name): the top-level ``*.py``
    files of the standard library directory, sorted by name, whole files until `max_bytes` is reached."""
    max_bytes = args.integer("stdlib_corpus", None, "max_bytes", max_bytes, 1)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise DataError(f"the Python standard library's sources are not at {root} (no *.py files there): pass "
                        f"--data text:PATH with a text file of your own")
    parts, total = [], 0
    for p in files:
        data = p.read_bytes()
        parts.append(data[:max_bytes - total])
        total += len(parts[-1])
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(parts), np.uint8), f"python{sys.version_info[0]}.{sys.version_info[1]}-stdlib"


def text_file(path: str | os.PathLike) -> np.ndarray:
    """The bytes of the text file at `path` as uint8 tokens (a DataError naming the path if it cannot be read)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"--data text:{path}: no such file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise DataError(f"--data text:{path}: cannot read it ({e.strerror})") from None
    return np.frombuffer(data, np.uint8)


def perplexity(loss: float) -> float:
    """exp(mean per-token cross-entropy in nats): the number of equally likely tokens the model's uncertainty is
    worth (256 for a uniform guess over bytes)."""
    return math.exp(loss) if loss < 700 else math.inf


def unigram_loss(train: SequenceDataset, heldout: SequenceDataset) -> float:
    """The held-out loss of the best model that ignores context: each byte's frequency in the training text
    (add-one smoothed), the baseline a language model must beat to have learned anything from context."""
    counts = np.bincount(train.y.reshape(-1), minlength=train.num_classes).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout.y.reshape(-1)].mean())
