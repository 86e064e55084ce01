"""Byte-level text for language models: windows with next-token targets, BERT's masked tokens, the standard-library
corpus, a user's file, batching, held-out loss and perplexity, and `minidl train gpt2` / `bert` on text from the
command line."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

import minidl as dl
from minidl.cli import main
from minidl.data import BatchIterator, load_data
from minidl.data.text import (
    Masking,
    SequenceDataset,
    perplexity,
    sequences,
    stdlib_corpus,
    text_file,
    text_vocab,
    unigram_loss,
)
from minidl.layers import IGNORE_INDEX
from minidl.models import bert, gpt2
from minidl.optim import SGD
from minidl.runtime.checkpoint import load_checkpoint
from minidl.runtime.session import Session


def structured_text(n_words: int = 4000, seed: int = 0) -> str:
    """Words from a small vocabulary, each followed by a likely successor: text a model can learn from context."""
    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over a lazy dog and then runs away from the red barn".split()
    out = [words[0]]
    for _ in range(n_words):
        i = words.index(out[-1])
        out.append(words[(i + 1) % len(words)] if rng.random() < 0.7 else words[rng.integers(len(words))])
    return " ".join(out)


def test_windows_have_next_token_targets_and_a_contiguous_held_out_tail():
    tokens = np.arange(103) % 256
    train, held = sequences(tokens, 10, heldout_fraction=0.2)
    assert (len(train), len(held)) == (8, 2) and train.sample_shape == (10,)
    np.testing.assert_array_equal(train.x[1], np.arange(10, 20))
    np.testing.assert_array_equal(train.y[1], np.arange(11, 21))
    np.testing.assert_array_equal(held.x[0], np.arange(80, 90))
    assert train.x.dtype == held.y.dtype == np.int64
    with pytest.raises(dl.DataError, match=r"short: 20 tokens make 1 sequence\(s\) of 10 tokens"):
        sequences(np.zeros(20, np.uint8), 10, name="short")


def test_the_stdlib_corpus_is_deterministic_and_bounded():
    a, name = stdlib_corpus(50_000)
    b, _ = stdlib_corpus(50_000)
    assert len(a) == 50_000 and np.array_equal(a, b) and name.endswith("-stdlib")
    assert b"import" in a.tobytes()


def test_a_text_file_and_load_data(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text(structured_text(500))
    np.testing.assert_array_equal(text_file(p), np.frombuffer(p.read_bytes(), np.uint8))
    train, held = load_data(f"text:{p}", seq=16)
    assert isinstance(train, SequenceDataset) and train.seq == 16 and held.num_classes == 256
    with pytest.raises(dl.DataError, match=r"text:.*nope.txt: no such file"):
        load_data(f"text:{tmp_path / 'nope.txt'}")
    with pytest.raises(dl.DataError, match="text is not augmented"):
        load_data(f"text:{p}", augment=dl.data.parse_augment("flip"))


def test_sequences_batch_like_images():
    train, _ = sequences(np.arange(1000) % 256, 8)
    it = BatchIterator(train, 4, seed=1)
    x, y = it.next_batch()
    assert x.shape == y.shape == (4, 8) and np.array_equal(y[:, :-1], x[:, 1:])
    xo, yo = np.empty((4, 8), np.int64), np.empty((4, 8), np.int64)
    it.reset()
    it.next_into(xo, yo)
    assert np.array_equal(xo, x) and np.array_equal(yo, y)
    with pytest.raises(dl.DataError, match=r"x_out must be int64 \(4, 8\)"):
        it.next_into(np.empty((4, 8), np.float32), yo)


def test_evaluate_gives_the_mean_over_every_token_and_perplexity():
    """Held-out loss over every token, the last partial batch included (7 sequences, batch 3): the mean of the
    per-sequence losses the executor computes one full batch at a time."""
    train, held = sequences(np.frombuffer(structured_text(300).encode(), np.uint8), 12, heldout_fraction=0.3)
    held = SequenceDataset(held.x[:7], held.y[:7], name="held")
    net = gpt2(layers=1, heads=2, width=16, seq=12, batch=3, vocab=256, dropout=0.0)
    sess = Session(net, SGD(lr=0.1), policy="liveness", seed=0)
    loss, acc = sess.evaluate(held)
    per_seq = [sess.executor.evaluate(np.repeat(held.x[i:i + 1], 3, 0), np.repeat(held.y[i:i + 1], 3, 0))[0]
               for i in range(7)]
    np.testing.assert_allclose(loss, np.mean(per_seq), rtol=1e-5)
    assert 0 <= acc <= 1 and perplexity(loss) == pytest.approx(math.exp(loss))
    assert abs(loss - math.log(256)) < 0.5  # an untrained model guesses about uniformly


def test_minidl_train_gpt2_on_a_text_file_beats_the_unigram_baseline(tmp_path, capsys):
    p = tmp_path / "corpus.txt"
    p.write_text(structured_text())
    assert main(["train", "gpt2", "--layers", "2", "--width", "32", "--heads", "2", "--seq", "32", "--batch", "8",
                 "--steps", "150", "--optimizer", "adam", "--lr", "0.003", "--data", f"text:{p}", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["data"] == f"text:{p}" and r["steps_done"] == 150
    assert r["final_loss"] < math.log(256) - 1.0
    assert r["heldout_loss"] < r["unigram_loss"] and r["perplexity"] == pytest.approx(math.exp(r["heldout_loss"]))


def test_minidl_evaluate_a_language_model_checkpoint(tmp_path, capsys):
    """evaluate reads the sequence length from the checkpoint and gives the loss train reported at its end."""
    p = tmp_path / "corpus.txt"
    p.write_text(structured_text(800))
    ck = tmp_path / "lm.npz"
    net = ["gpt2", "--layers", "1", "--width", "16", "--heads", "2"]
    assert main(["train", *net, "--seq", "16", "--batch", "4", "--steps", "3", "--data", f"text:{p}",
                 "--save", str(ck), "--json"]) == 0
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["evaluate", *net, "--checkpoint", str(ck), "--data", f"text:{p}", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["loss"] == pytest.approx(trained["heldout_loss"], rel=1e-6)
    assert r["perplexity"] == pytest.approx(trained["perplexity"], rel=1e-6)


def test_minidl_train_a_sequence_model_defaults_to_the_stdlib_corpus_and_refuses_images(capsys):
    assert main(["train", "gpt2", "--layers", "1", "--width", "16", "--heads", "2", "--seq", "128", "--batch", "32",
                 "--steps", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["data"] == "stdlib" and "perplexity" in r
    assert main(["train", "gpt2", "--layers", "1", "--data", "digits"]) == 2
    assert "reads token sequences; give --data stdlib" in capsys.readouterr().err


def test_the_unigram_baseline_is_the_context_free_loss():
    train, held = sequences(np.frombuffer(b"ab" * 50_000, np.uint8), 10)
    assert unigram_loss(train, held) == pytest.approx(math.log(2), abs=0.01)


# -- BERT's masked tokens ----------------------------------------------------------------------------------------
def _within(share: float, p: float, n: int, sigmas: float = 5.0) -> bool:
    """`share` of `n` Bernoulli(p) draws is within `sigmas` standard deviations of p."""
    return abs(share - p) <= sigmas * math.sqrt(p * (1 - p) / n)


def test_the_masking_rule_chooses_15_percent_and_splits_them_80_10_10():
    original = np.random.default_rng(0).integers(0, 256, (4000, 64))
    x, y = original.copy(), np.empty_like(original)
    Masking().apply(x, y, (3, 0, 0))
    chosen = y != IGNORE_INDEX
    assert _within(chosen.mean(), 0.15, chosen.size)
    np.testing.assert_array_equal(y[chosen], original[chosen])        # targets: the original token where chosen
    np.testing.assert_array_equal(x[~chosen], original[~chosen])      # the rest unchanged, and not predicted
    n = int(chosen.sum())
    masked, kept = x[chosen] == 256, x[chosen] == original[chosen]
    assert _within(masked.mean(), 0.8, n)
    assert _within(kept.mean(), 0.1 + 0.1 / 256, n)                  # kept, or replaced by itself
    assert _within((~masked & ~kept).mean(), 0.1 - 0.1 / 256, n)
    assert x.max() <= 256 and not (x[~chosen] == 256).any()


def test_random_replacements_are_real_tokens_never_mask():
    """Two real tokens, every position chosen: a random replacement is 0 or 1 (5% each); were [MASK] (2) among
    them, more than 80% would read 2."""
    x, y = np.zeros((2000, 50), np.int64), np.empty((2000, 50), np.int64)
    Masking(tokens=2, rate=1.0).apply(x, y, (0,))
    assert (y == 0).all() and x.max() == 2
    assert _within((x == 2).mean(), 0.8, x.size) and _within((x == 1).mean(), 0.05, x.size)


def test_every_sequence_has_a_masked_token_and_the_masks_are_the_keys():
    x0 = np.random.default_rng(1).integers(0, 256, (3000, 4))   # 0.85^4: half of them would choose nothing
    x, y = x0.copy(), np.empty_like(x0)
    Masking().apply(x, y, (0, 0, 0))
    assert ((y != IGNORE_INDEX).sum(axis=1) >= 1).all()
    again, y2 = x0.copy(), np.empty_like(x0)
    Masking().apply(again, y2, (0, 0, 0))
    assert np.array_equal(again, x) and np.array_equal(y2, y)    # a pure function of the key
    other, y3 = x0.copy(), np.empty_like(x0)
    Masking().apply(other, y3, (0, 1, 0))
    assert not np.array_equal(y3, y)


def test_masked_sequences_mask_each_batch_by_its_place_and_the_held_out_part_once(tmp_path):
    tokens = np.frombuffer(structured_text(2000).encode(), np.uint8)
    train, held = sequences(tokens, 16, objective="masked")
    assert train.num_classes == held.num_classes == text_vocab("masked") == 257
    assert train.masking == Masking(256) and held.masking is None and np.array_equal(train.y, train.x)
    plain, plain_held = sequences(tokens, 16)   # the same windows as next-token's
    np.testing.assert_array_equal(train.x, plain.x)
    chosen = held.y != IGNORE_INDEX
    assert _within(chosen.mean(), 0.15, chosen.size) and (chosen.sum(axis=1) >= 1).all()
    np.testing.assert_array_equal(held.y[chosen], plain_held.x[chosen])
    assert (held.x == 256).any() and np.array_equal(held.x[~chosen], plain_held.x[~chosen])
    again = sequences(tokens, 16, objective="masked")[1]          # fixed: the same masks every time ...
    assert np.array_equal(again.x, held.x) and np.array_equal(again.y, held.y)
    p = tmp_path / "t.txt"
    p.write_bytes(tokens.tobytes())
    for seed in (0, 7):                                            # ... whatever the run's seed
        h = load_data(f"text:{p}", seed=seed, seq=16, objective="masked")[1]
        assert np.array_equal(h.x, held.x) and np.array_equal(h.y, held.y)

    it = BatchIterator(train, len(train), seed=2, shuffle=False)   # one batch an epoch, in order: every sequence
    (x1, y1), (x2, y2) = it.next_batch(), it.next_batch()
    assert (y1 != IGNORE_INDEX).any() and not np.array_equal(y1, y2) and not np.array_equal(x1, x2)  # fresh masks
    it = BatchIterator(train, 8, seed=2)
    batches = [it.next_batch() for _ in range(5)]
    for x, y in batches:
        picked = y != IGNORE_INDEX
        assert (picked.sum(axis=1) >= 1).all() and (x[~picked] < 256).all()
    walked = BatchIterator(train, 8, seed=2)
    for _ in range(3):
        walked.next_batch()
    resumed = BatchIterator(train, 8, seed=2)
    resumed.seek(walked.position())                                # a resume draws the masks the run would have
    x, y = resumed.next_batch()
    assert np.array_equal(x, batches[3][0]) and np.array_equal(y, batches[3][1])
    xo, yo = np.empty((8, 16), np.int64), np.empty((8, 16), np.int64)
    BatchIterator(train, 8, seed=2).next_into(xo, yo)
    assert np.array_equal(xo, batches[0][0]) and np.array_equal(yo, batches[0][1])


def test_next_token_data_is_what_it_was():
    """GPT-2's windows and targets do not depend on the masked objective's existence: the default objective is
    next-token, y is x shifted by one, no masking, a vocabulary of 256."""
    tokens = np.frombuffer(structured_text(500).encode(), np.uint8)
    train, held = sequences(tokens, 12)
    for part, x0 in ((train, 0), (held, len(train) * 12)):
        assert part.masking is None and part.num_classes == 256 == text_vocab("next-token")
        np.testing.assert_array_equal(part.x.reshape(-1), tokens[x0:x0 + part.x.size])
        np.testing.assert_array_equal(part.y.reshape(-1), tokens[x0 + 1:x0 + 1 + part.y.size])
    x, y = BatchIterator(train, 4, seed=0).next_batch()
    assert np.array_equal(y[:, :-1], x[:, 1:]) and (y >= 0).all()
    with pytest.raises(dl.DataError, match="unknown objective 'causal'"):
        sequences(tokens, 12, objective="causal")


def test_evaluate_averages_over_the_masked_tokens_alone():
    """A held-out set with masked targets: the loss is the mean over its masked tokens (the per-sequence means of
    the executor's loss, weighted by their counts), the accuracy the share of them predicted."""
    x = np.frombuffer(structured_text(300).encode(), np.uint8)[:84].reshape(7, 12).astype(np.int64)
    y = np.where(np.random.default_rng(0).random(x.shape) < 0.3, x, IGNORE_INDEX)
    y[np.arange(7), np.arange(7)] = x[np.arange(7), np.arange(7)]   # at least one target a sequence
    held = SequenceDataset(x, y, 257, "held")
    net = bert(layers=1, heads=2, width=16, seq=12, batch=3, vocab=257, dropout=0.0)
    sess = Session(net, SGD(lr=0.1), policy="liveness", seed=0)
    loss, acc = sess.evaluate(held)
    picked = held.y != IGNORE_INDEX
    counts = picked.sum(axis=1)
    runs = [sess.executor.evaluate(np.repeat(held.x[i:i + 1], 3, 0), np.repeat(held.y[i:i + 1], 3, 0))
            for i in range(7)]
    np.testing.assert_allclose(loss, np.dot([r[0] for r in runs], counts) / counts.sum(), rtol=1e-5)
    right = sum(int((np.asarray(r[1][0]).argmax(-1) == held.y[i])[picked[i]].sum()) for i, r in enumerate(runs))
    assert acc == right / counts.sum()
    train, _ = sequences(np.frombuffer(structured_text(300).encode(), np.uint8), 12, objective="masked")
    assert sess.evaluate(train) == sess.evaluate(train.masking.fixed(train))   # a masked training set: fixed masks


def _bert(p, *more):
    return ["train", "bert", "--layers", "1", "--heads", "2", "--width", "16", "--seq", "16", "--batch", "4",
            "--data", f"text:{p}", "--no-progress", *more]


def test_minidl_train_bert_on_text_trains_on_masked_tokens(tmp_path, capsys):
    from minidl.cli import build_parser
    from minidl.cli.train import _sequence_inputs

    p = tmp_path / "corpus.txt"
    p.write_text(structured_text(800))
    train, held, net = _sequence_inputs(build_parser().parse_args(_bert(p)))
    assert net.logits_node.shape[-1] == 257 and train.masking is not None
    x, y = BatchIterator(train, 4, seed=0).next_batch()
    picked = y != IGNORE_INDEX
    assert picked.any() and not picked.all() and (x[picked] == 256).any()   # masked inputs, masked targets
    assert main(_bert(p, "--steps", "2", "--json")) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["objective"] == "masked" and r["masked_tokens"] == int((held.y != IGNORE_INDEX).sum())
    assert {"perplexity", "accuracy", "heldout_loss"}.isdisjoint(r)
    assert abs(r["heldout_masked_token_loss"] - math.log(257)) < 0.5 and 0 <= r["heldout_masked_token_accuracy"] <= 1
    assert r["unigram_masked_token_loss"] < math.log(256)
    assert main(_bert(p, "--steps", "2")) == 0
    out = capsys.readouterr().out
    assert "held-out masked-token loss" in out and "masked-token accuracy" in out and "perplexity" not in out


def test_minidl_evaluate_a_bert_checkpoint_gives_the_masked_token_figures(tmp_path, capsys):
    p = tmp_path / "corpus.txt"
    p.write_text(structured_text(800))
    ck = tmp_path / "bert.npz"
    assert main(_bert(p, "--steps", "3", "--save", str(ck), "--json")) == 0
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    net = ["bert", "--layers", "1", "--heads", "2", "--width", "16"]
    assert main(["evaluate", *net, "--checkpoint", str(ck), "--data", f"text:{p}", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["objective"] == "masked" and r["masked_tokens"] == trained["masked_tokens"]
    assert r["masked_token_loss"] == pytest.approx(trained["heldout_masked_token_loss"], rel=1e-6)
    assert r["masked_token_accuracy"] == trained["heldout_masked_token_accuracy"]
    assert "perplexity" not in r and "loss" not in r
    assert main(["evaluate", *net, "--checkpoint", str(ck), "--data", f"text:{p}"]) == 0
    assert "held-out masked-token loss" in capsys.readouterr().out
    assert main(["predict", *net, "--checkpoint", str(ck), "--data", f"text:{p}"]) == 2
    assert "reads token sequences: minidl evaluate gives" in capsys.readouterr().err


def test_a_resumed_bert_run_draws_the_masks_of_the_straight_run(tmp_path, capsys):
    """4 steps straight == 2 steps, then 2 resumed, bit for bit (the batch size makes 2 steps an epoch: the resumed
    steps are in the second epoch, on masks drawn afresh)."""
    p = tmp_path / "corpus.txt"
    p.write_text(structured_text(120))
    n = len(sequences(np.frombuffer(p.read_bytes(), np.uint8), 16, objective="masked")[0])
    batch = str(n // 2)
    a, b, c = (tmp_path / f"{k}.npz" for k in "abc")
    opts = ["--batch", batch, "--optimizer", "adam", "--lr", "0.01", "--json"]
    runs = {}
    for name, more in (("straight", ["--steps", "4", "--save", str(a)]), ("first", ["--steps", "2", "--save", str(b)]),
                       ("resumed", ["--steps", "2", "--resume", str(b), "--save", str(c)])):
        assert main(_bert(p, *opts, *more)) == 0
        runs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["straight"]["objective"] == "masked"
    for k in ("final_loss", "heldout_masked_token_loss", "heldout_masked_token_accuracy"):
        assert runs["resumed"][k] == runs["straight"][k], k
    straight, resumed = load_checkpoint(a), load_checkpoint(c)
    for k, v in straight[0].items():
        assert np.array_equal(resumed[0][k], v), k
    for k, v in straight[1].items():
        assert np.array_equal(resumed[1][k], v), k
