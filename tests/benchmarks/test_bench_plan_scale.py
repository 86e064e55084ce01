"""benchmarks/plan_scale.py on a tiny GPT: the profile's plan, and the smallest budget bisected with the command
line's fit check (the budget found plans, one step below does not)."""
from __future__ import annotations

import json

from tests.benchmarks import bench_scripts


def _bench():
    return bench_scripts.load("plan_scale")


def test_the_smallest_budget_fits_and_one_step_less_does_not(tmp_path, monkeypatch):
    from minidl.models import build_model
    from minidl.reproduce.search import plan_on_device

    ps = _bench()
    monkeypatch.setattr(ps, "MODELS", {"tiny": ("gpt2", {"layers": 2, "heads": 2, "width": 16, "seq": 16})})
    monkeypatch.setattr(ps, "BATCH", 4)
    ps.main(["--models", "tiny", "--devices", "gtx1080ti", "--resolution", "64KiB", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "plan_scale.json").read_text())
    (row,) = res["cases"]
    assert row["fits"] and row["search_complete"] and row["chosen"] and row["micro_batches"] == 1
    small = row["smallest_budget_bytes"]
    assert row["largest_failing_below_bytes"] == small - 64 * 1024
    net = build_model("gpt2", layers=2, heads=2, width=16, seq=16, batch=4)
    assert plan_on_device(net, "auto", "gtx1080ti", small) is not None
    assert plan_on_device(net, "auto", "gtx1080ti", small - 64 * 1024) is None
    assert "| tiny (16) |" in (tmp_path / "plan_scale.md").read_text()
