"""Planning for the CUDA backend, on the host: the workspace sizing of the planner chooses among cuDNN's execution
plans (names and workspace bytes from the backend's `conv_workspace_options`) exactly as it chooses among the
CPU's algorithms, and the chosen plan names reach the backend's convolution calls.

The backend is the host-emulated one of test_cuda_host.py (numpy arrays for device arrays, a recording fake of
the `cudnn` module with configurable plan tables); no GPU, cupy or cuDNN is used.
"""
from __future__ import annotations

import numpy as np
import pytest

import minidl as dl
from minidl.layers import Conv2d, Flatten, LayerContext, Linear, ReLU, SoftmaxCrossEntropy
from minidl.memory.planner import lower_bound
from minidl.optim import SGD
from minidl.testing import run_layer
from tests.planning import planned

from .test_cuda_host import FakeCudnn, _host_backend, _table_by_op

# Per graph: (workspace bytes, engine name, buildable), in the heuristics' order.
TABLES = {"conv_fprop": [(1 << 20, "f0", True), (4096, "f1", True), (0, "f2", True)],
          "conv_dgrad": [(1 << 19, "d0", True), (0, "d1", True)],
          "conv_wgrad": [(1 << 18, "w0", True), (0, "w1", True)]}


def convnet(batch=4):
    net = dl.Network("convnet")
    x = net.input((batch, 3, 16, 16), name="data")
    y = net.input((batch,), dtype="int64", name="label")
    h = ReLU(name="r0")(Conv2d(8, 3, padding=1, name="c0")(x))
    h = ReLU(name="r1")(Conv2d(8, 3, padding=1, name="c1")(h))
    h = Linear(5, name="fc")(Flatten(name="flat")(h))
    net.set_loss(SoftmaxCrossEntropy(name="loss")(h, y))
    return net


@pytest.fixture
def be():
    return _host_backend(FakeCudnn(plans=_table_by_op(TABLES)))


def test_the_route_lists_cudnn_plans_with_their_workspaces(be):
    route = convnet().route(optimizer_slots=("momentum",), menu=be)
    assert route.backend_name == "cuda"
    fwd = {s.name: s.workspace_options for s in route.forward_steps if s.workspace}
    assert set(fwd) == {"c0", "c1"}
    assert [(o.algo, o.workspace_bytes) for o in fwd["c0"]] == [("cudnn:f0", 1 << 20), ("cudnn:f1", 4096),
                                                                ("cudnn:f2", 0)]
    bwd = {s.name: s.workspace_options for s in route.backward_steps if s.workspace}
    # dgrad and wgrad share the step's workspace (max of the pair); dominated pairs are dropped
    assert [(o.algo, o.workspace_bytes) for o in bwd["c1"]] == [("cudnn:d0w0", 1 << 19), ("cudnn:d1w0", 1 << 18),
                                                                ("cudnn:d1w1", 0)]
    # cuDNN offers zero-workspace plans where the CPU's 3x3 convolutions need per-sample columns
    cpu_route = convnet().route(optimizer_slots=("momentum",))
    assert lower_bound(route) < lower_bound(cpu_route)


def test_workspace_sizing_picks_cudnn_plans_by_the_memory_free(be):
    net = convnet()
    opt = SGD(0.1, momentum=0.9)
    fast = planned(net, opt, "liveness", menu=be)
    steps = {s.label: sp for s, sp in zip(fast.route.steps, fast.steps)}
    assert steps["fwd c0"].algo == "cudnn:f0" and steps["fwd c0"].workspace_bytes == 1 << 20
    assert steps["bwd c1"].algo == "cudnn:d0w0" and steps["bwd c1"].workspace_bytes == 1 << 19
    # a budget below what the hungriest plan needs: each convolution gets the fastest plan that fits then
    tight = planned(net, opt, "auto", budget=fast.min_budget_bytes - (1 << 19), menu=be)
    tsteps = {s.label: sp for s, sp in zip(tight.route.steps, tight.steps)}
    assert tsteps["fwd c0"].algo in ("cudnn:f1", "cudnn:f2")
    assert tsteps["fwd c0"].refused and tsteps["fwd c0"].refused[0].startswith("cudnn:f0: needs 1.00 MiB")
    assert tight.min_budget_bytes <= fast.min_budget_bytes - (1 << 19)
    assert all(sp.algo is None or sp.algo.startswith("cudnn:") for sp in tight.steps)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the fake cuDNN writes no output: bias is added to garbage
def test_the_chosen_plan_reaches_the_backend(be):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    params = {"weight": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
              "bias": np.zeros(4, np.float32)}
    run_layer(Conv2d(4, 3, padding=1, name="c"), [x], params, backend=be, algo_fwd="cudnn:f1")
    (ex,) = be.cudnn.executions
    assert ex.index == 1 and ex.workspace != 0   # plan 1, with the 4096-byte workspace run_layer allocated
    with pytest.raises(ValueError, match=r"no fwd algorithm 'im2col'; have \['cudnn:f0'"):
        run_layer(Conv2d(4, 3, padding=1, name="c"), [x], params, backend=be, algo_fwd="im2col")
    # the layer hands algorithm names to the backend, which checks them against its own menu
    layer = Conv2d(4, 3, padding=1, name="c2")
    run_layer(layer, [x], params, backend=be, algo_fwd="cudnn:f2")
    with pytest.raises(ValueError, match="is not a CUDA convolution algorithm"):
        layer.forward(be, [x], np.empty((2, 4, 8, 8), np.float32), params,
                      LayerContext(workspace=np.zeros(1 << 20, np.uint8), algo="rows"))


@pytest.mark.parametrize("name,profile", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h100"),
                                          ("Tesla V100-SXM2-16GB", "v100"), ("Tesla K40c", "k40c"),
                                          ("NVIDIA GeForce GTX TITAN X", "titanx"), ("NVIDIA L4", "v100"),
                                          ("", "v100")])
def test_a_gpu_plans_with_its_nearest_simulator_profile(name, profile, be):
    from minidl.backend.cuda import cudnn_specs
    from minidl.memory.simulate import PROFILES

    assert cudnn_specs.profile_for_gpu(name) == profile and profile in PROFILES
    be.gpu_name = name
    assert be.profile == profile


def test_a_forks_later_convolution_plans_the_data_gradient_with_a_fused_add(be):
    """At a fork the later convolution's backward lists the dgrad_add graph's plans (the add in the data
    gradient's epilogue): no partial delta, no workspace for it; the others list plain dgrad's."""
    from minidl.models import build_model

    route = build_model("resnet", depth=8, batch=2, image_size=8, num_classes=4).route(
        optimizer_slots=("momentum",), menu=be)
    fork = [s for s in route.backward_steps if s.accumulates_into]
    assert fork and not [t for t in route.tensors if t.startswith("dpart:")]
    for s in fork:
        assert [(o.algo, o.workspace_bytes) for o in s.workspace_options] == [
            ("cudnn:d0w0", 1 << 19), ("cudnn:d1w0", 1 << 18), ("cudnn:d1w1", 0)]
    ops = [[op for op, _ in g.calls if op not in ("tensor",)][:2] for g in be.cudnn.graphs]
    assert ["conv_dgrad", "add"] in ops and ["conv_dgrad", "validate"] in ops
