"""The convolution algorithms a plan chooses among are the backend's: the route asks the backend the plan is for
(`conv_workspace_options`), every planner pass reads that one menu, and the executor refuses a plan made from
another backend's menu."""
from dataclasses import replace

import numpy as np
import pytest

from minidl.backend import menu_of
from minidl.backend.cpu.backend import CPUBackend
from minidl.data import synthetic
from minidl.layers import WorkspaceOption
from minidl.memory.planner import lower_bound
from minidl.memory.workspace import CostTable, workspace_choices
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.executor import Executor
from minidl.runtime.session import Session
from tests.planning import planned


def resnet(batch=2):
    return build_model("resnet", depth=8, batch=batch, image_size=12, num_classes=4)


class LeanCPU(CPUBackend):
    """The CPU backend under another name, offering only its most frugal algorithm per phase (renamed for the
    menu, so that a plan made for it cannot be mistaken for a CPU plan). Its convolutions run the CPU code."""

    capabilities = replace(CPUBackend.capabilities, name="lean")

    def conv_workspace_options(self, phase, x_shape, w_shape, y_shape, stride, padding, dilation, groups,
                               dtype=np.float32, accumulate=False):
        opts = super().conv_workspace_options(phase, x_shape, w_shape, y_shape, stride, padding, dilation, groups,
                                              dtype, accumulate)
        o = min(opts, key=lambda o: o.workspace_bytes)
        self.asked = getattr(self, "asked", 0) + 1
        return [WorkspaceOption("lean:" + o.algo, o.workspace_bytes, 5.0)]

    def conv2d_forward(self, x, w, b, y, stride, padding, dilation, groups, algo, workspace):
        self.ran.append(algo)
        super().conv2d_forward(x, w, b, y, stride, padding, dilation, groups, algo.removeprefix("lean:"),
                               workspace)

    def conv2d_backward(self, x, w, dy, dx, dw, db, stride, padding, dilation, groups, algo, workspace,
                        accumulate=False):
        self.ran.append(algo)
        super().conv2d_backward(x, w, dy, dx, dw, db, stride, padding, dilation, groups, algo.removeprefix("lean:"),
                                workspace, accumulate)

    def __init__(self):
        super().__init__()
        self.ran: list[str] = []


def test_the_cpu_backend_shares_the_reference_route():
    net = resnet()
    slots = ("momentum",)
    assert net.route(optimizer_slots=slots, menu=menu_of(CPUBackend())) is net.route(optimizer_slots=slots)
    assert net.route(optimizer_slots=("momentum",)).backend_name == "cpu"


def test_the_route_holds_the_backends_menu_and_every_pass_reads_it():
    net = resnet()
    be = LeanCPU()
    cpu = net.route(optimizer_slots=("momentum",))
    lean = net.route(optimizer_slots=("momentum",), menu=be)
    assert lean is not cpu and lean.backend_name == "lean"
    assert lean is net.route(optimizer_slots=("momentum",), menu=be)  # cached: the backend is asked once
    asked = be.asked
    assert asked == sum(s.workspace is not None for s in lean.steps)
    for a, b in zip(cpu.steps, lean.steps):
        assert (a.workspace is None) == (b.workspace is None)
        if a.workspace is not None:
            assert [o.algo for o in b.workspace_options] == ["lean:" + min(
                a.workspace_options, key=lambda o: o.workspace_bytes).algo]
    assert all(len(c.options) == 1 and c.algo.startswith("lean:") for c in workspace_choices(lean).values())
    # the bound uses the smallest workspace of either menu, and that smallest one is the same here
    assert lower_bound(lean) == lower_bound(cpu)
    plan = planned(net, SGD(0.1, momentum=0.9), "liveness", menu=be)
    assert be.asked == asked
    algos = {sp.algo for sp in plan.steps if sp.algo is not None}
    assert algos and all(a.startswith("lean:") for a in algos)
    cpu_plan = planned(net, SGD(0.1, momentum=0.9), "liveness")
    assert plan.peak_bytes < cpu_plan.peak_bytes  # the fast CPU menu spends workspace that the lean one does not


@pytest.mark.parametrize("policy", ["liveness", "auto"])
def test_training_on_a_backend_runs_its_own_algorithms_bit_identically(policy):
    data = synthetic(16, (3, 12, 12), 4, seed=1)
    ref = Session(resnet(), SGD(0.05, momentum=0.9), "none", seed=3)
    ref.fit(data, steps=3)
    net = resnet()
    be = LeanCPU()
    budget = planned(net, SGD(0.05, momentum=0.9), policy, menu=be).min_budget_bytes if policy == "liveness" \
        else None
    sess = Session(net, SGD(0.05, momentum=0.9), policy, budget=budget, seed=3, backend=be)
    sess.fit(data, steps=3)
    assert be.ran and all(a.startswith("lean:") for a in be.ran)
    assert sess.executor.pool.peak == sess.plan.peak_bytes
    for k, v in ref.executor.state_dict().items():
        assert np.array_equal(v, sess.executor.state_dict()[k]), k


def test_a_plan_runs_only_on_the_backend_whose_menu_it_chose_from():
    net = resnet()
    opt = SGD(0.1, momentum=0.9)
    plan = planned(net, opt, "liveness")
    with pytest.raises(ValueError, match="backend 'cpu''s menu but runs on backend 'lean'"):
        Executor(net, plan, opt, backend=LeanCPU())
    plan = planned(net, opt, "liveness", menu=LeanCPU())
    with pytest.raises(ValueError, match="plan_network"):
        Executor(net, plan, opt, backend=CPUBackend())


def test_autotuning_measures_on_the_routes_backend():
    net = resnet()
    be = LeanCPU()
    route = net.route(optimizer_slots=("momentum",), menu=be)
    table = CostTable(autotune=True, backend=be, repeats=1)
    ws = workspace_choices(route, table)
    # one option per step; steps of the same configuration share a measurement
    assert table.measured == len(table.seconds) <= len(ws) and all(k.startswith("lean|") for k in table.seconds)
    assert all(a.startswith("lean:") for a in be.ran)
    with pytest.raises(ValueError, match="measures on backend 'cpu' but the route lists .* 'lean'"):
        workspace_choices(route, CostTable(autotune=True))


def test_a_session_plans_with_its_backends_speeds_unless_told():
    be = LeanCPU()
    be.profile = "k40c"
    assert Session(resnet(), SGD(0.1), "liveness", backend=be).device == "k40c"
    assert Session(resnet(), SGD(0.1), "liveness", backend=be, device="h100").device == "h100"
    assert Session(resnet(), SGD(0.1), "liveness").device == "cpu"
