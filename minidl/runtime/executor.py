"""The executor: runs a plan on a backend, one route step at a time (`before` events, compute, `after` events).

Rules: every array a kernel sees is a view into the pool's arena at the plan's offset, and the pool checks each
placement (overlapping live tensors fail loudly). A kernel is handed only resident tensors, else `ResidencyError`
names the tensor and step. Debug mode poisons freed blocks with NaN, so an undeclared read shows.
"""
from __future__ import annotations

import time
from contextlib import ExitStack

import numpy as np

from ..backend import backend_name
from ..backend.precision import check_half_kernels, is_half, precision
from ..core import startup
from ..core.errors import CheckpointError, DivergenceError, OptionError, ResidencyError
from ..core.guards import check_images, check_step
from ..core.tensors import (
    Role,
    act_id,
    aux_id,
    compressed_id,
    compressed_source,
    delta_id,
    grad_id,
    micro_id,
    opt_state_id,
    param_id,
)
from ..core.vocab import TraceEvent
from ..graph.network import Network
from ..graph.route import Phase, Step
from ..layers.base import LayerContext
from ..layers.init import initial_values, param_rng
from ..memory.plan import Event, EventKind, Plan
from ..memory.pool import NumpyArenaBacking, TensorPool
from ..optim import Optimizer
from ..optim.loss_scale import LossScaler
from .binding import BoundCall, GuardCall, LayerCall, Sink, UnscaleCall, run_now
from .capture import CaptureRefused, graph_step
from .program import NotLowered, Program, lower

_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def dropout_key(seed: int, node_index: int, iteration: int) -> int:
    """A 64-bit key per (run, layer, iteration): the mask of a dropout layer is a pure function of it."""
    return (seed * _MIX[0] + (node_index + 1) * _MIX[1] + (iteration + 1) * _MIX[2]) & 0xFFFFFFFFFFFFFFFF


class Executor:
    """Trains a network by replaying a plan. Construct once; call `train_step` per batch."""

    def __init__(self, net: Network, plan: Plan, optimizer: Optimizer, backend=None, seed: int = 0,
                 debug: bool = False, trace: bool = False, host_limit_bytes: int | None = None,
                 compiled: bool = True, comm=None, graphs: bool = True):
        """`compiled`: replay the first step's recorded calls (program.py); `graphs`: as CUDA graphs (capture.py);
        `program_fallback` / `graph_fallback` say why not. `comm`: the data-parallel ranks."""
        from ..backend.cpu.backend import CPUBackend

        if plan.route.network is not net:
            raise OptionError("the plan was made for another network")
        if tuple(optimizer.slots) != plan.route.optimizer_slots:
            raise OptionError(f"the plan's route was built for optimizer slots {plan.route.optimizer_slots}, "
                              f"but the optimizer keeps {tuple(optimizer.slots)}")
        self.net, self.plan, self.route, self.opt = net, plan, plan.route, optimizer
        self.be = backend or CPUBackend()
        be_name = backend_name(self.be)
        if be_name != plan.route.backend_name and any(s.workspace is not None for s in plan.route.steps):
            raise OptionError(f"the plan chose convolution algorithms from backend '{plan.route.backend_name}''s "
                              f"menu but runs on backend '{be_name}': plan for the backend it runs on, "
                              f"plan_network(..., Target.for_run(backend=<that backend>))")
        for n in net.layer_nodes:
            missing = [op for op in n.layer.backend_ops() if op not in self.be.capabilities.kernels]
            if missing:
                raise OptionError(f"{n.layer.describe()} cannot run on backend '{be_name}': its kernels "
                                  f"({', '.join(missing)}) are not yet written for that backend; run this network "
                                  f"on backend 'cpu'")
        check_half_kernels([n.layer for n in net.layer_nodes], self.be, self.route.math)
        self.precision = precision(self.route.math)
        # fp16's dynamic loss scale (`optim/loss_scale.py`): the loss's gradient starts at its scale, the gradients
        # are unscaled before the update, and a step whose gradients overflow is skipped (`skip_update`)
        self.scaler = LossScaler() if self.precision.loss_scaling else None
        self.skip_update = False
        # a half mode on a backend whose half kernels stage float32 copies: each layer call binds its step's
        # staging tensor first (`Step.staging`; None: the backend grows its own, for calls that stage nothing)
        self.stages = self.precision.half is not None and self.be.capabilities.half_staging
        if be_name != "cpu" and any(sp.on_host for sp in plan.steps):
            raise OptionError("the plan updates weights on the host, which runs on the CPU backend only (on a GPU "
                              "the host would have to wait for each gradient's copy): plan without a host update")
        self.seed, self.debug, self.tracing = int(seed), debug, trace
        self.iteration = 0
        self.training = True
        if plan.paged is not None and not self.be.capabilities.paged_arena:
            raise OptionError(f"the plan is paged (--paged) but backend '{be_name}' has no paged arena")
        with startup.phase("arena"):
            self.pool = self._make_pool(plan)
        self.views: dict[str, np.ndarray] = {}
        self._forward_step_of = {st.node: st.index for st in self.route.steps if st.phase is Phase.FORWARD}
        self.offsets: dict[str, int] = {}
        self._t0 = time.perf_counter()  # trace events are timed from it
        self.trace: list[TraceEvent] = []
        # traced calls: (label, step, bytes in use, start mark, end mark)
        self.call_clock = self.be.call_clock() if trace else None
        self.timed_calls: list[tuple] = []
        for ev in plan.setup:
            self._alloc(ev, None)
        self._aux_names = {n.index: list(n.layer.aux_specs([net.nodes[i].shape for i in n.inputs], True))
                           for n in net.layer_nodes}
        self._handlers = {EventKind.ALLOC: self._alloc, EventKind.FREE: self._free,
                          EventKind.OFFLOAD: self._offload, EventKind.RELEASE: self._release,
                          EventKind.PREFETCH: self._prefetch, EventKind.WAIT: self._wait,
                          EventKind.RECOMPUTE: self._recompute,
                          EventKind.ALLREDUCE: self._allreduce, EventKind.REDUCED: self._reduced,
                          EventKind.COMPRESS: self._compress, EventKind.DECOMPRESS: self._decompress}
        self.reducer = None  # data parallel
        if plan.buckets:
            from ..dist.comm import Communicator
            from ..dist.reducer import GradientReducer

            self.reducer = GradientReducer(comm or Communicator(), self.be, self._t0,
                                           self.trace if trace else None, plan.data_parallel.reduction)
        self.compressed = None  # created on the first COMPRESS
        self.host = None  # created on the first offload
        self.host_limit_bytes = host_limit_bytes
        self.recomputed_flops = 0
        self.last_loss = float("nan")
        self._logits: np.ndarray | None = None
        self.compiled = compiled
        self.program: Program | None = None
        self.program_fallback: str | None = None if compiled else "compiled=False"
        self.graph_step = None  # capture.GraphStep
        self.graph_fallback: str | None = None if graphs else "graphs=False"
        with startup.phase("arena"):
            self._init_persistent()
        self._stepped = False  # the first step closes the startup clock
        self.check_finite = True  # the divergence guard; off only to measure its cost
        # (layer, parameter, gradient id) in backward order
        self._grads_backward = [(self.net.nodes[st.node].name, p, grad_id(self.net.nodes[st.node].name, p))
                                for st in self.route.steps if st.phase is Phase.BACKWARD
                                for p, spec in self.net.nodes[st.node].params.items() if spec.trainable]
        self._buffers = [param_id(n.name, p) for n in net.layer_nodes for p, s in n.params.items()
                         if not s.trainable]
        # (layer, buffer, id) the forward updates, checked at the first UPDATE
        self._guarded_buffers = [(n.name, p, param_id(n.name, p)) for n in net.layer_nodes
                                 for p, s in n.params.items()
                                 if not s.trainable and np.issubdtype(self.route.tensors[param_id(n.name, p)].dtype,
                                                                      np.floating)]
        updates = [st.index for st in self.route.steps if st.phase is Phase.UPDATE]
        self._first_update = min(updates) if updates else None

    def _make_pool(self, plan: Plan):
        """The plan's arena: placed by chunks behind virtual ranges (a paged plan), else one block."""
        if plan.paged is not None:
            from ..memory.paged import PagedPool

            return PagedPool(plan.arena_bytes, plan.paged.chunk_bytes, plan.paged.virtual_bytes,
                             self.be.paged_backing())
        return TensorPool(plan.arena_bytes, backing=self.be.arena_backing() or NumpyArenaBacking())

    # -- parameters
    def _init_persistent(self) -> None:
        for n in self.net.layer_nodes:
            for pname, spec in n.params.items():
                tid = param_id(n.name, pname)
                values = initial_values(spec, param_rng(self.seed, f"{n.name}.{pname}"),
                                        self.route.tensors[tid].dtype)
                self._set_persistent(tid, values)
                for slot in self.route.optimizer_slots if spec.trainable else ():
                    sid = opt_state_id(n.name, pname, slot)
                    self._set_persistent(sid, np.zeros(spec.shape, self.route.tensors[sid].dtype))
        self._set_copies()

    def _set_copies(self) -> None:
        """Each half copy of a master weight, rounded from the master's value (a half mode; after the masters were
        initialized or loaded)."""
        for master, copy in self.route.copies.items():
            values = self._get_persistent(master)
            if copy in self.views:
                self.be.copy_in(self.views[copy], values)
            else:   # homed on the host with its master (decisions/weights.py): its host value, rounded there
                rounded = np.empty(values.shape, self.route.tensors[copy].dtype)
                self._host_backend().copy(rounded, values)
                self._host().store(copy, rounded)

    def _set_persistent(self, tid: str, values: np.ndarray) -> None:
        """Write a persistent tensor where it lives between steps: its block, or the host store."""
        if tid in self.views:
            self.be.copy_in(self.views[tid], values)
        else:
            self._host().store(tid, values)

    def _get_persistent(self, tid: str) -> np.ndarray:
        """A host copy of a persistent tensor, wherever it lives."""
        if tid in self.views:
            return np.array(self.be.to_host(self.views[tid]))
        return np.array(self._host().host_copy(tid))

    def state_dict(self) -> dict[str, np.ndarray]:
        return {f"{n.name}.{p}": self._get_persistent(param_id(n.name, p))
                for n in self.net.layer_nodes for p in n.params}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        return {f"{n.name}.{p}.{s}": self._get_persistent(opt_state_id(n.name, p, s))
                for n in self.net.layer_nodes for p, spec in n.params.items() if spec.trainable
                for s in self.route.optimizer_slots}

    def load_state_dict(self, state: dict[str, np.ndarray], optimizer_state: dict[str, np.ndarray] | None = None,
                        strict: bool = True) -> None:
        expected = {f"{n.name}.{p}": (param_id(n.name, p), spec.shape) for n in self.net.layer_nodes
                    for p, spec in n.params.items()}
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if strict and (missing or unexpected):
            raise CheckpointError(f"state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for key, (tid, shape) in expected.items():
            if key in state:
                arr = np.asarray(state[key])
                if tuple(arr.shape) != tuple(shape):
                    raise CheckpointError(f"{key}: expected shape {shape}, got {arr.shape}")
                self._set_persistent(tid, arr)
        for key, arr in (optimizer_state or {}).items():
            layer, p, s = key.rsplit(".", 2)
            self._set_persistent(opt_state_id(layer, p, s), np.asarray(arr))
        self._set_copies()

    # -- events: bookkeeping now, calls to the sink (binding.py)
    def _alloc(self, ev: Event, step: Step | None = None, sink: Sink = run_now) -> None:
        spec = self.route.tensors.get(ev.tensor)
        self.pool.alloc_at(ev.offset, ev.nbytes, tag=ev.tensor)
        self.offsets[ev.tensor] = ev.offset
        if spec is None or spec.role is Role.WORKSPACE:
            self.views[ev.tensor] = self.pool.view(ev.offset, (ev.nbytes,), np.uint8)
        else:
            self.views[ev.tensor] = self.pool.view(ev.offset, spec.shape, spec.dtype)

    def _free(self, ev: Event, step: Step | None = None, sink: Sink = run_now) -> None:
        view = self.views.pop(ev.tensor)
        if self.debug and np.issubdtype(view.dtype, np.floating):
            # poison through the backend: ordered after the offload the RELEASE waited for
            sink(BoundCall("poison", self.be.fill, (view, np.nan), step))
        self.pool.free(self.offsets.pop(ev.tensor))

    def bind_events(self, events: list[Event], step: Step, sink: Sink) -> None:
        """Apply `events` at `step`: bookkeeping now, calls to `sink`, in order."""
        for ev in events:
            handler = self._handlers.get(ev.kind)
            if handler is None:
                raise OptionError(f"plan '{self.plan.policy}' has an event of kind "
                                  f"'{getattr(ev.kind, 'value', ev.kind)}' at step {step.index} ({step.label}), "
                                  f"which this executor has no handler for")
            handler(ev, step, sink)

    def add_event_handler(self, kind, handler) -> None:
        """`handler(event, step, sink)` for `kind`, handing `BoundCall`s to `sink`: so it runs compiled too."""
        self._handlers[kind] = handler

    def _apply(self, events: list[Event], step: Step) -> None:
        self.bind_events(events, step, run_now)

    # Offload to the host store and prefetch back on the transfer engine.
    def _host(self):
        if self.host is None:
            from ..memory.host import HostStore

            self.host = HostStore(limit_bytes=self.host_limit_bytes, t0=self._t0, backend=self.be,
                                  trace=self.trace if self.tracing else None)
        return self.host

    def _offload(self, ev: Event, step: Step, sink: Sink) -> None:
        sink(BoundCall("offload", self._host().offload, (ev.tensor, self.get(ev.tensor, step), step.index), step))

    def _release(self, ev: Event, step: Step, sink: Sink) -> None:
        sink(BoundCall("release", self._host().wait_offload, (ev.tensor,), step))
        self._free(ev, step, sink)

    def _prefetch(self, ev: Event, step: Step, sink: Sink) -> None:
        self._alloc(ev, step)
        sink(BoundCall("prefetch", self._host().prefetch, (ev.tensor, self.views[ev.tensor], step.index), step))

    def _wait(self, ev: Event, step: Step, sink: Sink) -> None:
        sink(BoundCall("wait", self._host().wait_prefetch, (ev.tensor,), step))

    def _recompute(self, ev: Event, step: Step, sink: Sink) -> None:
        self._alloc(ev, step)
        node = self.net.node(self.route.tensors[ev.tensor].owner)
        fake = Step(step.index, Phase.FORWARD, node.index, node.name, [], [])
        sp = self.plan.steps[self._forward_step_of[node.index]]
        self.bind_compute(fake, sp, sink, recompute=True)
        in_shapes = [self.net.nodes[i].shape for i in node.inputs]
        sink(BoundCall("recompute_flops", self._count_recomputed, (node.layer.flops(in_shapes, node.shape),), step))

    def _count_recomputed(self, flops: int) -> None:
        self.recomputed_flops += flops

    def _allreduce(self, ev: Event, step: Step, sink: Sink) -> None:
        grads = [self.get(g, step) for g in self.plan.buckets[ev.tensor]]
        sink(BoundCall("allreduce", self.reducer.start, (ev.tensor, self.get(ev.tensor, step), grads, step.index),
                       step))

    def _reduced(self, ev: Event, step: Step, sink: Sink) -> None:
        grads = [self.get(g, step) for g in self.plan.buckets[ev.tensor]]
        sink(BoundCall("reduced", self.reducer.finish, (ev.tensor, self.get(ev.tensor, step), grads, step.index),
                       step))

    # Lossy compression of stored activations (decisions/compress.py).
    def _zstore(self):
        if self.compressed is None:
            from ..memory.compressed import CompressedStore
            from ..memory.decisions.compress import backward_readers

            readers = {t: r for t, r in backward_readers(self.route).items() if r}
            self.compressed = CompressedStore(readers, backend=self.be)
        return self.compressed

    def _compress(self, ev: Event, step: Step, sink: Sink) -> None:
        self._alloc(ev, step)
        if self.training:  # nothing reads it after evaluate()
            src = compressed_source(ev.tensor)
            sink(BoundCall("compress", self._zstore().compress, (src, self.get(src, step), self.views[ev.tensor]),
                           step))

    def _decompress(self, ev: Event, step: Step, sink: Sink) -> None:
        self._alloc(ev, step)
        sink(BoundCall("decompress", self._zstore().decompress,
                       (ev.tensor, self.views[ev.tensor], self.get(compressed_id(ev.tensor), step)), step))

    def get(self, tid: str, step: Step) -> np.ndarray:
        try:
            return self.views[tid]
        except KeyError:
            raise ResidencyError(f"step {step.index} ({step.label}) needs tensor '{tid}', which is not resident "
                                 f"on the device at that point of plan '{self.plan.policy}'") from None

    # -- running
    def batch_slots(self, step: Step) -> list[tuple[np.ndarray, int, int | None, int | None]]:
        """(arena view, input k, first sample, end) per batch slot; micro-batch m is samples [m b, (m + 1) b)."""
        M = self.route.micro_batches
        slots = []
        for k, node in enumerate(self.net.input_nodes[:2]):
            if self.route.packing is None:
                slots.append((self.get(act_id(node.name), step), k, None, None))
                continue
            b = node.shape[0] // M
            slots.extend((self.get(micro_id(act_id(node.name), m), step), k, m * b, (m + 1) * b) for m in range(M))
        return slots

    def _load_batch(self, x: np.ndarray, y: np.ndarray, step: Step) -> None:
        arrays = (x, y)
        for view, k, lo, hi in self.batch_slots(step):
            self.be.copy_in(view, arrays[k] if lo is None else arrays[k][lo:hi])

    def seed_key(self, node_index: int, iteration: int) -> int:
        return dropout_key(self.seed, node_index, iteration)

    def staged(self, fn, staging):
        """`fn` (a layer's call), binding the step's staging first where the backend stages half operands
        (`stages`): every layer call binds its own (None for one that stages nothing), so none can run on a block
        another step's tensors now occupy. Else `fn` itself."""
        if not self.stages:
            return fn
        bind = self.be.staging.bind

        def call(*args):
            bind(staging)
            fn(*args)
        return call

    def check_batch(self, x, y) -> tuple[np.ndarray, np.ndarray]:
        """The batch checked before any use (exact shapes, integer labels in [0, classes)), else `DataError`:
        never converted."""
        nodes = self.net.input_nodes
        x = check_images(x, f"input '{nodes[0].name}'", nodes[0].shape)
        for c in nodes[0].consumers:  # token indices
            self.net.nodes[c].layer.check_batch_input(self.net.nodes[c].inputs.index(nodes[0].index), x,
                                                      f"input '{nodes[0].name}'")
        if len(nodes) > 1:
            loss = self.net.loss_node.layer
            y = loss.check_label_values(y, self.net.logits_node.shape[-1], f"input '{nodes[1].name}'",
                                        nodes[1].shape)
        return x, y

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        """One training step; returns the loss. A non-finite loss or gradient raises `DivergenceError` before the
        update, the buffers put back: the executor is as if the step never ran."""
        x, y = self.check_batch(x, y)
        buffers = {tid: self._get_persistent(tid) for tid in self._buffers}
        persistent = set(self.offsets)
        try:
            with self._step_scope():
                if self._stepped or not startup.CLOCK.running:
                    return self._train_step(x, y)
                return self._first_step(x, y)
        except DivergenceError:
            if self.timed_calls:
                self.settle_calls()
            if self.host is not None:
                self.host.end_iteration()
            for tid in [t for t in self.offsets if t not in persistent]:
                self._free(Event(EventKind.FREE, tid))
            for tid, arr in buffers.items():
                self._set_persistent(tid, arr)
            raise

    def _first_step(self, x: np.ndarray, y: np.ndarray) -> float:
        """The first step, timed to its end on the device, closing the startup clock."""
        with startup.phase("first_step"):
            loss = self._train_step(x, y)
            self.be.synchronize()
        self._stepped = True
        startup.CLOCK.first_step_done()
        return loss

    def _step_scope(self) -> ExitStack:
        """The backend's step context, numpy's float warnings off: the divergence guard reports those values by
        step and layer."""
        scope = ExitStack()
        scope.enter_context(self.be.step_scope())
        scope.enter_context(np.errstate(over="ignore", invalid="ignore", divide="ignore"))
        return scope

    def guard_grads(self, step: Step) -> list[tuple[str, str, np.ndarray]]:
        """(layer, parameter, gradient array) the UPDATE `step` applies, in backward order."""
        return [(layer, p, self.get(gid, step)) for layer, p, gid in self._guarded(step)]

    def guard_buffers(self, step: Step) -> list[tuple[str, str, np.ndarray]]:
        """(layer, buffer, array): the running statistics, at the step's first update only."""
        if step.index != self._first_update:
            return []
        return [(layer, b, self.get(tid, step)) for layer, b, tid in self._guarded_buffers]

    def _guarded(self, step: Step) -> list[tuple[str, str, str]]:
        names = None if step.node is None else {self.net.nodes[step.node].name}
        return [(layer, p, gid) for layer, p, gid in self._grads_backward if names is None or layer in names]

    def guard_update(self, step: Step, grads: list | None = None, buffers: list | None = None) -> None:
        """Before every UPDATE: the loss, its gradients and the running statistics must be finite (with fused
        updates, later layers are already applied: the message says so)."""
        if not self.check_finite:
            return
        if self.skip_update:   # fp16: gradients that overflowed the loss scale skip the step, not a divergence
            grads = []
        elif grads is None:
            grads = self.guard_grads(step)
        if buffers is None:
            buffers = self.guard_buffers(step)
        try:
            check_step(self.be, self.iteration, self.last_loss, grads, buffers)
        except DivergenceError as e:
            done = [self.net.nodes[s.node].name for s in self.route.steps
                    if s.phase is Phase.UPDATE and s.node is not None and s.index < step.index]
            if done:
                e.args = (f"{e} (fused updates had already been applied this step to: {', '.join(done[:8])}"
                          f"{' ...' if len(done) > 8 else ''})",)
            raise

    def _train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        self.training = True
        if self.program is None and self.program_fallback is None:
            try:
                self.program = lower(self)
            except NotLowered as e:
                self.program_fallback = str(e)
                self.graph_fallback = self.graph_fallback or f"the step is not compiled ({e})"
        if self.program is not None:
            if self.graph_step is None and self.graph_fallback is None:
                self.graph_step, self.graph_fallback = graph_step(self, self.program)
            if self.graph_step is not None:
                try:
                    return self.graph_step.run(x, y)
                except CaptureRefused as e:  # nothing of this step ran yet
                    self.graph_step, self.graph_fallback = None, str(e)
            return self.program.run(x, y)
        return self.interpret_step(x, y)

    @property
    def t0(self) -> float:
        return self._t0

    @property
    def step_runner(self) -> str:
        """'cuda graph', 'compiled' or 'interpreted'."""
        if self.graph_step is not None:
            return "cuda graph"
        return "compiled" if self.program is not None else "interpreted"

    def interpret_step(self, x: np.ndarray, y: np.ndarray) -> float:
        """One step, the calls the compiled step records run as they are assembled (debug mode)."""
        self.training = True
        for step, sp in zip(self.route.steps, self.plan.steps):
            self.bind_events(sp.before, step, run_now)
            if step.index == 0:
                self._load_batch(x, y, step)
            t = time.perf_counter()
            self.bind_compute(step, sp, run_now)
            if self.tracing:
                self.trace.append(TraceEvent(step.label, "compute", t - self._t0, time.perf_counter() - t,
                                             step.index, self.pool.in_use))
            self.bind_after_compute(step, run_now)
            self.bind_events(sp.after, step, run_now)
            self.bind_progress(step, run_now)
        return self.end_iteration()

    def settle_calls(self) -> None:
        read, t0 = self.call_clock.read, self._t0
        for label, index, in_use, start, end in self.timed_calls:
            at, seconds = read(start, end)
            self.trace.append(TraceEvent(label, "compute", at - t0, seconds, index, in_use))
        self.timed_calls.clear()

    def end_iteration(self) -> float:
        """Close a step: traced calls, host store and reducer settled, the step counted."""
        if self.timed_calls:
            self.settle_calls()
        if self.host is not None:
            self.host.end_iteration()
        if self.reducer is not None:
            self.reducer.end_iteration()
        self.iteration += 1
        return self.last_loss

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
        """Forward in inference mode on the training plan: (loss, logits copy); the pool is left as it was."""
        x, y = self.check_batch(x, y)
        self.training = False
        persistent = set(self.offsets)
        end = self.route.forward_end
        try:
            with self._step_scope():
                for step, sp in zip(self.route.steps, self.plan.steps):
                    if step.index >= end:
                        break
                    self._apply(sp.before, step)
                    if step.index == 0:
                        self._load_batch(x, y, step)
                    if step.phase is Phase.FORWARD and not step.recompute:
                        self._compute(step, sp)
                    self._apply(sp.after, step)
        finally:
            if self.host is not None:
                self.host.end_iteration()
            for tid in [t for t in self.offsets if t not in persistent]:
                self._free(Event(EventKind.FREE, tid))
            self.training = True
        logits, self._logits = self._logits, None
        return self.last_loss, logits

    def _compute(self, step: Step, sp) -> None:
        self.bind_compute(step, sp, run_now)

    def bind_compute(self, step: Step, sp, sink: Sink, recompute: bool = False) -> None:
        """Step `step`'s compute calls to `sink`: forward, backward, or the guarded update. `recompute`: the
        forward a RECOMPUTE re-runs."""
        if step.phase is Phase.UPDATE:
            self._bind_update(step, sp.on_host, sink)
            return
        node = self.net.nodes[step.node]
        layer = node.layer
        get = self.get
        if step.rename:  # a micro-batch's tensors: the layer asks by canonical id
            def get(tid, step, _get=self.get, _rename=step.rename):
                return _get(_rename.get(tid, tid), step)
        params = {p: get(tid, step) for p, tid in self.route.kernel_params(node).items()}
        aux = {a: get(aux_id(node.name, a), step) for a in self._aux_names[node.index]
               if step.rename.get(aux_id(node.name, a), aux_id(node.name, a)) in self.route.tensors}
        ws = self.get(step.workspace, step) if step.workspace else None
        if recompute:
            ws = None  # a recomputed layer runs its zero-workspace path
        M = self.route.micro_batches
        ctx = LayerContext(training=self.training, aux=aux, workspace=ws, algo=None if recompute else sp.algo,
                           rng_key=self.seed_key(node.index, self.iteration * M + step.micro),
                           recompute=recompute or step.recompute)
        stage = self.get(step.staging, step) if step.staging and not recompute else None
        if step.phase is Phase.FORWARD:
            inputs = [get(act_id(self.net.nodes[i].name), step) for i in node.inputs]
            out = get(act_id(node.name), step)
            sink(BoundCall("forward", self.staged(layer.forward, stage), (self.be, inputs, out, params, ctx), step,
                           LayerCall(node, inputs, out, params, ctx, step.micro, recompute, staging=stage)))
            if layer.is_loss and not (recompute or step.recompute):
                sink(BoundCall("loss", self.record_loss, (out, inputs[0], step.micro), step))
            return
        dout = get(delta_id(node.name), step)
        if step.seed_delta and self.scaler is not None:
            sink(BoundCall("seed", self.seed_scaled, (dout,), step))
        elif step.seed_delta:
            sink(BoundCall("seed", self.be.fill, (dout, 1.0 / M), step))  # each micro-batch's mean loss weighs 1/M
        inputs = [get(act_id(self.net.nodes[i].name), step) if k in layer.needs_inputs else None
                  for k, i in enumerate(node.inputs)]
        out = get(act_id(node.name), step) if layer.needs_output else None
        dinputs = [get(t, step) if t else None for t in step.dinputs]
        ctx.accumulate = step.accumulates_into
        grads = {p: get(tid, step) for p, tid in node.grad_ids().items()}
        sink(BoundCall("backward", self.staged(layer.backward, stage),
                       (self.be, inputs, out, dout, dinputs, grads, params, ctx), step,
                       LayerCall(node, inputs, out, params, ctx, step.micro, False, dout, dinputs, grads, stage)))
        if self.compressed is not None:  # the adaptive bound's measurements
            sink(BoundCall("observe", self.compressed.observe, (node.name, grads, dout), step))

    def bind_after_compute(self, step: Step, sink: Sink) -> None:
        """Partial deltas added into their forks (not those added in place)."""
        for acc in step.accumulate:
            if acc.in_place:
                continue
            sink(BoundCall("accumulate", self.be.accumulate, (self.get(acc.into, step), self.get(acc.partial, step)),
                           step))

    def bind_progress(self, step: Step, sink: Sink) -> None:
        """Data parallel: the reducer's progress call after a backward (MPI progresses only inside its calls)."""
        if self.reducer is not None and step.phase is Phase.BACKWARD:
            sink(BoundCall("progress", self.reducer.progress, (), step))

    def record_loss(self, out, logits, micro: int) -> None:
        """The step's loss, the mean of its micro-batches'; in evaluation the logits too."""
        loss, M = float(self.be.to_host(out)), self.route.micro_batches
        if micro == 0:
            self._loss_parts, self._logit_parts = [], []
        self._loss_parts.append(loss)
        self.last_loss = loss if M == 1 else float(np.mean(self._loss_parts))
        if not self.training:   # half logits widened: what evaluation reports is float32
            host = np.asarray(self.be.to_host(logits))
            self._logit_parts.append(host.astype(np.float32) if is_half(host.dtype) else np.array(host))
            self._logits = np.concatenate(self._logit_parts) if M > 1 else self._logit_parts[0]

    def _bind_update(self, step: Step, on_host: bool, sink: Sink) -> None:
        """The guarded optimizer on the step's parameters. `on_host`: one call on the host copies that assembles
        its arguments when it runs (they exist only once copied out)."""
        if on_host:
            sink(BoundCall("update", self.host_update, (step,), step))
            return
        nodes = self.net.layer_nodes if step.node is None else [self.net.nodes[step.node]]
        get = self.get
        items = []
        for n in nodes:
            for pname, spec in n.params.items():
                if spec.trainable:
                    state = {s: get(opt_state_id(n.name, pname, s), step) for s in self.route.optimizer_slots}
                    items.append((get(param_id(n.name, pname), step), get(grad_id(n.name, pname), step), state))
        guarded = self.guard_grads(step)
        if self.scaler is not None:
            sink(BoundCall("unscale", UnscaleCall(self, [g for _, _, g in guarded]), (), step))
        sink(BoundCall("guard", GuardCall(self, step, guarded, self.guard_buffers(step)), (), step))
        if self.scaler is not None:
            sink(BoundCall("scale", self.advance_scale, (), step))
        sink(BoundCall("update", self._update_items, (items,), step, items=items))
        copies = [(get(self.route.copies[param_id(n.name, p)], step), get(param_id(n.name, p), step))
                  for n in nodes for p, spec in n.params.items()
                  if spec.trainable and param_id(n.name, p) in self.route.copies]
        if copies:
            sink(BoundCall("refresh", self.refresh_copies, (copies,), step))

    def _update_items(self, items: list) -> None:
        """The optimizer on (param, grad, state) triples, one by one (the reference a fused update matches);
        nothing on a step fp16's loss scale skips."""
        if self.skip_update:
            return
        for p, g, state in items:
            self.opt.update(self.be, p, g, state, self.iteration)

    def refresh_copies(self, pairs: list) -> None:
        """After an update: each (half copy, master) pair's copy rounded from the master's new value (to nearest
        even: `backend.precision`); nothing on a skipped step (the masters did not change)."""
        if self.skip_update:
            return
        copy = self.be.copy
        for c, m in pairs:
            copy(c, m)

    # -- fp16's dynamic loss scale (`optim/loss_scale.py`) -----------------------------------------------------------
    def seed_scaled(self, dout) -> None:
        """The loss's gradient, set to the loss scale (fp16: one micro-batch, so no 1/M)."""
        self.be.fill_loss_scale(dout, self.scaler.scale)

    def unscale(self, grads: list) -> None:
        """The step's float32 gradients multiplied by the inverse scale; an inf or a NaN among them makes this
        step's update skipped (`skip_update`), which the guard then does not call divergence."""
        self.skip_update = self.scaler.unscale(grads)

    def advance_scale(self) -> None:
        """After the guard let the step through: the scale backed off (a skipped step) or grown; a run whose
        gradients overflow `max_skips` steps in a row, even at the scale that fell that far, diverges."""
        self.scaler.update(self.skip_update)
        if self.scaler.diverging:
            it = self.iteration
            raise DivergenceError(f"step {it}: the fp16 gradients overflowed {self.scaler.skipped_in_a_row} steps in "
                                  f"a row, down to a loss scale of {self.scaler.scale:g}: the run diverges; the "
                                  f"update was not applied, so the parameters are those after step {it - 1}. Lower "
                                  f"the learning rate, or train in bf16.", it, None)

    def host_update(self, step: Step) -> None:
        """UPDATE `step` on the host store's copies, guarded."""
        host = self._host()
        be = self._host_backend()
        self.guard_update(step, [(layer, p, host.host_copy(gid)) for layer, p, gid in self._guarded(step)])
        nodes = self.net.layer_nodes if step.node is None else [self.net.nodes[step.node]]
        for n in nodes:
            for pname, spec in n.params.items():
                if not spec.trainable:
                    continue
                state = {s: host.host_copy(opt_state_id(n.name, pname, s)) for s in self.route.optimizer_slots}
                master = host.host_copy(param_id(n.name, pname))
                self.opt.update(be, master, host.host_copy(grad_id(n.name, pname)), state, self.iteration)
                copy = self.route.copies.get(param_id(n.name, pname))
                if copy is not None:   # its half copy, homed with it (decisions/weights.py): rewritten there
                    be.copy(host.host_copy(copy), master)

    def _host_backend(self):
        """The backend for host arrays: the CPU."""
        from ..backend.cpu.backend import CPUBackend

        return self.be if backend_name(self.be) == "cpu" else CPUBackend()
