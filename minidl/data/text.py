"""Text for language models: byte-level corpora cut into sequences, with a next-token or a masked-token objective.

Corpora: `stdlib_corpus` (Python's own sources: real text, no download; named by the interpreter version) and
`text_file`. Tokens are bytes (vocabulary 256, no tokenizer). Sample k is ``x = tokens[kT : kT + T]``; the held-out
part is the last windows (text is not exchangeable sample by sample). Objectives:
* next-token (GPT-2): ``y = tokens[kT + 1 : kT + T + 1]``.
* masked (BERT, as HuggingFace's DataCollatorForLanguageModeling): 15% of positions chosen (at least one), of them
  80% [MASK] (id 256), 10% a random byte, 10% kept; targets there, `IGNORE_INDEX` elsewhere. Training masks are
  drawn from the batch's place in the data order (fresh each epoch, the same after a resume); held-out masks once.
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
from ..layers import IGNORE_INDEX, args

__all__ = ["BYTE_VOCAB", "MASKED", "Masking", "NEXT_TOKEN", "OBJECTIVES", "SequenceDataset", "perplexity",
           "sequences", "stdlib_corpus", "text_file", "text_vocab", "unigram_loss"]

BYTE_VOCAB = 256
NEXT_TOKEN, MASKED = "next-token", "masked"
OBJECTIVES = (NEXT_TOKEN, MASKED)
# held-out masks' key, whatever the seed: four numbers, so no training key (seed, epoch, offset) equals it
HELDOUT_MASK_KEY = (0, 0, 0, 1)


def text_vocab(objective: str) -> int:
    """256 bytes, plus [MASK] for the masked objective."""
    _check_objective(objective)
    return BYTE_VOCAB + (objective == MASKED)


def _check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise DataError(f"unknown objective {objective!r}; one of {', '.join(OBJECTIVES)}")


@dataclass(frozen=True, slots=True)
class Masking:
    """BERT's masking rule (module doc) over real tokens [0, tokens); [MASK] is id `tokens`."""

    tokens: int = BYTE_VOCAB
    rate: float = 0.15

    def __post_init__(self) -> None:
        args.integer("Masking", None, "tokens", self.tokens, 1)
        if not 0.0 < self.rate <= 1.0:
            raise DataError(f"Masking: rate must be in (0, 1], got {self.rate}")

    @property
    def mask_token(self) -> int:
        return self.tokens

    @property
    def vocab(self) -> int:
        """Real tokens and [MASK]."""
        return self.tokens + 1

    def apply(self, x: np.ndarray, y: np.ndarray, key: tuple[int, ...]) -> None:
        """Mask `x` (B, T) in place and write its targets into `y`, every choice drawn from `key` alone."""
        if x.size == 0:
            return
        rng = np.random.default_rng(key)
        b, t = x.shape
        chosen = rng.random((b, t)) < self.rate
        fallback = rng.integers(0, t, b)  # drawn for all: later draws do not depend on `chosen`
        none = np.flatnonzero(~chosen.any(axis=1))
        chosen[none, fallback[none]] = True
        how = rng.random((b, t))
        replacements = rng.integers(0, self.tokens, (b, t))
        y[...] = np.where(chosen, x, IGNORE_INDEX)
        x[chosen & (how < 0.8)] = self.mask_token
        swap = chosen & (how >= 0.8) & (how < 0.9)
        x[swap] = replacements[swap]

    def fixed(self, data: SequenceDataset, name: str | None = None) -> SequenceDataset:
        """`data` masked once from `HELDOUT_MASK_KEY`: a held-out set, the same for every run."""
        x, y = data.x.copy(), np.empty_like(data.x)
        self.apply(x, y, HELDOUT_MASK_KEY)
        return SequenceDataset(x, y, self.vocab, name or data.name)


@dataclass(eq=False)
class SequenceDataset:
    """Inputs and targets (N, T) int64 (targets may be `IGNORE_INDEX`), batched like an image `Dataset`. With
    `masking`, y equals x and each batch is masked as it is drawn."""

    x: np.ndarray = field(repr=False)
    y: np.ndarray = field(repr=False)
    num_classes: int = BYTE_VOCAB
    name: str = "text"
    masking: Masking | None = None
    augment: None = None  # never: BatchIterator and checkpoints ask
    transform: None = None
    source: str | None = None  # the --data value

    def __post_init__(self) -> None:
        x, y = np.asarray(self.x), np.asarray(self.y)
        if x.ndim != 2 or x.shape != y.shape:
            raise DataError(f"{self.name}: inputs and targets must both be (N, T), got {x.shape} and {y.shape}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise DataError(f"{self.name}: no sequences (shape {x.shape})")
        for what, a in (("inputs", x), ("targets", y[y != IGNORE_INDEX])):
            if not np.issubdtype(a.dtype, np.integer) or (a.size and (a.min() < 0 or a.max() >= self.num_classes)):
                raise DataError(f"{self.name}: {what} must be integers in [0, {self.num_classes})"
                                + (f" (targets also {IGNORE_INDEX}: not predicted)" if what == "targets" else ""))
        if self.masking is not None:
            if not isinstance(self.masking, Masking) or self.masking.vocab != self.num_classes:
                raise DataError(f"{self.name}: masking must be a Masking of vocabulary {self.num_classes}, got "
                                f"{self.masking!r}")
            if not np.array_equal(x, y) or x.max() >= self.masking.tokens:
                raise DataError(f"{self.name}: a masked training set's targets are its inputs, tokens in "
                                f"[0, {self.masking.tokens}) ([MASK] is drawn per batch)")
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
              num_classes: int = BYTE_VOCAB, objective: str = NEXT_TOKEN) -> tuple[SequenceDataset, SequenceDataset]:
    """(train, held-out) windows of `seq` tokens; the held-out part is the last `heldout_fraction` (at least one)."""
    seq = args.integer("sequences", name, "seq", seq, 1)
    _check_objective(objective)
    tokens = np.asarray(tokens).reshape(-1)
    n = max(0, len(tokens) - 1) // seq
    if n < 2:
        raise DataError(f"{name}: {len(tokens):,} tokens make {n} sequence(s) of {seq} tokens (with the next token "
                        f"as target); at least 2 are needed (one to train on, one held out): use more text or a "
                        f"shorter --seq")
    held = min(n - 1, max(1, round(n * heldout_fraction)))
    x = tokens[:n * seq].reshape(n, seq)
    y = tokens[1:n * seq + 1].reshape(n, seq)
    cut = n - held
    if objective == MASKED:
        masking = Masking(num_classes)
        train = SequenceDataset(x[:cut], x[:cut], masking.vocab, f"{name}/train", masking)
        return train, masking.fixed(SequenceDataset(x[cut:], x[cut:], num_classes), f"{name}/heldout")
    return (SequenceDataset(x[:cut], y[:cut], num_classes, f"{name}/train"),
            SequenceDataset(x[cut:], y[cut:], num_classes, f"{name}/heldout"))


def stdlib_corpus(max_bytes: int = 2_000_000) -> tuple[np.ndarray, str]:
    """(uint8 tokens, name): the stdlib's top-level ``*.py`` files sorted by name, up to `max_bytes`."""
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
    """The file's bytes as uint8 tokens."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise DataError(f"--data text:{path}: a directory, not a text file")
    if not p.is_file():
        raise DataError(f"--data text:{path}: no such file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise DataError(f"--data text:{path}: cannot read it ({e.strerror})") from None
    return np.frombuffer(data, np.uint8)


def perplexity(loss: float) -> float:
    """exp(mean cross-entropy in nats): 256 for a uniform guess over bytes."""
    return math.exp(loss) if loss < 700 else math.inf


def unigram_loss(train: SequenceDataset, heldout: SequenceDataset) -> float:
    """Held-out loss of add-one-smoothed training token frequencies: the no-context baseline to beat."""
    tokens = train.masking.tokens if train.masking is not None else train.num_classes
    seen = train.y.reshape(-1)
    counts = np.bincount(seen[seen != IGNORE_INDEX], minlength=tokens).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    y = heldout.y.reshape(-1)
    return float(-logp[y[y != IGNORE_INDEX]].mean())
