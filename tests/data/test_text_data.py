"""Byte-level text for language models: windows with next-token targets, the standard-library corpus, a user's
file, batching, held-out loss and perplexity, and `minidl train gpt2` on text from the command line."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

import minidl as dl
from minidl.cli import main
from minidl.data import BatchIterator, load_data
from minidl.data.text import SequenceDataset, perplexity, sequences, stdlib_corpus, text_file, unigram_loss
from minidl.models import gpt2
from minidl.optim import SGD
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
