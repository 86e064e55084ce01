"""Every plan runs compiled: `minidl train --json` reports `step_runner: "compiled"` under every policy, a paged
arena, micro-batches, compression and a host update (and 2 MPI ranks: tests/dist/test_mpi.py), and the parameters
after a few steps are bit-identical to the interpreter's (`--debug`, which runs the same calls as they are
assembled), in every math mode. With the Session API, each case shows its mechanism really ran, as recorded calls.
Each exact policy against `none` under every runner and math mode: tests/runtime/test_policy_matrix.py."""
import json

import numpy as np
import pytest

from minidl.cli import main
from minidl.memory.policies import POLICIES
from tests import sessions
from tests.memory.nets import NETS

LENET = ["lenet", "--data", "digits", "--batch", "16", "--steps", "3", "--seed", "4", "--lr", "0.05"]


def train(capsys, path, args, debug):
    assert main(["train", *LENET, *args, "--save", str(path), "--json", "--no-progress",
                 *(["--debug"] if debug else [])]) == 0
    report = json.loads(capsys.readouterr().out)
    with np.load(path) as z:
        return report, {k: z[k] for k in z.files if not k.startswith("__")}


def same_arrays(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


CASES = [["--policy", p] for p in POLICIES] + [["--paged"], ["--micro-batches", "2"],
                                               ["--policy", "packs", "--micro-batches", "2"]]
# the half modes: a plan of each kind of event (fp16 has no micro-batches or packs: its skipped steps need every
# gradient before the first update)
CASES += [["--math", m, *args] for m in ("bf16", "fp16") for args in (
    ["--policy", "liveness"], ["--policy", "offload"], ["--policy", "weights"], ["--paged"])]
CASES += [["--math", "bf16", "--micro-batches", "2"], ["--math", "bf16", "--policy", "packs", "--micro-batches", "2"]]


@pytest.mark.parametrize("args", CASES, ids=" ".join)
def test_every_plan_runs_compiled_and_matches_the_interpreter(capsys, tmp_path, args):
    compiled, a = train(capsys, tmp_path / "c.npz", args, debug=False)
    interpreted, b = train(capsys, tmp_path / "i.npz", args, debug=True)
    assert compiled["step_runner"] == "compiled", compiled.get("graph_fallback")
    assert interpreted["step_runner"] == "interpreted"
    same_arrays(a, b)
    assert compiled["final_loss"] == interpreted["final_loss"]
    if "--micro-batches" in args:
        assert compiled["micro_batches"] == 2
    if "weights" in args and "fp16" in args:  # an unfused update (fp16), on the device: the weights visit it
        assert compiled["moved_bytes_by_role"]["weights"] > 0
    elif "weights" in args:  # weights homed on the host, updated there: gradients go out
        assert compiled["moved_bytes_by_role"]["gradients"] > 0


def fit(key, compiled, policy=None, **kw):
    sess = sessions.train(NETS[key](), policy, steps=3, seed=5, data_seed=2, compiled=compiled, **kw)
    return sess, sess.last_fit.losses


@pytest.mark.parametrize("key", ["resnet20", "dropnet"])
@pytest.mark.parametrize("kw, kinds", [
    (dict(policy="compress"), ("compress", "decompress")),
    (dict(policy="liveness", micro_batches=2), ()),
    (dict(policy="liveness", paged="64KiB"), ("map",)),
    (dict(policy="weights"), ()),
], ids=["compress", "micro-batches", "paged", "host-update"])
def test_each_mechanism_is_recorded_and_bit_identical(key, kw, kinds):
    a, la = fit(key, True, **kw)
    b, lb = fit(key, False, **kw)
    ex = a.executor
    assert ex.step_runner == "compiled" and b.executor.step_runner == "interpreted"
    assert la == lb
    sessions.same_state(a, b)
    assert ex.pool.peak == a.plan.peak_bytes == b.executor.pool.peak
    for kind in kinds:
        assert ex.program.kinds.get(kind, 0) > 0, (kind, ex.program.kinds)
    if "micro_batches" in kw:  # a loss per micro-batch, each micro-batch's slice of the batch copied in
        assert ex.program.kinds["loss"] == 2 and len(ex.program.inputs) == 4
    if kw.get("policy") == "weights":
        assert any(sp.on_host for sp in a.plan.steps)


@pytest.mark.parametrize("kw", [dict(policy="liveness", micro_batches=2), dict(policy="compress")],
                         ids=["micro-batches", "compress"])
def test_a_recorded_step_traces_one_compute_event_per_route_step_like_the_interpreter(kw):
    a, _ = fit("resnet20", True, trace=True, **kw)
    b, _ = fit("resnet20", False, trace=True, **kw)
    ca = [(e.name, e.step, e.in_use) for e in a.executor.trace if e.track == "compute"]
    cb = [(e.name, e.step, e.in_use) for e in b.executor.trace if e.track == "compute"]
    assert a.executor.step_runner == "compiled" and b.executor.step_runner == "interpreted"
    assert ca == cb and len(ca) == 3 * len(a.plan.steps)
