"""Data-parallel training under a real `mpiexec` (the `mpich` and `mpi4py` wheels of the test extra).

Skipped, with the reason, where MPI cannot start (no mpi4py, no mpiexec, or a 2-rank hello that fails)."""
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from minidl.cli import main
from minidl.runtime.checkpoint import read_manifest

TIMEOUT_S = 300


def _mpiexec() -> str | None:
    here = Path(sys.executable).parent / "mpiexec"  # the .[mpi] / .[test] extra installs it beside python
    return str(here) if here.exists() else shutil.which("mpiexec")


@pytest.fixture(scope="module")
def mpiexec():
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install -e '.[test]' or '.[mpi]')")
    exe = _mpiexec()
    if exe is None:
        pytest.skip("no mpiexec beside the interpreter or on PATH")
    try:
        r = subprocess.run([exe, "-n", "2", sys.executable, "-c",
                            "from mpi4py import MPI; c = MPI.COMM_WORLD; print(f'{c.Get_rank()}/{c.Get_size()}')"],
                           capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"MPI cannot start 2 ranks here: {e}")
    if r.returncode != 0 or not ("0/2" in r.stdout and "1/2" in r.stdout):
        pytest.skip(f"MPI cannot start 2 ranks here (rc {r.returncode}): {r.stdout[-200:]} {r.stderr[-500:]}")
    return exe


def run_ranks(mpiexec, n, argv, timeout=TIMEOUT_S):
    return subprocess.run([mpiexec, "-n", str(n), sys.executable, *argv], capture_output=True, text=True,
                          timeout=timeout)


def train_ranks(mpiexec, n, args):
    r = run_ranks(mpiexec, n, ["-m", "minidl.cli", "train", *args, "--no-progress", "--json"])
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def load(path):
    """The checkpoint's arrays, without its metadata entries (`__manifest__`: run metadata that differs between a
    1-process and a 2-rank run, such as the per-rank batch)."""
    with np.load(path) as z:
        return {k: z[k] for k in z.files if not k.startswith("__")}


LENET = ["lenet", "--data", "digits", "--steps", "5", "--lr", "0.05", "--bucket-size", "16KiB"]


def test_two_ranks_match_one_process_at_the_global_batch_and_repeat_bit_identically(mpiexec, tmp_path):
    assert main(["train", *LENET, "--batch", "32", "--save", str(tmp_path / "one.npz"), "--no-progress",
                 "--json"]) == 0
    r = train_ranks(mpiexec, 2, [*LENET, "--batch", "16", "--save", str(tmp_path / "two_a.npz")])
    assert len(r.stdout.strip().splitlines()) == 1  # rank 0 alone reports
    train_ranks(mpiexec, 2, [*LENET, "--batch", "16", "--save", str(tmp_path / "two_b.npz")])
    train_ranks(mpiexec, 2, [*LENET, "--batch", "16", "--reduction", "ring", "--save", str(tmp_path / "ring.npz")])
    one, a, b, ring = (load(tmp_path / f) for f in ("one.npz", "two_a.npz", "two_b.npz", "ring.npz"))
    assert one.keys() == a.keys() == b.keys()
    for k in one:
        assert np.array_equal(a[k], b[k]), k  # run to run: bit-identical
        assert np.array_equal(a[k], ring[k]), k  # the other reduction: the same additions, the same bits
        scale = max(float(np.abs(one[k]).max()), 1e-12)
        assert float(np.abs(a[k] - one[k]).max()) / scale <= 1e-4, k  # vs one process at 2 x 16


@pytest.mark.slow
def test_two_ranks_run_compiled_and_match_the_interpreter(mpiexec, tmp_path):
    """Data parallel runs the compiled step (its all-reduce calls recorded with the rest), bit-identical to the
    interpreter (`--debug`) on the same 2 ranks."""
    r = train_ranks(mpiexec, 2, [*LENET, "--batch", "16", "--save", str(tmp_path / "c.npz")])
    assert json.loads(r.stdout)["step_runner"] == "compiled"
    r = train_ranks(mpiexec, 2, [*LENET, "--batch", "16", "--debug", "--save", str(tmp_path / "i.npz")])
    assert json.loads(r.stdout)["step_runner"] == "interpreted"
    a, b = load(tmp_path / "c.npz"), load(tmp_path / "i.npz")
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


@pytest.mark.slow
def test_three_ranks_reduce_scatter_matches_gather_and_one_process(mpiexec, tmp_path):
    train_ranks(mpiexec, 3, [*LENET, "--batch", "16", "--save", str(tmp_path / "ring.npz")])  # ring: 3 > 2 ranks
    train_ranks(mpiexec, 3, [*LENET, "--batch", "16", "--reduction", "gather", "--save", str(tmp_path / "g.npz")])
    assert main(["train", *LENET, "--batch", "48", "--save", str(tmp_path / "one.npz"), "--no-progress",
                 "--json"]) == 0
    ring, gather, one = (load(tmp_path / f) for f in ("ring.npz", "g.npz", "one.npz"))
    for k in one:
        assert np.array_equal(ring[k], gather[k]), k
        assert float(np.abs(ring[k] - one[k]).max()) / max(float(np.abs(one[k]).max()), 1e-12) <= 1e-4, k


@pytest.mark.slow
def test_rank0_checkpoint_resumes_on_every_rank_exactly(mpiexec, tmp_path):
    base = ["lenet", "--data", "digits", "--batch", "16", "--lr", "0.05", "--bucket-size", "16KiB"]
    train_ranks(mpiexec, 2, [*base, "--steps", "5", "--save", str(tmp_path / "full.npz")])
    train_ranks(mpiexec, 2, [*base, "--steps", "3", "--save", str(tmp_path / "part.npz")])
    train_ranks(mpiexec, 2, [*base, "--steps", "2", "--resume", str(tmp_path / "part.npz"),
                             "--save", str(tmp_path / "resumed.npz")])
    full, resumed = load(tmp_path / "full.npz"), load(tmp_path / "resumed.npz")
    for k in full:
        assert np.array_equal(full[k], resumed[k]), k
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, no temporary left


def test_batchnorm_statistics_are_per_rank_and_runs_repeat_bit_identically(mpiexec, tmp_path):
    net = ["resnet", "--depth", "20", "--data", "digits", "--bucket-size", "256KiB"]
    for name in ("a", "b"):
        train_ranks(mpiexec, 2, [*net, "--batch", "8", "--steps", "2", "--save", str(tmp_path / f"{name}.npz")])
    a, b = load(tmp_path / "a.npz"), load(tmp_path / "b.npz")
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    # Per-rank batch statistics, exactly: after one step, rank 0's BN running statistics (the checkpoint's) are
    # those of one process that trained on rank 0's slice alone (the first 8 samples of the global batch of 16
    # are the first batch of 8 of the same seed's order), and not those of one process at the global batch.
    train_ranks(mpiexec, 2, [*net, "--batch", "8", "--steps", "1", "--save", str(tmp_path / "two.npz")])
    for batch, name in ((8, "slice0"), (16, "global")):
        assert main(["train", *net, "--batch", str(batch), "--steps", "1", "--save", str(tmp_path / f"{name}.npz"),
                     "--no-progress", "--json"]) == 0
    two, slice0, glob = (load(tmp_path / f"{n}.npz") for n in ("two", "slice0", "global"))
    stats = [k for k in two if k.endswith(("running_mean", "running_var"))]
    assert stats
    for k in stats:
        assert np.array_equal(two[k], slice0[k]), k
        assert not np.array_equal(two[k], glob[k]), k
    weights = [k for k in two if k.endswith("weight")]
    assert any(not np.array_equal(two[k], slice0[k]) for k in weights)  # the gradients were averaged


FAILING = textwrap.dedent("""
    import sys, time
    from minidl.data import synthetic
    from minidl.dist.launch import communicator, guarded
    from minidl.models import build_model
    from minidl.optim import SGD
    from minidl.runtime.session import Session

    mode = sys.argv[1]
    if mode == "both":  # ranks failing together must end at once: waiting out this grace would time the test out
        import minidl.dist.comm
        minidl.dist.comm.FAIL_GRACE_S = 3600.0
    comm = communicator("mpi", timeout_s=3.0)

    def work():
        net = build_model("lenet", batch=8, image_size=8, in_channels=1, num_classes=10)
        sess = Session(net, SGD(0.05), comm=comm)

        def on_step(k, loss, dt):
            if mode == "both" and k == 1:
                raise ValueError(f"bad value on rank {comm.rank}")
            if comm.rank == 1 and k == 2:
                if mode == "raise":
                    raise RuntimeError("injected failure on rank 1")
                time.sleep(60)  # a rank that stops answering
        sess.fit(synthetic(256, (1, 8, 8), 10, seed=0), 6, on_step=on_step)

    guarded(comm, work)
    print("finished", comm.rank)
""")


def test_a_failing_rank_stops_every_rank_with_a_message(mpiexec, tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    r = run_ranks(mpiexec, 2, [str(script), "raise"], timeout=120)
    assert r.returncode != 0
    assert "finished" not in r.stdout
    assert "rank 1 of 2: RuntimeError: injected failure on rank 1; stopping every rank" in r.stderr, r.stderr
    assert "rank 0 of 2: stopping because rank 1 failed: RuntimeError: injected failure on rank 1" in r.stderr


def test_ranks_failing_together_end_at_once_each_saying_why(mpiexec, tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    r = run_ranks(mpiexec, 2, [str(script), "both"], timeout=120)  # the grace is 3600 s in "both" mode
    assert r.returncode != 0
    for k in (0, 1):
        assert f"rank {k} of 2: ValueError: bad value on rank {k}; stopping every rank" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_rank_that_stops_answering_times_out_with_a_message(mpiexec, tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    r = run_ranks(mpiexec, 2, [str(script), "hang"], timeout=120)
    assert r.returncode != 0

    assert re.search(r"rank 0 of 2: DistError: rank 0 of 2: .* did not complete within 3 s \(--comm-timeout\)",
                     r.stderr), r.stderr


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_after_the_same_step_and_saves(mpiexec, tmp_path):
    import json
    import signal
    import time

    ck = tmp_path / "ck.npz"
    p = subprocess.Popen([mpiexec, "-n", "2", sys.executable, "-m", "minidl.cli", "train", "lenet", "--data",
                          "digits", "--batch", "16", "--steps", "100000", "--save", str(ck), "--save-every", "1",
                          "--json", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while not ck.exists() and time.time() - t0 < 120:  # training has begun once a checkpoint exists
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)  # mpiexec forwards it to every rank
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err[-2000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["interrupted"] and res["steps_done"] < 100000
    meta = read_manifest(ck)["meta"]
    assert meta["iteration"] == res["iteration"] == res["steps_done"]  # both ranks stopped after that step


def test_ranks_started_with_different_options_stop_before_the_first_step_naming_them(mpiexec, tmp_path):
    """Two command lines, one per rank (mpiexec's `A : B`): another seed and momentum on rank 1."""
    args = ["-m", "minidl.cli", "train", *LENET, "--batch", "16", "--save", str(tmp_path / "ck.npz"),
            "--no-progress", "--json"]
    r = subprocess.run([mpiexec, "-n", "1", sys.executable, *args, ":", "-n", "1", sys.executable, *args,
                        "--seed", "1", "--momentum", "0.5"], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 2, r.stderr  # a user error, as for one process
    for k in (0, 1):
        assert re.search(rf"rank {k} of 2: DistError: the 2 ranks were not started with the same training options: "
                         r"optimizer momentum: 0.9 on rank 0, 0.5 on rank 1; seed: 0 on rank 0, 1 on rank 1",
                         r.stderr), r.stderr
    assert not (tmp_path / "ck.npz").exists()  # no step ran, nothing was saved


def test_a_diverging_run_exits_3_as_one_process_does(mpiexec, tmp_path):
    r = run_ranks(mpiexec, 2, ["-m", "minidl.cli", "train", "lenet", "--data", "digits", "--batch", "8", "--steps",
                               "20", "--lr", "1e6", "--no-progress", "--save", str(tmp_path / "ck.npz")])
    assert r.returncode == 3, r.stderr[-3000:]
    assert "DivergenceError: step " in r.stderr and "the last good state" in r.stderr
