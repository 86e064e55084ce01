"""benchmarks/half_accuracy.py: each mode trained from the same seeds, the summary the paired differences from
float32's runs, the goals judged on them."""
from __future__ import annotations

import json

import pytest

from tests.benchmarks import bench_scripts

RESULTS = bench_scripts.BENCHMARKS / "results"


def _bench():
    return bench_scripts.load("half_accuracy")


def test_one_small_run_per_mode_and_seed_summarized_against_float32(tmp_path):
    ha = _bench()
    path = tmp_path / "a.json"
    assert ha.main(["--seeds", "0", "--modes", "fp32", "bf16", "--resnet-steps", "3", "--gpt2-steps", "2",
                    "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    for task, field in (("resnet20", "accuracy"), ("gpt2", "loss")):
        runs, summary = result[task]["runs"], result[task]["summary"]
        assert [len(runs[m]) for m in ("fp32", "bf16")] == [1, 1]
        assert runs["bf16"][0]["loss"] != runs["fp32"][0]["loss"]   # the mode changes the arithmetic
        diffs = [b[field] - f[field] for b, f in zip(runs["bf16"], runs["fp32"])]
        assert summary["bf16"]["diff_vs_fp32"] == pytest.approx(diffs[0], abs=0) and summary["bf16"]["std"] == 0
        assert summary["fp32"]["diff_vs_fp32"] == 0
    assert path.with_suffix(".md").read_text() == ha.markdown(result) + "\n"


def test_the_committed_results_are_the_scripts_over_several_seeds():
    ha = _bench()
    result = json.loads((RESULTS / "half_accuracy.json").read_text())
    assert len(result["seeds"]) >= 3
    for task in ("resnet20", "gpt2"):
        assert set(result[task]["runs"]) == set(ha.MODES)
        assert all(len(r) == len(result["seeds"]) for r in result[task]["runs"].values())
    assert (RESULTS / "half_accuracy.md").read_text() == ha.markdown(result) + "\n"
