"""benchmarks/gpu_vs_torch.py on a machine without a GPU: it refuses cleanly, and its PyTorch side (the forward
that frees values, the checkpoint_sequential segments of a DAG) computes the twin's loss and gradients, on the
CPU. Its figures need a GPU (issue 19)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from minidl.models import build_model  # noqa: E402
from minidl.optim import SGD  # noqa: E402
from minidl.runtime.session import Session  # noqa: E402
from minidl.testing.torch_twin import TorchTwin  # noqa: E402
from tests.benchmarks import bench_scripts  # noqa: E402

SCRIPT = bench_scripts.script("gpu_vs_torch")


def _bench():
    return bench_scripts.load("gpu_vs_torch")


def test_refuses_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark would run")
    r = subprocess.run([sys.executable, str(SCRIPT), "--only", "resnet50"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert "gpu_vs_torch: needs a CUDA GPU" in r.stderr and "GPU.md" in r.stderr
    assert "Traceback" not in r.stderr


def test_rows_are_the_issues():
    b = _bench()
    rows = b.row_specs(None, ["fp32", "tf32"])
    assert len(rows) == 12 and {r.math for r in rows} == {"fp32", "tf32"}
    assert {(r.workload, r.batch, r.minidl, r.peer) for r in rows} == {
        ("resnet50", 1, "liveness", "plain"), ("resnet50", 32, "liveness", "plain"),
        ("resnet50", 64, "liveness", "plain"), ("resnet50", 32, "700MiB", "plain"),
        ("resnet2500", 16, "liveness", "plain"), ("resnet2500", 16, "12GB", "checkpoint_sequential")}
    assert all(r.workload == "resnet50" for r in b.row_specs(["resnet50"], ["fp32"]))
    fields = set(b.Row.__dataclass_fields__)
    assert {"workload", "batch", "math", "minidl", "peer", "minidl_s", "torch_s", "ratio", "minidl_peak_bytes",
            "torch_peak_bytes", "hidden_fraction", "device", "date"} <= fields


def test_the_torch_side_matches_the_twin_on_the_cpu():
    from torch.utils.checkpoint import checkpoint_sequential

    b = _bench()
    net = build_model("resnet", depth=20, batch=4, image_size=8, in_channels=3, num_classes=10)
    state = Session(net, SGD(lr=0.1), seed=0).executor.state_dict()
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal(net.input_nodes[0].shape).astype(np.float32))
    y = torch.tensor(rng.integers(0, 10, 4))
    ref = TorchTwin(net, state)
    loss_ref, _ = ref.forward(x, y)
    loss_ref.backward()
    twin = b.torch_twin(net, state, torch.device("cpu"))
    loss = b.plain_loss(twin, x, y)
    loss.backward()
    assert float(loss.detach()) == float(loss_ref.detach())
    # ResNet-20: the stem, 9 blocks, then pooling and the classifier: cuts between blocks only
    fns = b.segment_functions(twin)
    assert len(fns) >= 10 and len(b.sequential_cuts(net)) >= 9
    ck = b.torch_twin(net, state, torch.device("cpu"))
    fns = b.segment_functions(ck)
    logits = checkpoint_sequential(fns, 3, x, use_reentrant=False)
    loss_ck = torch.nn.functional.cross_entropy(logits, y)
    loss_ck.backward()
    assert float(loss_ck.detach()) == pytest.approx(float(loss_ref.detach()), rel=1e-6)
    for name, ps in ck.params.items():
        for p, t in ps.items():
            if t.requires_grad:
                np.testing.assert_allclose(t.grad.numpy(), ref.params[name][p].grad.numpy(), rtol=1e-4,
                                           atol=1e-6, err_msg=f"{name}.{p}")


def test_markdown_table_of_rows():
    b = _bench()
    rows = [b.Row("resnet50", 32, "fp32", "liveness", "plain", 0.05, 0.045, 0.05 / 0.045, 9e9, 10e9, None, "H100",
                  "2026-11-23", "cuda graph: 1 graph per step", "step", 10, {"sim_s": 0.055, "sim_vs_measured": 0.1}),
            b.Row("resnet50", 32, "fp32", "700MiB", "plain", 0.06, 0.045, 0.06 / 0.045, 7e8, 10e9, 0.93, "H100",
                  "2026-11-23", "cuda graph: 1 graph per step", "step", 10, {})]
    md = b.markdown(rows)
    assert "| resnet50 | 32 | fp32 | 700MiB | plain | 0.0600 | 0.0450 | 1.33x | 1.20x |" in md
    assert "| 93% |" in md and "0.0550 (+10%)" in md
