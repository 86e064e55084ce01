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


def test_half_rows_run_against_pytorch_amp():
    b = _bench()
    rows = b.row_specs(None, ["bf16", "fp16"])
    assert {(r.workload, r.batch, r.minidl, r.peer) for r in rows} == {
        ("resnet50", 32, "liveness", "amp"), ("resnet50", 64, "liveness", "amp"),
        ("gpt2", b.GPT2_BATCH, "liveness", "amp"), ("gpt2_kept", b.GPT2_BATCH, "liveness", "amp")}
    assert {r.math for r in rows} == {"bf16", "fp16"} and len(rows) == 8
    with pytest.raises(ValueError, match="'amp' runs in bf16 or fp16"):
        net = build_model("resnet", depth=20, batch=2, image_size=8, in_channels=3, num_classes=10)
        b.TorchStep(net, Session(net, SGD(lr=0.1), seed=0).executor.state_dict(), np.zeros((2, 3, 8, 8), np.float32),
                    np.zeros(2, np.int64), "amp", None, "fp32", device="cpu")


@pytest.mark.parametrize("math", ["bf16", "fp16"])
def test_the_amp_peer_autocasts_on_the_cpu(math):
    """PyTorch's side of a half row on the CPU: convolutions in the half dtype under autocast, channels_last
    weights and input, float32 parameters updated (through a GradScaler in fp16)."""
    b = _bench()
    spec = b.RowSpec("resnet50", 2, math, "liveness", "amp")
    net_of, x, y = b.workload(spec, depth=20, image_size=8)
    net = net_of()
    state = Session(net, SGD(lr=0.1), seed=0).executor.state_dict()
    step = b.TorchStep(net, state, x, y, "amp", None, math, device="cpu")
    assert step.x.is_contiguous(memory_format=torch.channels_last)
    convs = [ps["weight"] for n, ps in step.twin.params.items() if ps.get("weight") is not None
             and ps["weight"].dim() == 4]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert (step.scaler is not None) == (math == "fp16")
    seen = []
    real = torch.nn.functional.conv2d   # the twin is functional: conv2d is what autocast reaches

    def conv2d(*a, **k):
        out = real(*a, **k)
        seen.append(out.dtype)
        return out
    torch.nn.functional.conv2d = conv2d
    try:
        before = convs[0].detach().clone()
        loss = step()
    finally:
        torch.nn.functional.conv2d = real
    assert np.isfinite(loss) and seen and set(seen) == {step.amp}
    assert convs[0].dtype == torch.float32
    moved = not torch.equal(convs[0].detach(), before)
    # fp16: GradScaler's first scale (2**16) may overflow; then the step is skipped and the scale backs off
    assert moved or (math == "fp16" and step.scaler.get_scale() < 2.0 ** 16)


def test_the_amp_peer_runs_gpt2_with_tied_weights_on_the_cpu():
    b = _bench()
    spec = b.RowSpec("gpt2", 2, "bf16", "liveness", "amp")
    net_of, x, y = b.workload(spec, layers=1, heads=2, width=16, seq=8)
    net = net_of()
    assert x.shape == y.shape == (2, 8) and x.dtype == np.int64
    state = Session(net, SGD(lr=0.1), seed=0).executor.state_dict()
    step = b.TorchStep(net, state, x, y, "amp", None, "bf16", device="cpu")
    assert any(step.twin.tied.values())   # the head reads the embedding's table
    assert np.isfinite(step())


def test_the_checkpoint_sequential_peer_takes_its_segments_on_the_cpu():
    b = _bench()
    net = build_model("resnet", depth=20, batch=2, image_size=8, in_channels=3, num_classes=10)
    state = Session(net, SGD(lr=0.1), seed=0).executor.state_dict()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2, 3, 8, 8)).astype(np.float32), rng.integers(0, 10, 2)
    step = b.TorchStep(net, state, x, y, "checkpoint_sequential", None, "fp32", device="cpu")
    assert step.segments == max(1, round(len(step.fns) ** 0.5)) and np.isfinite(step())


def test_the_gpt2_row_drops_the_scores_and_says_which_attention_ran():
    """Its attention layers keep no scores (half attention then runs cuDNN's SDPA, as PyTorch AMP's flash
    attention); the row says whether SDPA ran or why cuDNN refused it, in its extra and in the table."""
    from types import SimpleNamespace

    from minidl.layers.attention import SelfAttention

    b = _bench()
    net_of, _, _ = b.workload(b.RowSpec("gpt2", 2, "bf16", "liveness", "amp"), layers=1, heads=2, width=16, seq=8)
    attn = [n.layer for n in net_of().nodes if isinstance(n.layer, SelfAttention)]
    assert attn and not any(a.keep_scores for a in attn)
    kept, _, _ = b.workload(b.RowSpec("gpt2_kept", 2, "bf16", "liveness", "amp"), layers=1, heads=2, width=16, seq=8)
    kept_attn = [n.layer for n in kept().nodes if isinstance(n.layer, SelfAttention)]
    assert kept_attn and all(a.keep_scores for a in kept_attn)

    def be(ops, fallbacks=None):
        return SimpleNamespace(fallbacks=fallbacks or {}, graphs=SimpleNamespace(ops=lambda: set(ops)))
    assert b.attention_ran(be({"sdpa_fwd", "sdpa_bwd", "bn_train"})) == "cudnn_sdpa"
    assert b.attention_ran(be({"sdpa_fwd"}, {"sdpa_bwd": "cuDNN cannot run sdpa_bwd: no engine"})) == \
        "kernels (sdpa_bwd: cuDNN cannot run sdpa_bwd: no engine)"
    assert b.attention_ran(be(set())) == "kernels"
    row = b.Row("gpt2", 8, "bf16", "liveness", "amp", 0.2, 0.1, 2.0, 5e9, 4e9, None, "H100", "2026-11-27",
                "cuda graph: 3 graphs per step", "step", 10, {"attention": "cudnn_sdpa"})
    assert "| cuda graph: 3 graphs per step; attention: cudnn_sdpa |" in b.markdown([row])
