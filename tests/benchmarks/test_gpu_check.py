"""benchmarks/gpu_check.py without a GPU: the whole check in --fake mode (every part on the CPU, tiny), so that
it runs the first time a GPU is there: setup, each part in a process of its own under its cap, the results folder
of at most 8 files written as it goes, the summary; a part past its cap killed with what it started, keeping what
it wrote; parts not started once the budget is spent. Its figures are the CPU's, never a GPU's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tests.benchmarks import bench_scripts

pytest.importorskip("torch")

SCRIPT = bench_scripts.script("gpu_check")


def _bench():
    return bench_scripts.load("gpu_check")


def test_the_parts_fit_the_eight_minutes_with_their_setup():
    b = _bench()
    assert [p.name for p in b.PARTS] == ["correctness", "startup", "speed", "half", "memory", "superneurons",
                                         "profile"]
    assert sum(p.cap_s for p in b.PARTS) <= b.BUDGET_S <= 8 * 60 - 30


def test_the_fake_check_runs_every_part_into_at_most_nine_files(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--work", str(work), "--fake"],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 9, files
    assert {"summary.json", "log.txt", "startup.json", "memory.json", "superneurons.json"} <= set(files)
    assert any(f.startswith("gpu_profile_") and f.endswith(".md") for f in files)
    s = json.loads((out / "summary.json").read_text())
    assert s["fake"] is True and s["setup"]["minidl"] == "importable"
    status = {p["part"]: p["status"] for p in s["parts"]}
    assert status == {"correctness": "passed", "startup": "passed", "speed": "skipped", "half": "skipped",
                      "memory": "passed", "superneurons": "passed", "profile": "passed"}
    parts = {p["part"]: p for p in s["parts"]}
    assert parts["correctness"]["result"]["counts"] == {"passed": 2}
    assert "no GPU" in parts["speed"]["result"]["skipped"] and "no GPU" in parts["half"]["result"]["skipped"]
    startup = json.loads((out / "startup.json").read_text())
    for run in ("cold", "warm"):
        assert startup["runs"][run]["exit"] == 0 and startup["runs"][run]["startup_s"] > 0
        assert "first_step" in startup["runs"][run]["startup_parts"]
    memory = json.loads((out / "memory.json").read_text())
    assert memory["minidl"]["pool_peak_bytes"] == memory["minidl"]["plan_peak_bytes"] > 0
    assert len(memory["minidl"]["step_s"]) == 3 and memory["torch"]["max_allocated_bytes"] is None
    sn = json.loads((out / "superneurons.json").read_text())
    assert len(sn["minidl"]["step_s"]) == 2
    log = (out / "log.txt").read_text()
    assert "===== profile: passed" in log and "gpu_vs_torch: needs a CUDA GPU" in log


def test_the_half_part_runs_the_bf16_rows_against_pytorch_amp():
    b = _bench()
    args = b.SPEED_ROWS["half"]
    assert args[args.index("--math") + 1:] == ["bf16"] and "gpt2" in args and "resnet50" in args


def test_the_half_parts_summary_says_which_attention_gpt2_ran(tmp_path):
    b = _bench()
    (tmp_path / "work" / "half").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    row = dict(workload="resnet50", batch=32, math="bf16", minidl="liveness", minidl_s=0.1, torch_s=0.05, ratio=2.0,
               extra={"sim_s": 0.1})
    rows = [row, row | {"workload": "gpt2", "batch": 8, "extra": {"sim_s": 0.2, "attention": "cudnn_sdpa"}}]
    (tmp_path / "work" / "half" / "gpu_vs_torch.json").write_text(json.dumps(rows))
    got = b._collect_rows(SimpleNamespace(work=tmp_path / "work", out=tmp_path / "out"), "half")["rows"]
    assert "attention" not in got[0] and got[1]["attention"] == "cudnn_sdpa" and got[1]["workload"] == "gpt2"
    assert (tmp_path / "out" / "half.json").exists()


def test_the_correctness_part_collects_the_sdpa_tests():
    args = _bench().CORRECTNESS
    assert "tests/backend/test_cuda_sdpa.py" in args and "test_cuda_sdpa" in args[args.index("-k") + 1]


def test_a_part_past_its_cap_is_killed_with_what_it_started_and_keeps_what_it_wrote(tmp_path):
    b = _bench()
    pid_file, kept = tmp_path / "grandchild.pid", tmp_path / "kept.json"
    code = (f"import subprocess, sys, time, pathlib; "
            f"g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
            f"pathlib.Path({str(pid_file)!r}).write_text(str(g.pid)); "
            f"pathlib.Path({str(kept)!r}).write_text('{{}}'); time.sleep(300)")
    args = SimpleNamespace(out=tmp_path, work=tmp_path, fake=True)
    with open(tmp_path / "log.txt", "a") as log:
        res = b.run_part(b.Part("sleeper", 2, "sleeps"), 2, args, dict(os.environ), log,
                         cmd=[sys.executable, "-c", code])
    assert res["status"] == "timeout" and kept.exists()
    pid = int(pid_file.read_text())
    for _ in range(100):   # the grandchild was killed with its group; wait for init to reap it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the part's own child {pid} outlived the cap")


def test_parts_are_not_started_once_the_budget_is_spent(tmp_path):
    b = _bench()
    assert b.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "w"), "--fake", "--budget-s", "1"]) == 0
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [p["status"] for p in s["parts"]] == ["not started: the budget is spent"] * len(b.PARTS)
