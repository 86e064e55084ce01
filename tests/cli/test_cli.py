"""The `minidl` command's contract: --json prints one JSON object with the documented keys."""
import json
import os

import numpy as np
import pytest

from minidl.cli import main


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_info(capsys):
    r = run_json(capsys, "info", "resnet", "--depth", "50", "--batch", "2")
    assert r["params"] == 25_557_032
    assert r["weighted_layers"] == 54  # 53 convs (incl. 4 projections) + 1 linear
    assert r["forward_flops"] > 0 and len(r["layers"]) if isinstance(r["layers"], list) else r["layers"] > 0
    assert {"name", "type", "output_shape", "params", "flops", "output_bytes"} <= set(r["table"][1])


def test_info_text(capsys):
    assert main(["info", "lenet"]) == 0
    out = capsys.readouterr().out
    assert "conv" in out and "parameters" in out


def test_plan_keys_and_budget_error(capsys):
    r = run_json(capsys, "plan", "resnet", "--depth", "20", "--batch", "8", "--policy", "liveness",
                 "--device", "k40c")
    for k in ("peak_bytes", "min_budget_bytes", "lower_bound_bytes", "est_step_time_s", "by_role"):
        assert k in r
    assert sum(r["by_role"].values()) == r["peak_bytes"]
    assert main(["plan", "resnet", "--depth", "20", "--batch", "8", "--policy", "liveness", "--budget",
                 str(r["min_budget_bytes"] - 512), "--device", "k40c", "--json"]) == 2
    err = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert err["error"] == "BudgetError" and err["min_budget_bytes"] == r["min_budget_bytes"]


def test_plan_explain_plot_trace(capsys, tmp_path):
    png, trace = tmp_path / "m.png", tmp_path / "t.json"
    assert main(["plan", "lenet", "--batch", "4", "--policy", "liveness", "--explain", "--plot", str(png),
                 "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "first used here" in out and "last use" in out
    assert png.stat().st_size > 1000
    assert json.loads(trace.read_text())["traceEvents"]


def test_train_digits_and_bit_identical_saves(capsys, tmp_path):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    common = ["train", "lenet", "--data", "digits", "--batch", "16", "--steps", "5", "--seed", "3"]
    r = run_json(capsys, *common, "--save", str(a))
    for k in ("final_loss", "step_time_s", "images_per_s", "accuracy", "peak_bytes"):
        assert k in r
    run_json(capsys, *common, "--save", str(b), "--policy", "none")
    za, zb = np.load(a), np.load(b)
    assert "conv1.weight" in za.files
    for k in za.files:
        assert np.array_equal(za[k], zb[k]), k


def test_sizes_accept_units(capsys):
    r = run_json(capsys, "plan", "lenet", "--batch", "4", "--budget", "64MiB")
    assert r["arena_bytes"] == 64 * 2**20


@pytest.mark.parametrize("bad", [["info", "nosuchnet"], ["train", "lenet", "--data", "cifar10:/nonexistent"]])
def test_errors_are_clean(capsys, bad):
    assert main([*bad, "--json"]) == 2
    assert "error" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_plan_for_the_cuda_backend_without_cuda_says_what_is_missing(capsys):
    pytest.importorskip("minidl.backend.cuda.backend")
    try:
        import cupy  # noqa: F401
        pytest.skip("cupy is importable here: the CUDA backend would be constructed")
    except ImportError:
        pass
    assert main(["plan", "resnet", "--depth", "8", "--backend", "cuda", "--json"]) == 2
    err = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert err["error"] == "CUDAUnavailable" and "simulator's device profiles" in err["message"]
    r = run_json(capsys, "plan", "resnet", "--depth", "8", "--backend", "cpu")
    assert r["backend"] == "cpu"


def test_autotune_measures_once_and_keeps_the_measurements(capsys, tmp_path):
    cache = tmp_path / "costs.json"
    argv = ("plan", "resnet", "--depth", "8", "--batch", "2", "--image-size", "16", "--policy", "liveness")
    run_json(capsys, *argv, "--autotune", str(cache))
    saved = json.loads(cache.read_text())["seconds"]
    assert saved and all(k.startswith("cpu|conv|") for k in saved)
    # Rank the per-sample variants (im2col_chunked, rows_chunked) first everywhere: a file's measurements are used,
    # never re-measured, so the plan follows them (smaller workspaces than the estimates' choice, whole batch).
    cache.write_text(json.dumps({"seconds": {k: {a: (0.5 if a.endswith("_chunked") else 1.0) for a in v}
                                             for k, v in saved.items()}}))
    edited = cache.read_text()
    frugal = run_json(capsys, *argv, "--autotune", str(cache))
    assert cache.read_text() == edited
    default = run_json(capsys, *argv, "--device", "cpu")   # the CPU menu's estimates (a GPU profile: cuDNN's)
    assert frugal["peak_bytes"] < default["peak_bytes"]


@pytest.mark.bits
def test_threads_option_sets_the_lanes_and_keeps_the_bits(capsys, tmp_path, monkeypatch):
    """--threads is the CPU menu's: the backend's steps run on that many lanes (no environment variable is set),
    with the same bits."""
    from threadpoolctl import threadpool_limits

    from minidl.backend.cpu import lanes
    from minidl.runtime.executor import Executor

    seen, step = [], Executor.train_step

    def counted(self, *a, **k):   # the lanes the step's kernels run on
        with self.be.step_scope():
            seen.append(lanes.count())
        return step(self, *a, **k)
    monkeypatch.setattr(Executor, "train_step", counted)
    saves, env = [], dict(os.environ)
    with threadpool_limits(None):  # restores the BLAS threads the option sets
        for threads in ("1", "3"):
            path = tmp_path / f"t{threads}.npz"
            run_json(capsys, "train", "resnet", "--depth", "8", "--batch", "6", "--image-size", "16", "--steps",
                     "2", "--seed", "1", "--threads", threads, "--save", str(path))
            saves.append(np.load(path))
    assert dict(os.environ) == env and seen == [1, 1, 3, 3]
    for k in saves[0].files:
        assert np.array_equal(saves[0][k], saves[1][k]), k


def test_winograd_options_set_the_cpu_menu(capsys):
    """Winograd is the CPU menu's default; `--no-cpu-winograd` switches it off for the run (the menu the plan is
    made from, so the workspaces and the plan's bytes change), `--cpu-winograd` back on."""
    argv = ("plan", "resnet", "--depth", "8", "--batch", "4", "--image-size", "16", "--policy", "none", "--device",
            "cpu")   # the CPU's menu (a GPU profile's plan sizes cuDNN's workspaces)
    on = run_json(capsys, *argv)["peak_bytes"]
    off = run_json(capsys, *argv, "--no-cpu-winograd")["peak_bytes"]
    again = run_json(capsys, *argv, "--cpu-winograd")["peak_bytes"]
    assert on == again != off


def test_plan_says_whether_it_fits_and_what_would(capsys):
    """Without --budget, a plan larger than the device's memory says so, with a policy and budget that fit; that
    suggestion, typed back, plans and says it fits. --json carries `fits` and `budget_bytes`."""
    argv = ["plan", "resnet", "--depth", "20", "--batch", "8", "--device", "k40c:3MiB"]
    assert main(argv) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.strip().startswith("fits:"))
    assert "fits: no. It does not fit k40c's 3.00 MiB" in line
    suggested = line.split("Policy auto fits: ")[1].split(" (")[0].split()
    assert suggested == ["--policy", "auto", "--budget", "3MiB"]
    assert main([*argv, *suggested, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is True and out["budget_bytes"] == 3 * 2**20 and out["needs_bytes"] <= 3 * 2**20
    assert main([*argv, *suggested]) == 0
    assert "fits: yes. It fits the 3.00 MiB budget" in capsys.readouterr().out
    assert main([*argv[:-1], "k40c:1536KiB", "--json"]) == 0   # auto cannot fit it either: its smallest budget
    out = json.loads(capsys.readouterr().out)
    least = out["suggested"]["least_budget_bytes"]
    assert out["fits"] is False and out["budget_bytes"] is None and least > 1536 * 2**10
    assert main([*argv[:-1], f"k40c:{least}", "--policy", "auto", "--budget", str(least), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True


def test_evaluate_and_predict_a_checkpoint_as_the_training_run_did(capsys, tmp_path):
    """`minidl evaluate` on a `train --save` checkpoint gives the run's own held-out loss and accuracy (the split of
    the checkpoint's seed, every sample); `predict` gives the same classes from --data as from --input images."""
    from minidl.data import load_data

    ck = tmp_path / "ck.npz"
    model = ["lenet", "--batch", "16"]
    assert main(["train", *model, "--data", "digits", "--steps", "8", "--seed", "3", "--budget", "450KiB",
                 "--save", str(ck), "--no-progress", "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert main(["evaluate", *model[:1], "--data", "digits", "--checkpoint", str(ck), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["accuracy"] == trained["accuracy"] and ev["iteration"] == 8 and ev["samples"] == 359
    assert main(["predict", "lenet", "--data", "digits", "--checkpoint", str(ck), "--json"]) == 0
    pred = json.loads(capsys.readouterr().out)
    assert pred["accuracy"] == trained["accuracy"] and pred["count"] == 359
    images = tmp_path / "x.npy"
    np.save(images, load_data("digits", seed=3)[1].x[:5])
    out = tmp_path / "classes.npy"
    assert main(["predict", "lenet", "--input", str(images), "--checkpoint", str(ck), "--output", str(out)]) == 0
    assert f"wrote classes: {out}" in capsys.readouterr().out
    assert np.load(out).tolist() == pred["classes"][:5]
    assert main(["evaluate", "lenet", "--data", "digits", "--checkpoint", str(tmp_path / "none.npz")]) == 2
    assert "--checkpoint: no checkpoint file at" in capsys.readouterr().err
    assert main(["evaluate", "resnet", "--depth", "8", "--data", "digits", "--checkpoint", str(ck)]) == 2
    assert "does not fit this network" in capsys.readouterr().err


def test_a_suggested_budget_is_typable_and_within_the_memory():
    from minidl.memory.pool import parse_size
    from minidl.memory.report.fit import typable_budget

    assert typable_budget(12 * 10**9) == ("12GB", 12 * 10**9) and typable_budget(3 << 20) == ("3MiB", 3 << 20)
    n = 11391070 * 1024
    text, b = typable_budget(n)
    assert text == "10.86GiB" and b == parse_size(text) <= n


def test_train_says_whether_the_plan_fits_as_plan_does(capsys):
    """`minidl train` repeats `minidl plan`'s verdict in its memory report: the budget, what the plan needs, the
    device; its JSON carries `fits` and `budget_bytes`."""
    argv = ["train", "lenet", "--data", "digits", "--steps", "1", "--batch", "16", "--budget", "450KiB",
            "--no-progress"]
    assert main(argv) == 0
    assert "fits: yes. It fits the 450.00 KiB budget (this plan needs " in capsys.readouterr().out
    out = run_json(capsys, *argv)
    assert out["fits"] is True and out["budget_bytes"] == 450 * 1024 and out["needs_bytes"] <= 450 * 1024
    out = run_json(capsys, *argv[:-3], "--no-progress")
    assert out["fits"] is True and out["budget_bytes"] is None
