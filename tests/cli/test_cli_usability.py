"""The command line a newcomer meets: help and defaults, --version, clear size errors, checkpoints while
training (--save-every, Ctrl-C), learning-rate schedules, and saying what was written where."""
import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import minidl as dl
from minidl.cli import build_parser, main
from minidl.runtime.checkpoint import load_checkpoint

TRAIN = ["train", "lenet", "--data", "digits", "--batch", "16"]


def test_every_option_has_help_and_version(capsys):
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "cmd").choices
    for name, sub in subs.items():
        for action in sub._actions:
            assert action.help, f"minidl {name} {action.option_strings or action.dest}: no help text"
    assert "training steps (one mini-batch each) (default: 20)" in " ".join(subs["train"].format_help().split())
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("minidl 0.1.0")


def test_bad_budget_says_what_a_size_is(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "lenet", "--budget", "lots"])
    err = capsys.readouterr().err
    assert "--budget: 'lots' is not a memory size; use e.g. 512MiB" in err
    assert "parse_size" not in err


@pytest.mark.parametrize("policy", ["liveness", "auto"])
def test_the_smallest_budget_printed_is_a_budget_that_works(capsys, policy):
    """The minimum a BudgetError prints, typed back as --budget (decimals and all), plans: it was refused as "not
    a memory size" and, printed rounded to nearest, could be below the minimum."""
    argv = ["plan", "resnet", "--depth", "20", "--batch", "8", "--policy", policy]
    assert main(argv + ["--budget", "1MiB"]) == 2
    printed = re.search(r"smallest budget that works is (\d+\.\d\d) (KiB|MiB|GiB) \(([\d,]+) B\)",
                        capsys.readouterr().err)
    typed = printed.group(1) + printed.group(2)
    assert dl.parse_size(typed) >= int(printed.group(3).replace(",", ""))
    assert main(argv + ["--budget", typed]) == 0


def test_alexnet_names_the_nearest_image_sizes_that_work(capsys):
    assert main(["info", "alexnet", "--image-size", "100"]) == 2
    err = capsys.readouterr().err
    assert "nearest sizes that work: 223-254" in err and "none" not in err


def test_save_every_and_what_was_written_where(tmp_path, capsys):
    ck, png = tmp_path / "ck.npz", tmp_path / "mem.png"
    assert main([*TRAIN, "--steps", "5", "--save", str(ck), "--save-every", "2", "--plot", str(png),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"wrote checkpoint (step 5): {ck}" in out and f"wrote memory timeline: {png}" in out
    assert load_checkpoint(ck)[2]["iteration"] == 5 and png.stat().st_size > 0
    assert main([*TRAIN, "--steps", "4", "--save-every", "2"]) == 2
    assert "--save-every needs --save" in capsys.readouterr().err


def test_lr_schedule_on_the_cli(capsys):
    r = main([*TRAIN, "--steps", "4", "--lr-schedule", "cosine", "--warmup-steps", "4", "--json"])
    assert r == 2 and "leaves no step" in capsys.readouterr().out
    assert main([*TRAIN, "--steps", "4", "--lr-schedule", "step", "--lr-step-size", "2", "--json"]) == 0


def test_ctrl_c_saves_the_last_completed_step(tmp_path):
    """A real process, a real SIGINT: the step under way finishes, the checkpoint holds exactly the completed
    steps, the exit is clean (130, no traceback) and no temporary file is left behind."""
    ck = tmp_path / "ck.npz"
    cmd = [sys.executable, "-m", "minidl.cli", *TRAIN, "--steps", "100000", "--save", str(ck), "--save-every", "3",
           "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not ck.exists():  # the first --save-every checkpoint: training is under way
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint after 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["interrupted"] and 3 <= res["steps_done"] < 100000 and res["saved"] == str(ck)
    params, opt, meta = load_checkpoint(ck)
    assert meta["iteration"] == res["steps_done"] == res["iteration"]
    assert opt and all(np.isfinite(v).all() for v in params.values())
    assert [p.name for p in tmp_path.iterdir()] == ["ck.npz"], "a temporary file was left behind"


@pytest.mark.parametrize("argv,message", [
    (["--resume", "/nonexistent/ck.npz"], "--resume: no checkpoint file at /nonexistent/ck.npz"),
    (["--batch", "5000"], "--batch 5000 exceeds the 1438 training samples of --data digits; lower --batch"),
])
def test_train_errors_name_the_option(argv, message, capsys):
    args = list(TRAIN)
    if "--batch" in argv:
        args = args[:-2]
    assert main([*args, *argv, "--steps", "1"]) == 2
    assert capsys.readouterr().err.strip() == f"minidl: error: {message}"


def test_plan_says_what_it_wrote_where(tmp_path, capsys):
    png, trace = tmp_path / "m.png", tmp_path / "t.json"
    assert main(["plan", "lenet", "--policy", "liveness", "--plot", str(png), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [f"wrote memory timeline: {png}", f"wrote trace: {trace}"]
    assert png.stat().st_size > 0 and trace.stat().st_size > 0


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["train", "--help"]])
def test_help_describes_every_policy_in_one_line(argv, capsys, monkeypatch):
    """`--policy` lists ten names; the help says what each one does, one line each, from the policies table."""
    from minidl.memory.policies import POLICIES

    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for name, policy in POLICIES.items():
        assert any(line.split() and line.split()[0] == name and " ".join(line.split()[1:]) == policy.help
                   for line in lines), f"minidl {' '.join(argv)}: no line describes policy {name!r}"


def test_paged_chunk_adapts_to_the_budget_and_the_error_names_it(capsys):
    """A bare --paged under a small budget picks a chunk the budget holds many of (20 MiB chunks made a 1.5 MiB
    net need 20 MiB); a chunk given that is too coarse is named in the error, with a smaller one to try."""
    assert main(["plan", "lenet", "--batch", "4", "--paged", "--budget", "2MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["paged_chunk_bytes"] <= 2 * 2**20 // 64 * 2
    argv = ["plan", "lenet", "--batch", "4", "--policy", "liveness", "--budget", "2MiB"]   # an arena: whole chunks
    assert main([*argv, "--paged", "4MiB"]) == 2
    err = capsys.readouterr().err
    assert "Tensors are placed by 4.00 MiB chunks (--paged 4MiB)" in err and "--paged 512KiB" in err
    assert main([*argv, "--paged", "512KiB"]) == 0


def test_the_copies_line_says_what_the_overlap_costs_this_run(capsys):
    """"copies at 4.7 GB/s, 0% hidden behind compute" said nothing about whether that was good: the line gives the
    time the step waited for the copies as a share of the step, over the steps it names."""
    from minidl.memory.host import copies_line

    t = {"offloaded_bytes": 2 << 20, "prefetched_bytes": 2 << 20, "copy_bandwidth_bytes_per_s": 10e9,
         "transfer_time_s": 0.0004, "transfer_stall_s": 0.0004, "transfer_hidden_fraction": 0.0}
    small = copies_line(t, 0.08, "the 9 steps after the first")
    assert "4.00 MiB a step at 10.0 GB/s" in small and "0% hidden behind compute" in small
    assert "waited 0.4 ms for them, 0.5% of its 80.0 ms (means over the 9 steps after the first)" in small
    assert "not timed" in copies_line({**t, "transfer_hidden_fraction": None}, 0.08, "")
    argv = ["train", "resnet", "--depth", "20", "--data", "digits", "--batch", "32", "--steps", "2", "--budget",
            "4MiB", "--no-progress"]
    assert main(argv) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("  copies: ") and "a step waited" in line and "the 1 steps after the first" in line


def test_the_copies_line_judges_no_budget_and_leaves_the_first_step_out(capsys, monkeypatch):
    """"this budget costs little time" was said of a step 1.9x the unbudgeted one, from a mean that counted the
    compiling first step: a budget also costs recomputation, which no copy measures, so the line gives no verdict,
    and its mean step and mean wait both leave the first step out. The first step is made 2 s slower here: the
    step the line names is the others'."""
    from minidl.runtime.session import Session

    real = Session._train_one

    def slow_first(self, it):
        loss, dt = real(self, it)
        return loss, dt + (2.0 if self.iteration == 1 else 0.0)

    monkeypatch.setattr(Session, "_train_one", slow_first)
    argv = ["train", "resnet", "--depth", "20", "--data", "digits", "--batch", "32", "--steps", "3", "--budget",
            "4MiB", "--no-progress"]
    assert main(argv) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("  copies: ") and "small" not in line and "costly" not in line and "budget" not in line
    step_ms = float(re.search(r"% of its ([\d.]+) ms", line)[1])
    assert step_ms < 1000, line


def test_plan_says_its_step_time_is_a_model_of_a_profile(capsys):
    """`minidl plan` estimated 17.4 ms a step on the CPU where the step takes ~155 ms, with nothing to say that the
    figure is a roofline model of a profile (measured on another machine, or a datasheet) and not this machine's."""
    argv = ["plan", "resnet", "--depth", "20", "--batch", "32", "--image-size", "8", "--in-channels", "1"]
    assert main([*argv, "--device", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "a roofline model of profile cpu (65 GFLOP/s x 0.6, 22 GB/s; measured on a 2-core AMD EPYC VM" in out
    assert "not a measurement of this machine; it counts no per-layer overhead" in out
    assert main([*argv, "--device", "k40c"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "a roofline model of profile k40c (4290 GFLOP/s x 0.5, 288 GB/s; datasheet), not a measurement" in out


def test_a_budget_error_stays_a_few_lines(capsys):
    """`--budget 1KB` printed one line of 4,227 characters (the table of every plan tried, flattened): the error is
    its first line; the table comes on its own lines with `minidl plan --explain`, and train names that door."""
    train = ["train", "resnet", "--depth", "20", "--data", "digits", "--batch", "32", "--steps", "1", "--budget",
             "1KB"]
    assert main(train) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and max(map(len, err)) < 700, err
    assert err[0].startswith("minidl: error: budget 1000 B") and "tried" not in err[0]
    assert "`minidl plan` with these options and --explain prints the" in err[1]
    plan = ["plan", "resnet", "--depth", "20", "--batch", "32", "--image-size", "8", "--in-channels", "1",
            "--budget", "1KB"]
    assert main(plan) == 2
    assert "--explain prints the" in capsys.readouterr().err
    assert main([*plan, "--explain"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[1] == "tried:" and len(err) > 10 and max(map(len, err[1:])) < 250


def test_debug_shows_the_traceback_and_keeps_the_exit_status(capsys):
    """docs/cli.md: errors exit with status 2, `--debug` shows the traceback; --debug re-raised instead, so the
    status became Python's 1."""
    assert main(["plan", "lenet", "--batch", "4", "--policy", "liveness", "--budget", "1KB", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "BudgetError" in err and "minidl: error:" in err


def test_train_without_data_says_it_trains_on_random_data(capsys):
    assert main(["train", "lenet", "--batch", "8", "--steps", "1", "--no-progress"]) == 0
    assert "no --data: training on random synthetic images" in capsys.readouterr().err
    assert main(["train", "lenet", "--batch", "8", "--steps", "1", "--no-progress", "--data", "digits"]) == 0
    assert "synthetic" not in capsys.readouterr().err


def test_a_language_model_reports_tokens_per_second(capsys):
    lm = ["train", "gpt2", "--layers", "1", "--width", "16", "--heads", "2", "--seq", "32", "--batch", "4",
          "--steps", "2", "--no-progress"]
    assert main([*lm, "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "images_per_s" not in r and r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_time_s"])
    assert main(lm) == 0
    out = capsys.readouterr().out
    assert " tokens/s" in out and "images/s" not in out


def test_keep_scores_chooses_the_attention_of_a_sequence_model(capsys):
    """--keep-scores off: attention keeps its probabilities in no plan (no (B, H, T, T) tensor planned; on CUDA in
    half, cuDNN's SDPA); an image model has no such option."""
    from minidl.cli.common import build_net

    lm = ["plan", "gpt2", "--layers", "1", "--width", "16", "--heads", "2", "--seq", "32", "--batch", "4"]
    for flag, keep in (("on", True), ("off", False)):
        net = build_net(build_parser().parse_args([*lm, "--keep-scores", flag]))
        attention = [n.layer for n in net.nodes if getattr(n.layer, "type_name", "") == "attention"]
        assert attention and all(a.keep_scores is keep for a in attention)
    assert main([*lm, "--keep-scores", "off", "--json"]) == 0
    assert main(["plan", "resnet", "--depth", "8", "--keep-scores", "off"]) == 2
    assert "model 'resnet' has no keep_scores option" in capsys.readouterr().err


def test_log_writes_a_csv_row_per_step(tmp_path, capsys):
    """--log PATH: the per-step figures the summary leaves out (loss, lr, step time, the step's copies), one row a
    step; the last row's loss is the run's final loss, and the copies add up to what the summary reports."""
    import csv

    log = tmp_path / "steps.csv"
    argv = ["train", "resnet", "--depth", "20", "--data", "digits", "--batch", "32", "--steps", "3", "--budget",
            "4MiB", "--lr-schedule", "step", "--lr-step-size", "2", "--no-progress", "--log", str(log)]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = list(csv.DictReader(log.open()))
    assert out["log"] == str(log) and [int(r["iteration"]) for r in rows] == [1, 2, 3]
    assert float(rows[-1]["loss"]) == out["final_loss"]
    assert [float(r["lr"]) for r in rows] == pytest.approx([0.05, 0.05, 0.005])
    assert out["offloaded_bytes"] > 0 and sum(int(r["offloaded_bytes"]) for r in rows) == 3 * out["offloaded_bytes"]
    assert all(float(r["step_time_s"]) > 0 and float(r["copy_wait_s"]) >= 0 for r in rows)
    assert main([*argv[:-1], str(tmp_path)]) == 2
    assert "--log " + str(tmp_path) + ": is a directory" in capsys.readouterr().err
