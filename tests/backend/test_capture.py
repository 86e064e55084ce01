"""One CUDA graph per step (minidl/runtime/capture.py), tested on the host.

`GraphCPU` is the numpy backend with CUDA's capture semantics: between `begin_graph` and `end_graph` a backend
call is recorded, not run (and a host synchronization fails, as it does on a capturing stream); `launch_graph`
replays the recorded calls. So these tests see what is captured, what falls back and why, that the batch and
the loss go through the fixed staging buffers, that a replay runs the eager program's calls in their order, and
that the parameters after replays are bit-identical to the compiled eager loop's. The same on a GPU:
tests/backend/test_capture_gpu.py (`-m gpu`).
"""
from __future__ import annotations

import ctypes
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

import minidl as dl
from minidl.backend.cpu.backend import CPUBackend
from minidl.core.errors import DivergenceError
from minidl.models import build_model
from minidl.runtime.capture import CaptureRefused, GraphStep, split
from tests.planning import planned
from tests.sessions import session_kw

# Methods that are the capture machinery itself, or pure host helpers: never recorded.
_PASS = {"begin_graph", "end_graph", "launch_graph", "copy_in_async", "copy_out_async", "wait_compute",
         "host_empty", "paged_backing", "arena_backing", "conv_workspace_options", "name", "profile", "xp",
         "offload_async", "prefetch_async", "transfer_wait", "transfer_sync", "transfer_times", "prepare_graph",
         "compute_scope", "synchronize", "measure_link"}


class _Copy:
    """A stream copy's handle; one issued while capturing belongs to the graph (its events cannot be waited on
    or timed from the host: cudaErrorCapturedEvent)."""

    def __init__(self, captured: bool):
        self.captured = captured


def _dropout_dev(fn, gs, x, y, p, key):
    slot = gs.key_slot(key)
    return lambda: fn(x, y, p, int(slot[0]))


def _sgd_dev(fn, gs, p, g, buf, lr, momentum, dampening, wd, nesterov, first_step):
    slot = gs.lr_slot(lr)
    return lambda: None if gs.diverged[0] else fn(p, g, buf, float(slot[0]), momentum, dampening, wd, nesterov,
                                                   first_step=first_step)


def _adam_dev(fn, gs, p, g, m, v, lr, b1, b2, eps, wd, step):
    slot = gs.adam_slot(lr, step)
    return lambda: None if gs.diverged[0] else fn(p, g, m, v, float(slot[0]), b1, b2, eps, wd, int(slot[1]))


def _guard_dev(fn, gs, x, code):
    def run():
        if gs.diverged[0] == 0 and not np.isfinite(x).all():
            gs.diverged[0] = code
    return run


def _fill_scale_dev(fn, gs, dst, scale):
    slot = gs.scale_slot(scale)
    return lambda: fn(dst, float(slot[0]))


def _unscale_dev(fn, gs, g, inv_scale):
    slot = gs.inv_scale_slot(inv_scale)
    return lambda: fn(g, slot[0])


def _found_inf_dev(fn, gs, x):
    def run():
        if not np.isfinite(x).all():
            gs.found_inf[0] = 1
    return run


# The backend calls that read a device slot while captured (the CUDA backend's `_dev` kernels), emulated.
_DEV = {"dropout_forward": _dropout_dev, "dropout_backward": _dropout_dev, "sgd_update": _sgd_dev,
        "adam_update": _adam_dev, "guard_nonfinite": _guard_dev, "fill_loss_scale": _fill_scale_dev,
        "unscale": _unscale_dev, "found_inf_flag": _found_inf_dev}
_PASS.add("scalar_buffer")
_PASS.add("step_scope")  # host-side context of a whole step (the BLAS threads), not a kernel


class GraphCPU(CPUBackend):
    """CPUBackend with graph capture emulated: recorded calls replayed by `launch_graph`."""

    # As the CUDA backend it stands for: one update per parameter (its _dev kernels, above), copies on streams, half
    # operands computed without a planned float32 staging (its kernels grow their own here: a bind is host state).
    capabilities = replace(CPUBackend.capabilities, fused_update=False, stream_copies=True, graph_capture=True,
                           device_guard=True, half_staging=False)

    # What a call the capture cannot contain raises (the CUDA backend's: cupy's cuBLAS wrappers on a capturing
    # stream); the methods named in `uncapturable` raise it while capturing.
    CaptureUnsupported = (NotImplementedError,)

    def __init__(self, strays_during_capture: int = 0, device_guard: bool = True, uncapturable=()):
        self.uncapturable = frozenset(uncapturable)
        self.capturing: list | None = None
        self.graph_scalars = None
        self.capabilities = replace(type(self).capabilities, device_guard=device_guard)
        self.graphs: list[list] = []
        self.log: list[str] = []             # backend calls as they RUN (eager or replayed), by name
        self.stray_bytes = 0
        self._strays = strays_during_capture

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if name.startswith("_") or name in _PASS or not callable(attr) or name in ("capturing", "graphs", "log",
                                                                                    "uncapturable"):
            return attr
        if name == "to_host":
            def to_host(a):
                if object.__getattribute__(self, "capturing") is not None:
                    raise RuntimeError("cudaErrorStreamCaptureUnsupported: operation not permitted when stream "
                                       "is capturing")
                return attr(a)
            return to_host

        def call(*args, **kwargs):
            rec = object.__getattribute__(self, "capturing")
            gs = object.__getattribute__(self, "graph_scalars")
            if rec is not None and name in object.__getattribute__(self, "uncapturable"):
                raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")
            if gs is not None and name in _DEV:   # the `_dev` kernel: reads its slot when it runs
                dev = _DEV[name](attr, gs, *args, **kwargs)
                if rec is not None:
                    rec.append((name + "_dev", dev, (), {}))
                    return None
                object.__getattribute__(self, "log").append(name + "_dev")
                return dev()
            if rec is not None:
                rec.append((name, attr, args, kwargs))
                return None
            object.__getattribute__(self, "log").append(name)
            return attr(*args, **kwargs)
        return call

    def begin_graph(self):
        assert self.capturing is None, "capture begun twice"
        self.capturing = []
        self.stray_bytes += self._strays

    def end_graph(self):
        g, self.capturing = self.capturing, None
        self.graphs.append(g)
        return g

    def launch_graph(self, graph):
        for name, fn, args, kwargs in graph:
            self.log.append(name)
            fn(*args, **kwargs)

    def copy_in_async(self, dst, src):
        if self.capturing is not None:
            self.capturing.append(("copy_in", lambda: np.copyto(dst, src.reshape(dst.shape)), (), {}))
            return
        np.copyto(dst, src)

    def copy_out_async(self, src, dst):
        if self.capturing is not None:
            self.capturing.append(("copy_out", lambda: np.copyto(dst, src.reshape(dst.shape)), (), {}))
            return
        np.copyto(dst, src)

    def wait_compute(self):
        assert self.capturing is None

    # stream copies (the host store's StreamTransfers engine), captured like the rest
    def _copy(self, name, dst, src):
        if self.capturing is not None:
            self.capturing.append((name, lambda: np.copyto(dst, src), (), {}))
            return _Copy(True)
        self.log.append(name)
        np.copyto(dst, src)
        return _Copy(False)

    def offload_async(self, src, dst):
        return self._copy("offload", dst, src)

    def prefetch_async(self, src, dst):
        return self._copy("prefetch", dst, src)

    def transfer_wait(self, handle):
        pass   # one emulated stream: the recorded order is the dependency order

    def transfer_sync(self, handle):
        if handle.captured:
            raise RuntimeError("cudaErrorCapturedEvent: the event was recorded in a capturing stream")

    def transfer_times(self, handle):
        self.transfer_sync(handle)
        return 0.0, 0.0, 0.0

    def prepare_graph(self):
        pass   # nothing to load ahead of a capture here

    def guard_nonfinite(self, x, code):
        raise AssertionError("the device guard exists only inside a capture")

    def found_inf_flag(self, x):
        raise AssertionError("fp16's overflow flag exists only inside a capture")

    def scalar_buffer(self, name, n, dtype):
        return np.zeros(n, dtype)   # 'device' slots, apart from the pinned ones: only the graph's copy fills them

    def host_empty(self, shape, dtype):
        dt = np.dtype(dtype)   # garbage, as fresh pinned memory: tests must not depend on its contents
        return np.full(shape, np.iinfo(dt).max if dt.kind in "iu" else np.nan, dt)   # bf16's kind is 'V'


def _dropout_net(batch=4):
    from minidl.layers import Conv2d, Dropout, Linear, ReLU
    from models.common import finish, new_network

    net, x, y = new_network("drop", batch, 1, 8, 10, "float32")
    h = Dropout(0.5, name="drop")(ReLU(name="relu")(Conv2d(4, 3, padding=1, name="conv")(x)))
    return finish(net, Linear(10, name="fc")(h), y)


def _net(name="resnet", batch=4, **kw):
    if name == "dropout":
        return _dropout_net(batch)
    if name == "resnet":
        return build_model("resnet", depth=8, batch=batch, image_size=8, in_channels=1, num_classes=10, **kw)
    return build_model(name, batch=batch, image_size=8, in_channels=1, num_classes=10, **kw)


def _data(batch=4, steps=5, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, batch))
            for _ in range(steps)]


def _budget(policy, net="resnet"):
    """A budget that makes `policy` act: half-way between the liveness minimum and the policy's own floor."""

    if policy in ("none", "liveness"):
        return None
    live = planned(_net(net), dl.SGD(lr=0.05, momentum=0.9), "liveness").min_budget_bytes
    with pytest.raises(dl.BudgetError) as e:
        planned(_net(net), dl.SGD(lr=0.05, momentum=0.9), policy, 1)
    return (live + e.value.min_budget_bytes) // 2


def _train(backend, graphs=True, policy="liveness", opt=None, net="resnet", steps=5, lrs=None, **kw):
    if "budget" not in kw:
        kw["budget"] = _budget(policy, net)
    sess = dl.Session(_net(net), opt or dl.SGD(lr=0.05, momentum=0.9), policy=policy, seed=0, backend=backend,
                      **session_kw(kw))
    sess.executor.graph_fallback = None if graphs else "graphs=False"
    losses = []
    for k, (x, y) in enumerate(_data(steps=steps)):
        if lrs is not None:
            sess.optimizer.lr = lrs[k]
        losses.append(sess.executor.train_step(x, y))
    return sess, losses


def _params(sess):
    return {k: v.copy() for k, v in sess.executor.state_dict().items()}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_the_cpu_backend_runs_the_compiled_loop_and_says_why():
    sess, _ = _train(CPUBackend(), steps=1)
    ex = sess.executor
    assert ex.step_runner == "compiled" and ex.graph_step is None
    assert ex.graph_fallback.startswith("backend 'cpu' has no graph capture")


@pytest.mark.parametrize("kw, reason", [(dict(micro_batches=2), "micro-batches"),
                                        (dict(policy="compress", budget=None), "the sz codec"),
                                        (dict(policy="weights"), "a host update")])
def test_micro_batches_and_compression_run_the_compiled_loop_and_say_why(kw, reason):
    """Compiled, but not captured: the host reads each micro-batch's loss, the codec runs on the host, the weights'
    optimizer too (their step-0 swap-ins before the batch are no reason: the first graph holds them)."""
    sess, _ = _train(GraphCPU(), steps=2, **kw)
    ex = sess.executor
    assert ex.step_runner == "compiled" and reason in ex.graph_fallback


def test_replay_is_bit_identical_to_the_eager_loop():
    eager, le = _train(GraphCPU(), graphs=False)
    assert eager.executor.step_runner == "compiled" and eager.executor.graph_fallback == "graphs=False"
    be = GraphCPU()
    graph, lg = _train(be)
    ex = graph.executor
    assert ex.step_runner == "cuda graph" and ex.graph_fallback is None
    gs = ex.graph_step
    assert (gs.eager_steps, gs.captures, gs.replays) == (1, 1, 4)   # warm-up eager, then one capture replayed
    assert lg == le
    _same(_params(graph), _params(eager))
    # and both equal the plain CPU backend's compiled loop
    cpu, lc = _train(CPUBackend())
    assert lc == le
    _same(_params(cpu), _params(eager))


# The dense layer's calls, which cupy refuses to capture (cuBLAS): forward only, or forward and backward.
_CUBLAS = [(), ("linear_forward",), ("linear_forward", "linear_backward")]


@pytest.mark.parametrize("uncapturable", _CUBLAS)
def test_a_replay_runs_the_eager_calls_in_their_order(uncapturable):
    """Graphs and the calls run eagerly between them (`uncapturable`) launch in the program's order."""
    be = GraphCPU(uncapturable=uncapturable)
    sess, _ = _train(be, steps=1)           # the warm-up step: eager
    eager_log = list(be.log)
    be.log.clear()
    (x, y), = _data(steps=1, seed=1)
    sess.executor.train_step(x, y)          # captured, then replayed
    log = be.log
    keep_loss = [i for i in range(len(log) - 1) if log[i] == "copy" and log[i + 1] == "copy_out"]  # loss -> slot
    assert len(keep_loss) == 1
    replay = [n.removesuffix("_dev") for i, n in enumerate(log)
              if n not in ("copy_in", "copy_out", "guard_nonfinite_dev") and i not in keep_loss]
    # the eager step loads the batch with copy_in and reads the loss with to_host; the graph copies both
    # through its staging buffers (keeping the loss in a slot for the guard), checks the gradients on the device
    # (guard_nonfinite) and reads the learning rate from a device slot (sgd_update_dev).
    assert replay == [n for n in eager_log if n not in ("copy_in", "to_host")]
    assert be.log[:5] == ["copy_in"] * 5 and be.log[-1] == "copy_out"   # the scalar slots, data, labels; flag out
    guards = [i for i, n in enumerate(be.log) if n == "guard_nonfinite_dev"]
    updates = [i for i, n in enumerate(be.log) if n == "sgd_update_dev"]
    assert guards and max(guards) < min(updates)          # unfused: every check before any update


def test_the_batch_and_the_loss_go_through_fixed_buffers():
    be = GraphCPU()
    sess, _ = _train(be, steps=2)
    gs: GraphStep = sess.executor.graph_step
    staging = [id(b) for b in gs.staging]
    recorded = [rec for g in be.graphs for rec in g]
    copies_in = [r for r in recorded if r[0] == "copy_in"]
    assert len(copies_in) == 5           # dropout keys, optimizer scalars, the guard's flag, data, labels: once
    for x, y in _data(steps=3, seed=7):
        loss = sess.executor.train_step(x, y)
        assert np.array_equal(gs.staging[0], x) and np.array_equal(gs.staging[1], y)
        assert [id(b) for b in gs.staging] == staging          # the same buffers, refilled
        assert loss == float(gs.loss_host.reshape(-1)[0])       # read from the pinned loss buffer
    assert gs.captures == 1


@pytest.mark.parametrize("fused", [False, True])
def test_the_device_guard_stops_a_diverging_update_as_the_host_guard_does(fused):
    """One graph per step, the gradients checked on the device: a NaN batch raises the host guard's very error,
    and leaves the very state it leaves (unfused: nothing updated; fused: the layers updated before the first
    bad gradient), BN statistics put back, the iteration not counted."""
    x, y = _data(steps=1, seed=3)[0]
    bad = np.full_like(x, np.nan)
    outcomes = []
    for graphs in (True, False):
        sess, _ = _train(GraphCPU(), graphs=graphs, steps=2, fused_update=fused)
        ex = sess.executor
        with pytest.raises(DivergenceError) as e:
            ex.train_step(bad, y)
        outcomes.append((str(e.value), e.value.layer, ex.iteration, _params(sess), ex.optimizer_state()))
        if graphs:
            assert ex.graph_step.describe() == "cuda graph: 1 graph per step (divergence guard on the device)"
            ex.train_step(x, y)      # and training goes on from the last good state
            assert ex.iteration == 3
    (msg_g, layer_g, it_g, p_g, o_g), (msg_e, layer_e, it_e, p_e, o_e) = outcomes
    assert (msg_g, layer_g, it_g) == (msg_e, layer_e, it_e) and it_g == 2
    _same(p_g, p_e)
    _same(o_g, o_e)


@pytest.mark.parametrize("fused", [False, True])
def test_the_device_guard_checks_the_running_statistics_as_the_host_guard_does(fused):
    """A finite but huge batch (1e30) overflows a BN running variance while the loss and gradients stay finite:
    the device guard flags the statistic, and the host raises the host guard's error, with the last good step's
    statistics and parameters put back, in a graph and eagerly alike."""
    x, y = _data(steps=1, seed=3)[0]
    huge = np.full_like(x, 1e30)
    outcomes = []
    for graphs in (True, False):
        sess, _ = _train(GraphCPU(), graphs=graphs, steps=2, fused_update=fused)
        ex = sess.executor
        before = _params(sess)
        with pytest.raises(DivergenceError) as e:
            ex.train_step(huge, y)
        assert "running statistic" in str(e.value) and "running_var is not finite" in str(e.value)
        _same(_params(sess), before)
        outcomes.append((str(e.value), e.value.layer, ex.iteration))
        if graphs:
            assert ex.graph_step.describe() == "cuda graph: 1 graph per step (divergence guard on the device)"
    assert outcomes[0] == outcomes[1] and outcomes[0][2] == 2


def test_without_a_device_guard_the_guard_splits_the_step():
    be = GraphCPU(device_guard=False)
    sess, _ = _train(be, steps=2)
    gs = sess.executor.graph_step
    assert gs.describe() == ("cuda graph: 2 graphs per step (split where the divergence guard reads the loss and "
                             "gradients on the host before the update)")
    before = _params(sess)
    x, y = _data(steps=1)[0]
    with pytest.raises(DivergenceError):
        sess.executor.train_step(np.full_like(x, np.nan), y)
    _same(_params(sess), before)             # the update graph never ran
    sess.executor.check_finite = False       # no guard: one graph (re-captured: the signature names the guard)
    sess.executor.train_step(x, y)
    assert gs.describe() == "cuda graph: 1 graph per step" and gs.captures == 2


@pytest.mark.parametrize("case", [
    dict(lrs=[0.05, 0.04, 0.03, 0.02, 0.01]),                                  # a schedule: lr every step
    dict(net="dropout"),                                                        # a new key per step and layer
    dict(opt=dl.Adam(lr=1e-3)),                                                 # bias corrections per step
    dict(net="dropout", opt=dl.Adam(lr=1e-3), lrs=[1e-3, 2e-3, 3e-3, 4e-3, 5e-3]),
])
def test_per_step_scalars_come_from_device_slots(case):
    """The learning rate, dropout keys and Adam's step change at every step, yet one capture serves every
    replay: the graph copies the step's values into device slots that the `_dev` kernels read."""
    eager, le = _train(GraphCPU(), graphs=False, **case)
    be = GraphCPU()
    graph, lg = _train(be, **case)
    gs = graph.executor.graph_step
    assert graph.executor.step_runner == "cuda graph" and gs.captures == 1 and gs.replays == 4
    assert lg == le
    _same(_params(graph), _params(eager))
    ran = set(be.log)
    if case.get("net") == "dropout":
        assert {"dropout_forward_dev", "dropout_backward_dev"} <= ran
        assert int(gs.scalars.keys[0]) == graph.executor.seed_key(gs.program.keyed[0][1], 4)  # step 4's key
    assert ("adam_update_dev" if "opt" in case else "sgd_update_dev") in ran
    assert float(gs.scalars.optim[0]) == graph.optimizer.lr


@pytest.mark.parametrize("uncapturable", [(), ("linear_forward",)])
def test_a_hyper_parameter_change_recaptures_and_one_every_step_falls_back(uncapturable):
    def train(momenta, graphs=True):
        opt = dl.SGD(lr=0.05, momentum=0.9)
        sess = dl.Session(_net(), opt, seed=0, backend=GraphCPU(uncapturable=uncapturable),
                          config=dl.RunConfig(graphs=graphs))
        for m, (x, y) in zip(momenta, _data()):
            opt.momentum = m
            sess.executor.train_step(x, y)
        return sess
    once = [0.9, 0.9, 0.9, 0.8, 0.8]                 # one change: re-captured
    graph, eager = train(once), train(once, graphs=False)
    assert graph.executor.graph_step.captures == 2
    assert graph.executor.graph_step.eager_calls == len(uncapturable)   # the re-capture splits the same way
    _same(_params(graph), _params(eager))
    every = [0.9, 0.85, 0.8, 0.75, 0.7]               # a change at every step: the compiled loop, saying why
    graph, eager = train(every), train(every, graphs=False)
    ex = graph.executor
    assert ex.step_runner == "compiled" and "change at every step" in ex.graph_fallback
    _same(_params(graph), _params(eager))


@pytest.mark.parametrize("case,expect", [
    (dict(trace=True), "tracing"),
    (dict(policy="offload", host_limit_bytes="1GiB"), "host limit"),
    (dict(paged="64KiB"), "paged arena"),
    (dict(debug=True), "not compiled (debug mode"),
])
def test_what_cannot_be_captured_falls_back_saying_why(case, expect):
    case = dict(case)
    kw = {k: case.pop(k) for k in ("trace", "paged", "debug", "host_limit_bytes") if k in case}
    sess, _ = _train(GraphCPU(), steps=2, **case, **kw)
    ex = sess.executor
    assert ex.graph_step is None and expect in ex.graph_fallback, ex.graph_fallback


def test_an_allocation_during_capture_refuses_the_graph():
    eager, _ = _train(GraphCPU(), graphs=False)
    sess, _ = _train(GraphCPU(strays_during_capture=512))
    ex = sess.executor
    assert ex.step_runner == "compiled" and "allocated 512 bytes outside the arena" in ex.graph_fallback
    _same(_params(sess), _params(eager))


def test_split_keeps_host_calls_between_graphs():
    P = _program(list(range(7)), ["forward", "loss", "backward", "recompute_flops", "guard", "update", "update"])
    segs, hoisted, _ = split(P, ["in"], "out")
    assert [(s.calls, s.host) for s in segs] == [(["in", 0, "out", 2], None), ([], 4), ([5, 6], None)]
    assert hoisted == [3]
    segs, _, _ = split(P, ["in"], "out", guard=False)
    assert [s.calls for s in segs] == [["in", 0, "out", 2, 5, 6]]


def test_the_cuda_backend_launches_the_dev_kernels_while_capturing():
    """The real CUDABackend dispatch (host-emulated, as tests/backend/test_cuda_host.py): with `graph_scalars`
    set, dropout and the optimizers launch their `_dev` kernels with the slots' addresses; otherwise not."""
    from minidl.backend.scalars import StepScalars
    from tests.backend.test_cuda_host import FakeCudnn, _host_backend

    be = _host_backend(FakeCudnn())
    mem = SimpleNamespace(host_empty=lambda shape, dt: np.zeros(shape, dt),
                          scalar_buffer=lambda name, n, dt: np.zeros(n, dt))
    gs = StepScalars(mem, dropout_nodes=[3, 5])
    gs.fill([11, 22], lr=0.05, step=7)
    f = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    be.graph_scalars = gs
    be.dropout_forward(f(8), f(8), 0.5, 22)
    be.sgd_update(f(4), f(4), f(4), 0.05, 0.9, 0.0, 0.0, False, False)
    be.adam_update(f(4), f(4), f(4), f(4), 0.05, 0.9, 0.999, 1e-8, 0.0, 7)
    with pytest.raises(ValueError, match="learning rate 0.1 is not the step's value 0.05"):
        be.sgd_update(f(4), f(4), f(4), 0.1, 0.9, 0.0, 0.0, False, False)
    with pytest.raises(KeyError, match="dropout key 33"):
        be.dropout_backward(f(8), f(8), 0.5, 33)
    be.guard_nonfinite(f(6), 3)
    be.graph_scalars = None
    be.sgd_update(f(4), f(4), f(4), 0.05, 0.9, 0.0, 0.0, False, False)
    drop, sgd, adam, guard, plain = be.launches
    assert guard.name == "nonfinite_flag" and guard.args[0] is gs.diverged and int(guard.args[3]) == 3
    assert sgd.args[10] is gs.diverged and adam.args[10] is gs.diverged
    assert (drop.name, sgd.name, adam.name, plain.name) == ("dropout_forward_dev", "sgd_update_dev",
                                                            "adam_update_dev", "sgd_update")
    assert drop.args[3].base is gs.keys and drop.args[3].__array_interface__["data"][0] == gs.keys[1:].ctypes.data
    assert sgd.args[4].__array_interface__["data"][0] == gs.optim.ctypes.data and sgd.args[4].shape == (1,)
    assert adam.args[5].shape == (2,) and adam.args[5].__array_interface__["data"][0] == gs.optim.ctypes.data


def test_the_cuda_backend_reads_fp16s_loss_scale_from_its_slots_while_capturing():
    """fp16 in a graph on the real CUDABackend dispatch (host-emulated): the seed and the unscaling read the scale
    and its inverse from the slots (the values a replay writes), the overflow check sets `found_inf`; eager, the
    host's values, with the same bits."""
    from types import SimpleNamespace

    from minidl.backend.scalars import StepScalars
    from minidl.optim.loss_scale import LossScaler
    from tests.backend.test_cuda_host import FakeCudnn, _host_backend

    be = _host_backend(FakeCudnn())
    mem = SimpleNamespace(host_empty=lambda shape, dt: np.zeros(shape, dt),
                          scalar_buffer=lambda name, n, dt: np.zeros(n, dt))
    gs = StepScalars(mem, dropout_nodes=[])
    sc = LossScaler(scale=2.0 ** 10)
    gs.fill([], lr=0.1, step=1, scale=sc.scale, inv_scale=sc.inv_scale)
    for dev, host in gs.copies(loss_scale=True):   # what the graph's first node does
        dev[...] = host
    g = np.linspace(-3, 3, 6, dtype=np.float32)
    seeds, grads = [], []
    for scalars in (None, gs):
        be.graph_scalars = scalars
        seed, gg = np.zeros(3, np.float32), g.copy()
        be.fill_loss_scale(seed, sc.scale)
        be.unscale(gg, sc.inv_scale)
        seeds.append(seed)
        grads.append(gg)
    assert np.array_equal(seeds[0], seeds[1]) and seeds[0][0] == 1024.0
    assert np.array_equal(grads[0], grads[1]) and np.array_equal(grads[0], g * np.float32(2.0 ** -10))
    with pytest.raises(ValueError, match="loss scale 2048.0 is not the step's value 1024.0"):
        be.graph_scalars = gs
        be.fill_loss_scale(seed, 2048.0)
    be.found_inf_flag(g)
    flag = be.launches[-1]
    assert flag.name == "nonfinite_flag" and flag.args[0] is gs.found_inf and int(flag.args[3]) == 1


def test_host_copies_are_captured_and_counted_untimed():
    from minidl.memory.host import transfer_json

    eager, le = _train(GraphCPU(), graphs=False, policy="offload")
    be = GraphCPU()
    sess, lg = _train(be, policy="offload")
    ex = sess.executor
    assert ex.step_runner == "cuda graph", ex.graph_fallback
    assert lg == le
    _same(_params(sess), _params(eager))
    gs = ex.graph_step
    kinds = [k for g in be.graphs for k, *_ in g]
    assert "offload" in kinds and "prefetch" in kinds         # the copies are in the graph
    n = len(gs.copies)
    assert n and {k for k, _, _ in gs.copies} == {"offload", "prefetch"}
    assert ex.host.untimed_copies == n * gs.replays
    mine, theirs = transfer_json(ex.host, 5), transfer_json(eager.executor.host, 5)
    assert mine["offloaded_bytes"] == theirs["offloaded_bytes"] > 0                 # same bytes per step
    assert mine["transfer_hidden_fraction"] is None and mine["untimed_copies"] == n * 4
    ex.host.close()    # nothing captured is left outstanding: closing syncs nothing that belongs to a graph


def test_the_cuda_backend_graph_methods_use_the_compute_stream():
    """CUDABackend's capture, launch and staging copies (the real methods, over recording fakes of cupy's
    stream, graph and arrays): everything on the compute stream, nothing blocking but `wait_compute`."""
    from types import SimpleNamespace

    from minidl.backend.cuda import cudnn_specs, launches
    from minidl.backend.cuda.backend import CUDABackend

    log = []

    class Stream:
        def __init__(self, name):
            self.name, self.ptr = name, id(self)

        def begin_capture(self):
            log.append((self.name, "begin_capture"))

        def end_capture(self):
            log.append((self.name, "end_capture"))
            return graph

        def synchronize(self):
            log.append((self.name, "synchronize"))

    class Graph:
        def launch(self, stream=None):
            log.append((stream.name, "launch"))

    class Dev:
        def __init__(self, shape, dtype):
            self.shape, self.dtype, self.nbytes = shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize
            self.data = SimpleNamespace(ptr=id(self))

    class Runtime:  # cupy.cuda.runtime: the copies are cudaMemcpyAsync (cupy's set() refuses one while capturing)
        memcpyHostToDevice, memcpyDeviceToHost = 1, 2

        @staticmethod
        def memcpyAsync(dst, src, size, kind, stream_ptr):
            stream = ctypes.cast(stream_ptr, ctypes.py_object).value
            log.append((stream.name, {1: "h2d", 2: "d2h"}[kind], size))

    graph = Graph()
    compute = Stream("compute")
    be = CUDABackend.from_parts(cupy=SimpleNamespace(cuda=SimpleNamespace(runtime=Runtime)), cupyx=None, cudnn=None,
                                cublas=None, compute=compute,
                                transfer=Stream("d2h"), prefetch=Stream("h2d"), graphs=None, side=None,
                                limits=launches.DeviceLimits(1024, 80), filters=cudnn_specs.EngineFilters())
    be.begin_graph()
    be.copy_in_async(Dev((4, 3), np.float32), np.zeros((4, 3), np.float32))
    be.copy_out_async(Dev((1,), np.float32), np.zeros(1, np.float32))
    g = be.end_graph()
    be.launch_graph(g)
    be.wait_compute()
    assert log == [("compute", "begin_capture"), ("compute", "h2d", 48), ("compute", "d2h", 4),
                   ("compute", "end_capture"), ("compute", "launch"), ("compute", "synchronize")]
    with pytest.raises(ValueError, match="shapes and dtypes must match"):
        be.copy_in_async(Dev((4, 3), np.float32), np.zeros((3, 4), np.float32))


def test_a_host_call_between_a_copy_and_its_wait_refuses_the_split():
    P = _program(list(range(5)), ["offload", "guard", "update", "release", "backward"])
    with pytest.raises(CaptureRefused, match="between a host copy and its wait"):
        split(P, [], "out")
    segs, _, _ = split(P, [], "out", guard=False)
    assert [s.calls for s in segs] == [[0, 2, 3, 4]]


# -- calls the backend cannot capture (cupy's cuBLAS) run eagerly between graphs --------------------------------------
def _shape(gs):
    return ["graph" if s.graph is not None else "eager" if s.eager else "host" for s in gs.segments]


@pytest.mark.parametrize("uncapturable, shape", [
    (("linear_forward",), ["graph", "eager", "graph"]),
    (("linear_forward", "linear_backward"), ["graph", "eager", "graph", "eager", "graph"]),
])
def test_an_uncapturable_call_runs_eagerly_between_graphs_with_the_eager_loops_bits(uncapturable, shape):
    """The dense layer raises the backend's "cannot be captured" error while capturing (as cupy's cuBLAS does):
    the step becomes graph, eager call, graph, ..., and replays bit-identically to the compiled eager loop."""
    eager, le = _train(GraphCPU(), graphs=False)
    be = GraphCPU(uncapturable=uncapturable)
    graph, lg = _train(be)
    ex = graph.executor
    assert ex.step_runner == "cuda graph" and ex.graph_fallback is None
    gs = ex.graph_step
    assert _shape(gs) == shape and gs.eager_calls == len(uncapturable)
    assert (gs.eager_steps, gs.captures, gs.replays) == (1, 1, 4)
    assert [k for s in gs.segments if s.eager for k in s.kinds] == ["forward", "backward"][:len(uncapturable)]
    assert lg == le
    _same(_params(graph), _params(eager))
    kinds = "forward" if len(uncapturable) == 1 else "backward, forward"
    assert gs.describe() == (f"cuda graph: {len(shape) // 2 + 1} graphs per step (divergence guard on the device), "
                             f"{len(uncapturable)} call{'s' if len(uncapturable) > 1 else ''} ({kinds}) run "
                             f"eagerly between them (the backend cannot capture them: NotImplementedError: "
                             f"calling cuBLAS API during stream capture is currently unsupported)")
    recorded = {name for g in be.graphs for name, *_ in g}
    assert not recorded & set(uncapturable)          # no graph holds the uncapturable calls
    n = sum(be.log.count(name) for name in uncapturable)
    assert n == 5 * len(uncapturable)                # one per step, warm-up and replays alike


def test_an_eager_call_reads_the_step_scalars_from_the_device_slots():
    """Eager calls between graphs keep `graph_scalars` set: an update or dropout the backend cannot capture
    launches its `_dev` variant, reading this step's learning rate and key from the slots the step's first graph
    filled (bit-identical under a schedule), and an update skips once the device guard has flagged a NaN, as
    the captured one does (a plain update kernel would apply it)."""
    case = dict(net="dropout", lrs=[0.05, 0.04, 0.03, 0.02, 0.01])
    uncapturable = ("dropout_forward", "dropout_backward", "sgd_update")
    eager, le = _train(GraphCPU(), graphs=False, **case)
    be = GraphCPU(uncapturable=uncapturable)
    graph, lg = _train(be, **case)
    gs = graph.executor.graph_step
    assert gs.captures == 1 and gs.replays == 4 and gs.eager_calls >= 3
    recorded = {name for g in be.graphs for name, *_ in g}
    assert not recorded & {"dropout_forward_dev", "dropout_backward_dev", "sgd_update_dev"}
    assert {"dropout_forward_dev", "dropout_backward_dev", "sgd_update_dev"} <= set(be.log)  # eager, from slots
    assert lg == le
    _same(_params(graph), _params(eager))
    before = _params(graph)
    x, y = _data(steps=1, seed=3)[0]
    with pytest.raises(DivergenceError):
        graph.executor.train_step(np.full_like(x, np.nan), y)
    _same(_params(graph), before)


class _Recording:
    """A capturing backend reduced to what `record` uses: calls append their name to the graph being captured."""

    CaptureUnsupported = (NotImplementedError,)

    def __init__(self):
        self.stray_bytes, self.on = 0, None

    def begin_graph(self):
        assert self.on is None
        self.on = []

    def end_graph(self):
        g, self.on = self.on, None
        return g

    def call(self, name, allocates=0, cublas=False):
        def run():
            self.stray_bytes += allocates
            self.on.append(name)
            if cublas:
                raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")
        return run


def _program(calls, kinds, prologue=(), prologue_kinds=()):
    return SimpleNamespace(calls=calls, call_kinds=kinds, prologue=list(prologue), prologue_kinds=list(prologue_kinds))


def test_record_drops_the_failing_calls_part_and_captures_around_it():
    """One pass: the attempt holding part of the failing call's work is dropped (its allocation with it), the
    calls before it captured again, the call made eager; consecutive eager calls share one segment."""
    from minidl.runtime.capture import record

    be = _Recording()
    c = be.call
    calls = [c("a"), c("b"), c("lin", allocates=64, cublas=True), c("lin2", cublas=True), c("d"), c("e")]
    segs, _, _ = split(_program(calls, ["forward"] * 6), [c("in")], c("out"))
    out, copies = record(be, segs)
    assert [(s.graph, s.eager, s.kinds) for s in out] == [
        (["in", "a", "b"], False, ["copy_in", "forward", "forward"]),
        (None, True, ["forward", "forward"]),
        (["d", "e"], False, ["forward", "forward"])]
    assert out[1].calls == calls[2:4] and copies == []
    assert out[1].reason == "NotImplementedError: calling cuBLAS API during stream capture is currently unsupported"
    segs, _, _ = split(_program([c("a", allocates=8)], ["forward"]), [], c("out"))
    with pytest.raises(CaptureRefused, match="cupy allocated 8 bytes"):
        record(be, segs)   # an allocation inside a kept graph still refuses it


def test_an_uncapturable_call_between_a_copy_and_its_wait_refuses_the_capture():
    from minidl.runtime.capture import record

    be = _Recording()
    c = be.call
    kinds = ["forward", "offload", "forward", "release", "forward"]
    calls = [c("a"), c("off"), c("lin", cublas=True), c("rel"), c("b")]
    segs, _, _ = split(_program(calls, kinds), [], c("out"))
    with pytest.raises(CaptureRefused) as e:
        record(be, segs)
    assert str(e.value) == ("a forward call the backend cannot capture (NotImplementedError: calling cuBLAS API "
                            "during stream capture is currently unsupported) falls between a host copy and its "
                            "wait, where it cannot run between graphs (a graph must end with its copies joined)")
    assert be.on is None                                   # the capture was ended
    calls[2] = c("lin")                                    # after the wait it may run eagerly
    calls[4] = c("lin", cublas=True)
    out, _ = record(be, split(_program(calls, kinds), [], c("out"))[0])
    assert [s.graph for s in out] == [["a", "off", "lin", "rel"], None]


def _half_train(backend, math, graphs, batches, scaler=None):
    sess = dl.Session(_net(), dl.SGD(lr=0.05, momentum=0.9), policy="liveness", seed=0, backend=backend, math=math)
    ex = sess.executor
    ex.graph_fallback = None if graphs else "graphs=False"
    if scaler is not None:
        ex.scaler = scaler
    skips = []
    for x, y in batches:
        ex.train_step(x, y)
        skips.append(ex.skip_update)
    return sess, skips


@pytest.mark.parametrize("math", ["bf16", "fp16"])
def test_half_precision_steps_replay_with_the_eager_loops_bits(math):
    """bf16 and fp16 steps are one graph: the weight copies rewritten in it, fp16's loss scale and its inverse read
    from device slots (the seed, the unscaled gradients), an overflow found on the device skips the updates and
    the host backs the scale off after the replay. A scale that doubles after every good step overflows fp16 on
    some steps: the same skips, scales and parameters as the compiled eager loop's."""
    from minidl.optim.loss_scale import LossScaler

    data = _data(steps=7)
    runs = []
    for graphs in (False, True):
        scaler = LossScaler(scale=2.0 ** 16, growth_interval=1) if math == "fp16" else None
        sess, skips = _half_train(GraphCPU(), math, graphs, data, scaler)
        ex = sess.executor
        runs.append((skips, None if scaler is None else scaler.state_dict(), _params(sess)))
        if graphs:
            assert ex.step_runner == "cuda graph", ex.graph_fallback
            assert ex.graph_step.describe() == "cuda graph: 1 graph per step (divergence guard on the device)"
            assert ex.graph_step.replays == len(data) - 1
    (s_e, sc_e, p_e), (s_g, sc_g, p_g) = runs
    assert s_g == s_e and sc_g == sc_e
    if math == "fp16":
        assert any(s_e) and not all(s_e), s_e   # the test exercises both: skipped and applied updates
    _same(p_g, p_e)


def test_fp16_without_the_device_guard_runs_the_compiled_loop_and_says_why():
    sess, _ = _half_train(GraphCPU(device_guard=False), "fp16", True, _data(steps=2))
    assert sess.executor.step_runner == "compiled"
    assert "fp16" in sess.executor.graph_fallback and "device" in sess.executor.graph_fallback


def test_step_zeros_events_open_the_first_graph_before_the_batch():
    """The prologue (events bound before step 0, e.g. weights swapped in) is captured first, then the batch, in
    the eager loop's order; a copy it leaves in flight counts toward the first graph's joins."""
    calls = {name: (lambda: None) for name in ("pre", "wait", "fwd", "loss", "in")}
    program = _program([calls["fwd"], calls["loss"]], ["forward", "loss"], [calls["pre"], calls["wait"]],
                       ["prefetch", "wait"])
    segments, hoisted, after = split(program, [calls["in"]], calls["loss"])
    assert len(segments) == 1 and not hoisted and not after
    assert segments[0].kinds == ["prefetch", "wait", "copy_in", "forward", "copy_out"]
    assert segments[0].calls[:3] == [calls["pre"], calls["wait"], calls["in"]]
    open_copy = _program([calls["fwd"], calls["wait"]], ["guard", "wait"], [calls["pre"]], ["prefetch"])
    with pytest.raises(CaptureRefused, match="between a host copy and its wait"):
        split(open_copy, [calls["in"]], calls["loss"])
