"""benchmarks/half_step.py: the compiled step in fp32 and a half mode, alternating, written as JSON and the table
docs/performance.md includes."""
from __future__ import annotations

import json

from tests.benchmarks import bench_scripts

RESULTS = bench_scripts.BENCHMARKS / "results"


def test_a_small_run_writes_both_modes_and_its_table(tmp_path):
    hs = bench_scripts.load("half_step")
    record = hs.main(["--depth", "8", "--batch", "2", "--image-size", "8", "--steps", "2", "--warmup", "1",
                      "--out", "tiny"], results=tmp_path)
    assert json.loads((tmp_path / "tiny.json").read_text()) == json.loads(json.dumps(record))
    assert len(record["fp32_ms"]["steps"]) == len(record["bf16_ms"]["steps"]) == 2
    assert {"conv", "batchnorm", "add"} <= set(record["per_type_ms"])
    assert (tmp_path / "tiny.md").read_text() == hs.markdown(record)


def test_the_committed_table_is_the_scripts_rendering_of_its_json():
    hs = bench_scripts.load("half_step")
    record = json.loads((RESULTS / "half_step.json").read_text())
    assert (RESULTS / "half_step.md").read_text() == hs.markdown(record)
    assert record["steps"] >= 10 and record["shape"] == "resnet-56 batch 32 32px"
