"""Text for language models: byte-level corpora cut into sequences, with a next-token or a masked-token objective.

* `stdlib_corpus` -- Python's own standard library sources: every machine that runs minidl has them, so a small
  GPT trains on real text with no download. The selection is deterministic (the top-level ``*.py`` files of the
  standard library directory, sorted by name, read until `max_bytes`); a different Python version has different
  files, so the corpus is a function of the interpreter, and its name says which.
* `text_file` -- a user's text file (``--data text:PATH``), read as bytes.

Tokens are bytes (a vocabulary of 256: no tokenizer to ship or to get wrong). A corpus of n tokens is cut into
(n - 1) // T windows of T tokens, sample k is ``x = tokens[kT : kT + T]``; the held-out part is the corpus's last
windows (a contiguous stretch: text is not exchangeable sample by sample as images are). The targets depend on
the objective (`OBJECTIVES`), which the model's kind decides (gpt2 next-token, bert masked):

* next-token (GPT-2): ``y = tokens[kT + 1 : kT + T + 1]``, the next token at every position.
* masked (BERT; `Masking`, the rule of BERT and HuggingFace's DataCollatorForLanguageModeling): each position is
  chosen with probability 0.15 (one at random if none was: every sequence has a target); of the chosen, 80% become
  [MASK] (id 256, so the vocabulary is 257), 10% a random byte, 10% stay. The targets are the original tokens at
  the chosen positions and `IGNORE_INDEX` elsewhere. Training masks are drawn per batch from the batch's place in
  the data order (`BatchIterator`, as augmentation is): fresh every epoch, the same after a resume. Held-out masks
  are drawn once, from a fixed key whatever the seed, so evaluations compare across steps and runs.
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
# The generator key of every held-out set's masks, whatever the run's seed: four numbers, so that no training batch's
# key (seed, epoch, offset) draws the same (numpy's seeding reads missing trailing numbers as zeros).
HELDOUT_MASK_KEY = (0, 0, 0, 1)


def text_vocab(objective: str) -> int:
    """The vocabulary a network trained on byte-level text with `objective` needs: 256 bytes, plus [MASK] (id 256)
    for the masked objective."""
    _check_objective(objective)
    return BYTE_VOCAB + (objective == MASKED)


def _check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise DataError(f"unknown objective {objective!r}; one of {', '.join(OBJECTIVES)}")


@dataclass(frozen=True, slots=True)
class Masking:
    """BERT's masked-language-model rule (the module doc) over `tokens` real tokens [0, tokens): [MASK] is id
    `tokens`, random replacements are real tokens, never [MASK]. `rate`: the share of positions chosen."""

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
        """The vocabulary of the masked inputs: the real tokens and [MASK]."""
        return self.tokens + 1

    def apply(self, x: np.ndarray, y: np.ndarray, key: tuple[int, ...]) -> None:
        """Mask the batch `x` (B, T) of original tokens in place and write its targets into `y` (the original token
        where chosen, `IGNORE_INDEX` elsewhere); every choice is drawn from `key` alone (a pure function of it)."""
        if x.size == 0:
            return
        rng = np.random.default_rng(key)
        b, t = x.shape
        chosen = rng.random((b, t)) < self.rate
        fallback = rng.integers(0, t, b)  # drawn for every sequence, so the draws after it do not depend on `chosen`
        none = np.flatnonzero(~chosen.any(axis=1))
        chosen[none, fallback[none]] = True
        how = rng.random((b, t))
        replacements = rng.integers(0, self.tokens, (b, t))
        y[...] = np.where(chosen, x, IGNORE_INDEX)
        x[chosen & (how < 0.8)] = self.mask_token
        swap = chosen & (how >= 0.8) & (how < 0.9)
        x[swap] = replacements[swap]

    def fixed(self, data: SequenceDataset, name: str | None = None) -> SequenceDataset:
        """`data`'s sequences with masks drawn once, from `HELDOUT_MASK_KEY`: a held-out set (no `masking` of its
        own), the same masks for every run and every evaluation."""
        x, y = data.x.copy(), np.empty_like(data.x)
        self.apply(x, y, HELDOUT_MASK_KEY)
        return SequenceDataset(x, y, self.vocab, name or data.name)


@dataclass(eq=False)
class SequenceDataset:
    """Windows of a token stream: inputs x and targets y, both (N, T) int64, tokens in [0, num_classes), targets
    also `IGNORE_INDEX` (not predicted). What `BatchIterator` batches and `Session.fit`/`Session.evaluate` take,
    like an image `Dataset`: `sample_shape` is (T,). With `masking` (a masked training set) y equals x, and each
    batch is masked as it is drawn; `num_classes` is then `masking.vocab`."""

    x: np.ndarray = field(repr=False)
    y: np.ndarray = field(repr=False)
    num_classes: int = BYTE_VOCAB
    name: str = "text"
    masking: Masking | None = None
    augment: None = None  # text is never augmented (BatchIterator asks)
    transform: None = None  # nor transformed: tokens are read as they are (a checkpoint asks)
    source: str | None = None  # the --data value it was loaded from (set by load_data)

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
    """(train, held-out) windows of `seq` tokens with the targets of `objective` (see the module doc); the held-out
    part is the last `heldout_fraction` of the windows (at least one). A DataError if the text is too short for two
    windows. `num_classes`: the tokens' vocabulary (the masked objective's is one more: [MASK])."""
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
    """exp(mean per-token cross-entropy in nats): the number of equally likely tokens the model's uncertainty is
    worth (256 for a uniform guess over bytes)."""
    return math.exp(loss) if loss < 700 else math.inf


def unigram_loss(train: SequenceDataset, heldout: SequenceDataset) -> float:
    """The held-out loss of the best model that ignores context: each token's frequency in the training text
    (add-one smoothed, over the real tokens: never [MASK]) at every held-out target (the masked positions of a
    masked set), the baseline a language model must beat to have learned anything from context."""
    tokens = train.masking.tokens if train.masking is not None else train.num_classes
    seen = train.y.reshape(-1)
    counts = np.bincount(seen[seen != IGNORE_INDEX], minlength=tokens).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    y = heldout.y.reshape(-1)
    return float(-logp[y[y != IGNORE_INDEX]].mean())
