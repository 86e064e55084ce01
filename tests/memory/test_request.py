"""The run described once: `PlanRequest.from_options` and `Target.for_run` hold the defaulting rules every door
(the command line, `Session`, `reproduce`) shares, and `plan_network` takes their values unchanged."""
import pytest

from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.cpu.menu import CPU_MENU, CPUMenu
from minidl.core.errors import DistError, OptionError
from minidl.core.options import MATH_MODES, PlanOptions
from minidl.memory.cudnn_model import CudnnModel
from minidl.memory.decisions.allreduce import DataParallel
from minidl.memory.request import PlanRequest, Target
from minidl.memory.simulate import get_profile
from minidl.memory.workspace import CostTable
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import RunConfig, Session


def test_the_policy_is_auto_under_a_budget_and_liveness_without():
    assert PlanRequest.from_options().policy == "liveness"
    assert PlanRequest.from_options(budget="16MiB").policy == "auto"
    assert PlanRequest.from_options(budget="16MiB").budget == 16 << 20
    assert PlanRequest.from_options("offload", 1 << 20).policy == "offload"
    assert PlanRequest.from_options(budget=1 << 20, lossy=True).policy == "auto-lossy"
    with pytest.raises(OptionError, match="--lossy applies to --policy auto, not 'offload'"):
        PlanRequest.from_options("offload", lossy=True)
    with pytest.raises(OptionError, match="unknown policy 'fastest'"):
        PlanRequest.from_options("fastest")


def test_the_fused_update_rule():
    assert PlanRequest.from_options("auto", "1MiB").fused_update
    assert not PlanRequest.from_options("auto").fused_update              # no budget: the textbook route
    assert PlanRequest.from_options("weights").fused_update
    assert not PlanRequest.from_options("offload", "1MiB").fused_update
    assert PlanRequest.from_options("liveness", fused_update=True).fused_update
    assert not PlanRequest.from_options("auto", "1MiB", fused_update=False).fused_update
    dp = DataParallel(2)
    assert not PlanRequest.from_options("auto", "1MiB", data_parallel=dp).fused_update
    with pytest.raises(DistError, match="--fused-update on cannot be combined"):
        PlanRequest.from_options("auto", "1MiB", data_parallel=dp, fused_update=True)
    with pytest.raises(DistError, match="micro-batches"):
        PlanRequest.from_options(data_parallel=dp, micro_batches=2)


def test_options_are_checked_and_paged_auto_is_a_chunk_of_the_budget():
    assert PlanRequest.from_options(budget="64MiB", paged="auto").options.paged_chunk == 1 << 20
    assert PlanRequest.from_options(paged="auto").options.paged_chunk == 20 << 20
    assert PlanRequest.from_options(paged="4KiB").options.paged_chunk == 4096
    assert PlanRequest.from_options().options.math == MATH_MODES[0] == "fp32"
    with pytest.raises(OptionError, match="--math must be one of fp32, tf32, bf16, fp16, got 'fp8'"):
        PlanOptions(math="fp8")


def test_the_target_is_for_where_the_run_trains():
    assert Target.for_run().profile.name == "cpu" and Target.for_run().menu is CPU_MENU
    be = CPUBackend(CPUMenu(winograd=False, threads=2))
    t = Target.for_run(backend=be)
    assert t.profile == get_profile(be.profile) and t.menu == CPUMenu(winograd=False, threads=2)
    assert Target.for_run("k40c", be).menu is be.menu              # the backend that runs it: its own menu
    assert isinstance(Target.for_run("k40c").menu, CudnnModel)     # a plan alone for a GPU: cuDNN's model
    assert Target.for_run("k40c", cpu=CPUMenu(winograd=False)).menu == CudnnModel(get_profile("k40c"))
    assert Target.for_run("cpu", cpu=CPUMenu(winograd=False)).menu == CPUMenu(winograd=False)
    costs = CostTable(autotune=True)
    assert Target.for_run("k40c", costs=costs).menu is CPU_MENU     # the table measures the CPU's algorithms


def test_a_session_and_the_command_line_default_alike():
    """`Session(budget=...)` plans what `--budget` alone plans (auto), for the device the session runs on."""
    net = build_model("lenet", batch=4)
    live = Session(build_model("lenet", batch=4), SGD(0.1, momentum=0.9))
    assert live.policy == "liveness" and live.request == PlanRequest.from_options()
    budget = live.plan.min_budget_bytes
    sess = Session(net, SGD(0.1, momentum=0.9), budget=budget, config=RunConfig(paged=None))
    assert sess.policy == "auto" and sess.plan.policy == "auto" and sess.plan.route.fused_update
    assert sess.request == PlanRequest.from_options(budget=budget)
    assert sess.target.profile.name == "cpu" and sess.target.menu is CPU_MENU
