"""Plans for a simulated GPU size workspaces with the model of cuDNN's algorithm families (memory/cudnn_model.py),
reserve the CUDA context from the device's memory, and the CPU profile keeps the CPU's menu."""
import json
from dataclasses import replace

import pytest

from minidl.backend.base import Capabilities
from minidl.backend.cpu.conv import ALGOS as CPU_ALGOS
from minidl.backend.cpu.menu import CPU_MENU
from minidl.cli import main
from minidl.core.errors import OptionError
from minidl.memory import cudnn_model as cm
from minidl.memory.report.fit import check_fit
from minidl.memory.request import Target
from minidl.memory.simulate import PROFILES, get_profile, simulate
from minidl.memory.workspace import fit_workspace
from minidl.models import build_model
from minidl.optim import SGD
from tests.planning import planned

K40C = get_profile("k40c")


def shape(**kw):
    """A 3x3, pad-1 convolution of 2 x 3 x 8 x 8 into 4 channels, unless told otherwise."""
    base = dict(n=2, c=3, h=8, w=8, k=4, kh=3, kw=3, ho=8, wo=8, padding=(1, 1))
    return cm.ConvShape(**{**base, **kw})


def test_workspace_formulas_on_a_hand_computed_case():
    s = shape()
    assert cm.workspace_bytes("implicit_gemm", s) == 0
    assert cm.workspace_bytes("precomp_gemm", s) == 4 * (3 * 9 + 8 + 8)                # 172: the offset table
    assert cm.workspace_bytes("gemm", s) == 4 * 2 * (3 * 9) * 64                         # 13,824: im2col, batch
    assert cm.workspace_bytes("fft", s) == 8 * 10 * 6 * (2 * 3 + 4 * 3 + 2 * 4)          # 12,480: 10x10 -> 10x6
    assert cm.workspace_bytes("fft_tiling", s) == 8 * 32 * 17 * (4 * 3 + 2 * 3 + 2 * 4)  # 113,152
    assert cm.workspace_bytes("winograd", s) == 4 * 16 * 4 * 3                           # 768: 4x4 filters
    assert cm.workspace_bytes("winograd_nonfused", s) == 4 * 36 * (4 * 3 + 2 * 3 * 4 + 2 * 4 * 4)  # 4 tiles: 9,792


def test_families_follow_cudnns_documented_limits():
    assert cm.families(shape(), "fwd") == ["implicit_gemm", "precomp_gemm", "gemm", "fft", "fft_tiling", "winograd",
                                           "winograd_nonfused"]
    assert "gemm" not in cm.families(shape(), "dgrad")             # backward data has no explicit GEMM
    assert "winograd" not in cm.families(shape(), "wgrad")         # fused Winograd: fwd and dgrad only
    strided = shape(stride=(2, 2), ho=4, wo=4)
    assert cm.families(strided, "fwd") == ["implicit_gemm", "precomp_gemm", "gemm"]
    assert cm.families(shape(groups=3, c=3, k=3), "fwd") == ["implicit_gemm", "precomp_gemm", "gemm"]
    five = shape(kh=5, kw=5, padding=(2, 2))
    assert "winograd" not in cm.families(five, "fwd") and "winograd_nonfused" in cm.families(five, "fwd")
    big = shape(h=300, w=300, ho=300, wo=300)                       # padded image > 256: only the tiled FFT
    assert "fft" not in cm.families(big, "fwd") and "fft_tiling" in cm.families(big, "fwd")


def test_time_is_the_roofline_of_the_familys_flops_and_bytes():
    s = shape(n=16, c=64, h=56, w=56, k=64, ho=56, wo=56)
    t = cm.family_seconds("implicit_gemm", s, K40C)
    assert t == pytest.approx(max(s.direct_flops / (K40C.flops * cm.EFFICIENCY["implicit_gemm"]),
                                  s.tensor_bytes / K40C.mem_bw))
    # Winograd does fewer multiplies than the direct sum: on a large 3x3 layer it is the faster family
    assert cm.family_seconds("winograd_nonfused", s, K40C) < t
    # a faster device runs every family faster
    assert cm.family_seconds("implicit_gemm", s, get_profile("v100")) < t


def test_options_are_pareto_and_the_chooser_takes_a_smaller_family_when_memory_binds():
    model = cm.CudnnModel(K40C)
    for phase in ("fwd", "bwd"):
        opts = model.conv_workspace_options(phase, (16, 64, 56, 56), (64, 64, 3, 3), (16, 64, 56, 56), (1, 1),
                                            (1, 1), (1, 1), 1)
        assert all(o.algo.startswith("cudnn:") for o in opts)
        assert [o.est_cost for o in opts] == sorted(o.est_cost for o in opts)
        ws = [o.workspace_bytes for o in opts]
        assert ws == sorted(ws, reverse=True) and ws[-1] == 0   # each slower option needs less; implicit GEMM: 0
        fastest, _ = fit_workspace(opts, 1 << 40)
        assert fastest is opts[0]
        chosen, refused = fit_workspace(opts, opts[0].workspace_bytes - 1)
        assert chosen is opts[1] and chosen.workspace_bytes < opts[0].workspace_bytes and len(refused) == 1
    with pytest.raises(ValueError, match="phase"):
        model.conv_workspace_options("dgrad", (1, 1, 4, 4), (1, 1, 3, 3), (1, 1, 2, 2), (1, 1), (0, 0), (1, 1), 1)


def test_the_target_menu_is_the_model_for_gpu_profiles_and_the_cpu_menu_for_the_cpu():
    assert Target.for_run("cpu").menu is CPU_MENU and Target.for_run("cpu:1GB").menu is CPU_MENU
    assert isinstance(Target.for_run("k40c:3MiB").menu, cm.CudnnModel)
    for name in ("k40c", "titanx", "v100", "h100", "harmony", "gtx1080ti"):
        assert isinstance(Target.for_run(name).menu, cm.CudnnModel)

    class Real:   # a live backend keeps its own menu
        capabilities = Capabilities(name="cuda", device="gpu")
        profile = "h100"
    real = Real()
    assert Target.for_run("k40c", real).menu is real and Target.for_run(None, real).profile.name == "h100"
    assert cm.CudnnModel(K40C) == cm.CudnnModel(get_profile("k40c"))   # one cached route per device


def test_gpu_profiles_hold_a_cuda_context_and_the_cpu_none():
    assert PROFILES["cpu"].context_bytes == 0
    for name in ("k40c", "titanx", "v100", "h100", "harmony", "gtx1080ti"):
        p = PROFILES[name]
        assert 0 < p.context_bytes < p.memory_bytes // 8
        assert p.usable_bytes == p.memory_bytes - p.context_bytes
    assert PROFILES["gtx1080ti"].usable_bytes == 10 * 2**30   # Harmony's scheduler's per-GPU cap
    sized = get_profile("k40c:64GB")        # SIZE is what the plan may use: a GPU still, no context reserved
    assert sized.gpu and sized.context_bytes == 0 and sized.usable_bytes == 64 * 10**9


def resnet():
    return build_model("resnet", depth=8, batch=2, image_size=12, num_classes=4)


def test_a_plan_for_k40c_uses_the_model_and_the_cpu_plan_the_cpu_menu():
    net = resnet()
    gpu = planned(net, SGD(0.1, momentum=0.9), "liveness", device="k40c", menu=Target.for_run("k40c").menu)
    cpu = planned(net, SGD(0.1, momentum=0.9), "liveness", device="cpu", menu=Target.for_run("cpu").menu)
    assert gpu.route.backend_name == cm.NAME and cpu.route.backend_name == "cpu"
    gpu_algos = {sp.algo for sp in gpu.steps if sp.algo}
    cpu_algos = {sp.algo for sp in cpu.steps if sp.algo}
    assert gpu_algos and all(a.startswith("cudnn:") for a in gpu_algos)
    assert cpu_algos and cpu_algos <= set(CPU_ALGOS)
    # each conv step's workspace is the model's figure for the algorithm chosen (no budget: the fastest)
    for step, sp in zip(gpu.route.steps, gpu.steps):
        if sp.algo:
            assert sp.algo == step.workspace_options[0].algo
            assert sp.workspace_bytes == step.workspace_options[0].workspace_bytes


def test_the_context_is_reserved_from_the_devices_memory():
    net = resnet()
    plan = planned(net, SGD(0.1), "liveness", device="k40c", menu=Target.for_run("k40c").menu)
    need = plan.min_budget_bytes
    # a device whose memory holds the plan but not the plan and the context: does not fit
    tight = replace(K40C, memory_bytes=need + K40C.context_bytes - 1)
    assert not check_fit(plan, tight, None).fits and not simulate(plan, tight).fits_device
    roomy = replace(K40C, memory_bytes=need + K40C.context_bytes)
    assert check_fit(plan, roomy, None).fits and simulate(plan, roomy).fits_device
    assert "CUDA context" in check_fit(plan, tight, None).format()
    cpu = replace(PROFILES["cpu"], memory_bytes=need)            # the CPU holds no context
    assert check_fit(plan, cpu, None).fits


def plan_json(capsys, *args):
    assert main(["plan", "resnet", "--depth", "8", "--batch", "2", "--image-size", "12", "--num-classes", "4",
                 "--policy", "liveness", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_plan_for_a_gpu_profile_sizes_cudnn_workspaces_and_reserves_the_context(capsys):
    """The rule `minidl plan ... --device k40c` follows: its workspaces are the model's (so its peak differs from
    the CPU profile's, whose menu is the CPU's), and its verdict is against memory less the context."""
    k40c = plan_json(capsys, "--device", "k40c")
    cpu = plan_json(capsys, "--device", "cpu")
    assert k40c["device_context_bytes"] == K40C.context_bytes and cpu["device_context_bytes"] == 0
    net = resnet()
    expect = planned(net, SGD(0.01, momentum=0.9), "liveness", device="k40c", menu=cm.CudnnModel(K40C))
    assert k40c["peak_bytes"] == expect.peak_bytes
    assert cpu["peak_bytes"] == planned(net, SGD(0.01, momentum=0.9), "liveness", device="cpu").peak_bytes


def test_a_model_plan_does_not_run_on_the_cpu():
    from minidl.runtime.executor import Executor

    net, opt = resnet(), SGD(0.1)
    plan = planned(net, opt, "liveness", device="k40c", menu=Target.for_run("k40c").menu)
    with pytest.raises(OptionError, match=cm.NAME):
        Executor(net, plan, opt)
