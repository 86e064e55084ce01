"""benchmarks/gpu_profile.py without a GPU: its --fake mode runs every part (minidl's traced rows, PyTorch's
profiled ops, the merge, the fit, the record and its table) on the CPU into a folder of the test's, refuses to
write fake figures into benchmarks/results/, and docs/make_results.py renders such a record into
docs/performance.md (from a synthetic folder here: no fake figure is ever committed)."""
from __future__ import annotations

import json

import pytest

from tests.benchmarks import bench_scripts
from tests.docs.test_docs import _generator

pytest.importorskip("torch")

SMALL = ["--depth", "8", "--batch", "2", "--image-size", "8", "--steps", "1", "--warmup", "1"]


def _bench():
    return bench_scripts.load("gpu_profile")


def test_the_fake_mode_writes_a_record_and_its_table(tmp_path):
    b = _bench()
    assert b.main(["--fake", "--out", str(tmp_path), *SMALL]) == 0
    (path,) = tmp_path.glob("gpu_profile_*.json")
    d = json.loads(path.read_text())
    assert path.stem == b.file_stem(d) == "gpu_profile_cpu_gpu_profile_fake_resnet8_b2_fp32"
    assert (d["format"], d["device"], d["workload"]["batch"]) == ("minidl-gpu-profile/1", "CPU (gpu_profile --fake)", 2)
    assert {"date", "commit", "command", "versions", "minidl_step_s", "torch_step_s", "fit"} <= set(d)
    rows = {(r["kind"], r["phase"]): r for r in d["rows"]}
    conv = rows["conv", "forward"]
    assert conv["calls"] == 9 and conv["seconds"] > 0 and conv["torch_s"] > 0 and conv["flops"] > 0
    assert d["rows"][-1]["kind"] == "other"
    assert 0.01 <= d["fit"]["efficiency"] <= 1.0
    md = path.with_suffix(".md").read_text()
    assert md.startswith("# minidl's step per layer kind on CPU (gpu_profile --fake)")
    assert "| conv | forward | 9 |" in md


def test_the_fake_mode_never_writes_into_the_results(capsys):
    b = _bench()
    before = sorted(b.RESULTS.iterdir())
    assert b.main(["--fake", *SMALL]) == 2
    assert "outside benchmarks/results" in capsys.readouterr().err
    assert sorted(b.RESULTS.iterdir()) == before


def test_merge_puts_pytorchs_other_kinds_after_minidls_and_other_last():
    b = _bench()
    mine = [{"kind": "conv", "phase": "backward", "calls": 2, "seconds": 0.5, "flops": 1, "bytes": 1, "sim_s": 0.4},
            {"kind": "other", "phase": "step", "calls": 0, "seconds": 0.1, "flops": 0, "bytes": 0, "sim_s": 0.0}]
    theirs = {("conv", "backward"): 0.25, ("gap", "forward"): 0.01, ("add", "update"): 0.02}
    rows = b.merge(mine, theirs)
    assert [(r["kind"], r["phase"], r["torch_s"]) for r in rows] == [
        ("conv", "backward", 0.25), ("add", "update", 0.02), ("gap", "forward", 0.01), ("other", "step", None)]


def test_the_performance_page_includes_every_profile_newest_first(tmp_path):
    b = _bench()
    make_results = _generator("make_results")
    assert make_results.gpu_profiles(tmp_path).startswith("No per-layer GPU profile has been measured yet")
    for date, batch in (("2026-12-01", 32), ("2026-12-02", 64)):
        rec = {"device": "NVIDIA H100 80GB HBM3", "date": date, "commit": "abc1234", "command": "python x",
               "versions": {"torch": "2.11"}, "workload": {"model": "resnet", "depth": 50, "batch": batch,
                                                           "image_size": 224, "math": "fp32", "policy": "liveness"},
               "minidl_step_s": 0.1, "minidl_runner": "compiled", "torch_step_s": 0.05, "sim_profile": "h100",
               "fit": {"efficiency": 0.4},
               "rows": [{"kind": "conv", "phase": "backward", "calls": 53, "seconds": 0.05, "torch_s": 0.02,
                         "flops": 1, "bytes": 1, "sim_s": 0.04}]}
        stem = b.file_stem(rec)
        (tmp_path / f"{stem}.json").write_text(json.dumps(rec))
        (tmp_path / f"{stem}.md").write_text(b.markdown(rec))
    text = make_results.gpu_profiles(tmp_path)
    first, second = text.index("resnet50_b64"), text.index("resnet50_b32")
    assert first < second
    assert "#### minidl's step per layer kind on NVIDIA H100 80GB HBM3 (2026-12-02)" in text
    assert "| conv | backward | 53 | 50.00 | 20.00 | 2.50x | 50% | 40.00 | -20% |" in text
