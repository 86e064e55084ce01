"""benchmarks/memory_table.py: a sequence model's row (its tokens per sequence named), and `--merge`, which
re-measures some rows of the results file and keeps the others as they are."""
from __future__ import annotations

import json

from tests.benchmarks import bench_scripts


def _bench():
    return bench_scripts.load("memory_table")


def test_merge_replaces_the_rows_it_measures_and_keeps_the_others(tmp_path):
    mt = _bench()
    old = {"model": "vgg16", "batch": 32, "paged_chunk": 20 * 2**20, "none": 1, "liveness": 1, "recompute": 1,
           "auto_min": 1, "lower_bound": 1, "window_min": 1, "none_over_liveness": 1.0, "min_over_lb": 1.0,
           "arena_over_live": 1.0, "paged_arena_over_live": 1.0, "paged_arena_over_rounded": 1.0}
    stale = dict(old, model="lenet", batch=4)
    path, md = tmp_path / "t.json", tmp_path / "t.md"
    path.write_text(json.dumps([old, stale]))
    assert mt.main(["--models", "lenet", "gpt2", "--batch", "4", "--seq-batch", "2", "--seq", "16", "--merge",
                    "--json", str(path), "--md", str(md)]) == 0
    rows = json.loads(path.read_text())
    assert [(r["model"], r["batch"], r.get("seq")) for r in rows] == [("vgg16", 32, None), ("lenet", 4, None),
                                                                       ("gpt2", 2, 16)]
    assert rows[0] == old and rows[1]["none"] > 1 and rows[1]["date"] == rows[2]["date"]
    assert rows[2]["input"] == [2, 16] and rows[2]["none"] > rows[2]["liveness"] > 0
    text = md.read_text()
    assert "| gpt2 (16 tokens) | 2 |" in text and "| vgg16 | 32 |" in text
    assert "before the rows recorded their date" in text.splitlines()[0]


def test_a_half_precision_row_sits_beside_the_float32_one_and_says_its_mode_and_device(tmp_path):
    mt = _bench()
    path, md = tmp_path / "t.json", tmp_path / "t.md"
    for extra in ([], ["--merge", "--math", "bf16", "--device", "v100"], ["--merge", "--device", "v100"]):
        assert mt.main(["--models", "lenet", "--batch", "8", "--json", str(path), "--md", str(md), *extra]) == 0
    rows = json.loads(path.read_text())
    assert [(r.get("math"), r.get("device")) for r in rows] == [(None, None), ("bf16", "v100"), ("fp32", "v100")]
    fp32, bf16 = rows[2], rows[1]
    assert bf16["liveness"] < fp32["liveness"] and bf16["none"] < fp32["none"]
    text = md.read_text()
    assert "| lenet (bf16, v100) | 8 |" in text and "| lenet (fp32, v100) | 8 |" in text and "| lenet | 8 |" in text
    assert "planned for profile 'cpu'" in text.splitlines()[0]
