"""The compiled step: a plan lowered once into a flat program, so a training step is one tight loop.

The interpreted executor decides everything again at every step: it looks up each event's handler, carves
the tensor's block from the pool, builds a numpy view, looks views up by string id, assembles the layer's
argument dicts and context. None of that changes from one step to the next: the plan fixed every offset,
algorithm and workspace before the first step. `lower(executor)` therefore replays one step's events *once*
on the executor's own pool (so every placement is checked, and the pool's peak is the plan's, exactly as an
interpreted step leaves them), and instead of running the kernels it records each as a prepared call with its
arena views and arguments bound. A training step is then `for call in calls: call()`.

Rules the lowering keeps:
- Same calls, same arguments, same order as `Executor.train_step`: the parameters are bit-identical to the
  interpreted executor's under every policy (tests/test_program.py).
- Only what changes per step is computed per step: the iteration (optimizer, dropout keys), the batch, the loss.
- What it does not lower, it refuses, saying why, and the executor keeps interpreting: debug mode (residency
  checks and NaN poisoning need the per-step bookkeeping), an event kind it does not know (a mechanism added to
  the executor after this module was written), an executor whose event handlers were replaced.

Because every call and every view is fixed, the program is also the unit a CUDA graph capture can record
(one graph per step) on the GPU backend: nothing in it is decided while it runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..backend.base import FUSES_ADD_RELU, FUSES_ADD_RELU_BACKWARD, FUSES_BATCHNORM_RELU
from ..core.tensors import act_id, aux_id, delta_id, grad_id, opt_state_id, param_id
from ..core.vocab import TraceEvent
from ..graph.route import Phase, Step
from ..layers.base import LayerContext
from ..memory.plan import Event, EventKind

# Event kinds this module knows how to lower, and the executor handler each one replays (see `_unchanged`).
LOWERED = {EventKind.ALLOC: "_alloc", EventKind.FREE: "_free", EventKind.OFFLOAD: "_offload",
           EventKind.RELEASE: "_release", EventKind.PREFETCH: "_prefetch", EventKind.WAIT: "_wait",
           EventKind.RECOMPUTE: "_recompute", EventKind.ALLREDUCE: "_allreduce", EventKind.REDUCED: "_reduced"}

Call = Callable[[], Any]

# Layer types a following ReLU folds into (`_Lowering.fuse_relu`), and the fusion a backend lists in its
# capabilities (`Capabilities.fuses`) when it can run them so.
FUSES_RELU = {"batchnorm": FUSES_BATCHNORM_RELU, "add": FUSES_ADD_RELU}
# Layers whose backward may take the backward of the ReLU after them into the same call, and the fusion.
FUSES_RELU_BACKWARD = {"batchnorm": FUSES_BATCHNORM_RELU, "add": FUSES_ADD_RELU_BACKWARD}


@dataclass(slots=True)
class Program:
    """One training step as a flat list of prepared calls (see the module docstring)."""

    calls: list[Call]
    executor: Any
    keyed: list[tuple[LayerContext, int]] = field(default_factory=list)  # contexts whose rng_key is per step
    inputs: list[Any] = field(default_factory=list)      # arena views the batch is copied into (data, label)
    input_shapes: list[tuple[int, ...]] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)  # lowered calls per kind, for reports and tests
    prologue: list[Call] = field(default_factory=list)   # step 0's calls before the batch is loaded (paged maps)
    call_kinds: list[str] = field(default_factory=list)  # the kind of each of `calls` (what `runtime.capture` reads)
    loss_view: Any = None                                 # the loss layer's output (a capture copies it out)

    def run(self, x, y) -> float:
        """One training step: the same effect as the interpreted `Executor.train_step(x, y)`."""
        ex = self.executor
        key = ex.seed_key
        it = ex.iteration
        for ctx, node_index in self.keyed:
            ctx.rng_key = key(node_index, it)
        for call in self.prologue:   # as the interpreter: step 0's events, then the batch
            call()
        copy_in = ex.be.copy_in
        for view, arr in zip(self.inputs, (x, y)):  # arrays of the inputs' shapes (Executor.check_batch)
            copy_in(view, arr)
        for call in self.calls:
            call()
        return ex.end_iteration()

    def __len__(self) -> int:
        return len(self.calls)


@dataclass(slots=True)
class GuardCall:
    """The divergence guard of one UPDATE step: a call (`Executor.guard_update` on these gradients and buffers) and
    the data a CUDA graph needs to run the same check on the device instead (`minidl.runtime.capture`)."""

    ex: Any
    step: Step
    grads: list   # (layer, parameter, gradient view), in backward order
    buffers: list  # (layer, buffer, view): the running statistics, at the step's first update (else empty)

    def __call__(self) -> None:
        self.ex.guard_update(self.step, self.grads, self.buffers)


class NotLowered(Exception):
    """The plan or executor uses something the compiled step does not lower; the reason says what."""


def why_not(ex) -> str | None:
    """The reason `ex` cannot be lowered, or None if it can (checked before touching the pool)."""
    if ex.debug:
        return "debug mode (residency checks and NaN poisoning) runs the interpreted executor"
    if ex.route.packing is not None:
        return "a route of packs and micro-batches (per-step renames, a loss per micro-batch) is interpreted"
    for ev in (*ex.plan.setup, *(e for sp in ex.plan.steps for e in (*sp.before, *sp.after))):
        if ev.kind not in LOWERED:
            return f"event kind '{getattr(ev.kind, 'value', ev.kind)}' is not lowered by minidl.runtime.program"
    for kind, name in LOWERED.items():
        handler = ex._handlers.get(kind)
        if getattr(handler, "__func__", None) is not getattr(type(ex), name, None):
            return f"the executor's handler for '{kind.value}' is not its own {name}"
    return None


def lower(ex) -> Program:
    """Lower executor `ex`'s plan into a Program (raises NotLowered, before touching any state, if it can't).

    Replays one step's events on `ex`'s pool: allocations and frees happen for real (checked placements, the
    plan's peak), kernels do not run, they are recorded. Afterwards the pool holds exactly what an interpreted
    step leaves behind (the persistent tensors).
    """
    reason = why_not(ex)
    if reason:
        raise NotLowered(reason)
    return _Lowering(ex).run()


class _Lowering:
    def __init__(self, ex):
        self.ex = ex
        self.calls: list[Call] = []
        self.call_kinds: list[str] = []
        self.loss_view = None
        self.keyed: list[tuple[LayerContext, int]] = []
        self.kinds: dict[str, int] = {}
        self.aux_names = ex._aux_names
        self.forward_step_of = ex._forward_step_of
        self.relu_host = None  # the last batch norm or add forward emitted, while a ReLU may still fold into it
        self.readers: dict[str, set[int]] | None = None  # `read_only_by`'s tables, built on first use
        self.moved: set[str] = set()
        self.relu_backward = None  # the last ReLU backward emitted, while it may still fold into a batch norm's

    def emit(self, kind: str, call: Call) -> None:
        self.calls.append(call)
        self.call_kinds.append(kind)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def run(self) -> Program:
        arena = getattr(self.ex.pool, "arena", None)
        if not hasattr(arena, "map"):
            return self._run()
        # A paged arena (`--paged`) maps and unmaps chunks at every allocation: the mappings are part of the step,
        # so each one runs now and is recorded in order (the views stay valid: their virtual ranges are fixed).
        self.ex.pool.arena = _RecordedMappings(arena, self)
        try:
            return self._run()
        finally:
            self.ex.pool.arena = arena

    def _run(self) -> Program:
        ex = self.ex
        inputs, shapes = [], []
        prologue = 0
        for step, sp in zip(ex.route.steps, ex.plan.steps):
            self.events(sp.before, step)
            if step.index == 0:
                prologue = len(self.calls)
                for node in ex.net.input_nodes[:2]:
                    inputs.append(ex.get(act_id(node.name), step))
                    shapes.append(tuple(node.shape))
            self.compute(step, sp)
            for acc in step.accumulate:
                self.emit("accumulate", _bind(ex.be.accumulate, ex.get(acc.into, step), ex.get(acc.partial, step)))
            self.events(sp.after, step)
            if ex.reducer is not None and step.phase is Phase.BACKWARD:
                self.emit("progress", ex.reducer.progress)  # MPI moves a nonblocking collective only in its calls
        return Program(self.calls[prologue:], ex, keyed=self.keyed, inputs=inputs, input_shapes=shapes,
                       kinds=self.kinds, prologue=self.calls[:prologue],
                       call_kinds=self.call_kinds[prologue:], loss_view=self.loss_view)

    # -- events: the pool bookkeeping happens now, once; only the transfers are recorded -----------------------
    def events(self, events: list[Event], step: Step) -> None:
        ex = self.ex
        for ev in events:
            kind = ev.kind
            if kind is EventKind.ALLOC:
                ex._alloc(ev, step)
            elif kind is EventKind.FREE:
                ex._free(ev, step)
            elif kind is EventKind.OFFLOAD:
                self.emit("offload", _bind(ex._host().offload, ev.tensor, ex.get(ev.tensor, step), step.index))
            elif kind is EventKind.RELEASE:
                self.emit("release", _bind(ex._host().wait_offload, ev.tensor))
                ex._free(ev, step)
            elif kind is EventKind.PREFETCH:
                ex._alloc(ev, step)
                self.emit("prefetch", _bind(ex._host().prefetch, ev.tensor, ex.views[ev.tensor], step.index))
            elif kind is EventKind.WAIT:
                self.emit("wait", _bind(ex._host().wait_prefetch, ev.tensor))
            elif kind is EventKind.RECOMPUTE:
                ex._alloc(ev, step)
                node = ex.net.node(ex.route.tensors[ev.tensor].owner)
                fake = Step(step.index, Phase.FORWARD, node.index, node.name, [], [])
                self.compute(fake, ex.plan.steps[self.forward_step_of[node.index]], recompute=True)
                in_shapes = [ex.net.nodes[i].shape for i in node.inputs]
                self.emit("recompute_flops", _count_flops(ex, node.layer.flops(in_shapes, node.shape)))
            elif kind is EventKind.ALLREDUCE or kind is EventKind.REDUCED:
                grads = [ex.get(g, step) for g in ex.plan.buckets[ev.tensor]]
                run = ex.reducer.start if kind is EventKind.ALLREDUCE else ex.reducer.finish
                self.emit(kind.value, _bind(run, ev.tensor, ex.get(ev.tensor, step), grads, step.index))
            else:  # pragma: no cover - why_not() refused these already
                raise NotLowered(f"event kind {kind} is not lowered")

    # -- compute: the same arguments `Executor._compute` assembles, bound once ---------------------------------
    def compute(self, step: Step, sp, recompute: bool = False) -> None:
        ex = self.ex
        if step.phase is Phase.UPDATE:
            if not sp.on_host:  # its own call: the guard reads values on the host, the update does not
                self.emit("guard", GuardCall(ex, step, ex.guard_grads(step), ex.guard_buffers(step)))
            self.emit("update", self.update(step, sp.on_host))
            return
        node = ex.net.nodes[step.node]
        layer = node.layer
        get = ex.get
        params = {p: get(tid, step) for p, tid in node.param_ids().items()}
        aux = {a: get(aux_id(node.name, a), step) for a in self.aux_names[node.index]
               if aux_id(node.name, a) in ex.route.tensors}
        ws = get(step.workspace, step) if step.workspace and not recompute else None
        ctx = LayerContext(training=True, aux=aux, workspace=ws, algo=None if recompute else sp.algo,
                           rng_key=ex.seed_key(node.index, ex.iteration), recompute=recompute)
        if getattr(layer, "uses_rng_key", False):
            self.keyed.append((ctx, node.index))
        if step.phase is Phase.FORWARD:
            inputs = [get(act_id(ex.net.nodes[i].name), step) for i in node.inputs]
            out = get(act_id(node.name), step)
            if not recompute and self.fuse_relu(step, node, out):
                return
            call = _bind(layer.forward, ex.be, inputs, out, params, ctx)
            self.emit("forward", call if recompute else self.timed(step, call))
            if not recompute and FUSES_RELU.get(node.type_name) in ex.be.capabilities.fuses:
                self.relu_host = (node.index, len(self.calls) - 1, step, ex.pool.in_use, layer, inputs, out, params,
                                  ctx)
            if layer.is_loss and not recompute:
                self.loss_view = out
                self.emit("loss", _read_loss(ex, out))
            return
        dout = get(delta_id(node.name), step)
        if step.seed_delta:
            self.emit("seed", _bind(ex.be.fill, dout, 1.0))
        inputs = [get(act_id(ex.net.nodes[i].name), step) if k in layer.needs_inputs else None
                  for k, i in enumerate(node.inputs)]
        out = get(act_id(node.name), step) if layer.needs_output else None
        dinputs = [get(t, step) if t else None for t in step.dinputs]
        grads = {p: get(tid, step) for p, tid in node.grad_ids().items()}
        if self.fuse_relu_backward(step, node, inputs, dout, dinputs, grads, params, ctx):
            return
        self.emit("backward", self.timed(step, _bind(layer.backward, ex.be, inputs, out, dout, dinputs, grads,
                                                     params, ctx)))
        if node.type_name == "relu" and not step.seed_delta and not ex.be.capabilities.fuses.isdisjoint(
                FUSES_RELU_BACKWARD.values()):
            self.relu_backward = (node, len(self.calls) - 1, step, ex.pool.in_use, out, dout, dinputs[0])

    def fuse_relu(self, step: Step, node, out) -> bool:
        """Fold a ReLU's forward into the batch norm or add just before it (`FUSES_RELU`: one pass writes y and
        ReLU(y), the ReLU does not read y again); True if done, and the ReLU then emits nothing. Only when nothing
        ran between the two (that layer's call is the last one emitted: no transfer, no mapping, no other layer),
        the ReLU's input is that layer's output, and the ReLU's output shares no memory with what that layer
        reads or writes (the plan may place it where a tensor freed after that step lay, which the fused call,
        running at that step's place, would otherwise overwrite too early), except that it may be exactly an input
        (the plan put it where an input that dies there lay: both kernels read each input value before they write
        the same position, `_apart_or_same`). y is still written where anything else may read it; where the
        ReLU's step is its only reader and the plan neither moves nor recomputes it, nor recomputes the ReLU
        (`read_only_by`), the fused call may leave y unwritten (one stream of writes less; counted as
        "output_not_kept"). The values are the same as unfused (tested), so the parameters stay
        bit-identical to the interpreted executor's. With tracing on, the ReLU's step still records its compute
        event (near zero: its work is in the other's), so a trace keeps one event per step."""
        pending, self.relu_host = self.relu_host, None
        if pending is None or node.type_name != "relu" or node.layer.is_loss:
            return False
        host_index, pos, host_step, host_in_use, host, h_inputs, y, h_params, h_ctx = pending
        if list(node.inputs) != [host_index] or pos != len(self.calls) - 1:
            return False
        touched = [y, *h_params.values(), *h_ctx.aux.values()]
        if any(np.may_share_memory(out, a) for a in touched) or not all(_apart_or_same(out, x) for x in h_inputs):
            return False
        keep = not self.read_only_by(act_id(self.ex.net.nodes[host_index].name), step.index)
        self.calls[pos] = self.timed(host_step, _bind(host.forward_relu, self.ex.be, h_inputs, y, out, h_params,
                                                      h_ctx, keep), in_use=host_in_use)
        if not keep:
            self.kinds["output_not_kept"] = self.kinds.get("output_not_kept", 0) + 1
        kind = f"fused_{host.type_name}_relu"
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if self.ex.tracing:
            self.emit("folded", self.timed(step, _nothing))
        return True

    def read_only_by(self, tensor: str, step_index: int) -> bool:
        """Whether the route step `step_index` is the only one that reads `tensor`, and no event of the plan
        touches it other than allocating and freeing it (no transfer, no recomputation of it or of a layer that
        reads it): then a fused host layer need not write it (`fuse_relu`: the ReLU reads y inside the fused
        call). Worked out once per lowering, for all tensors."""
        if self.readers is None:
            ex = self.ex
            readers: dict[str, set[int]] = {}
            for st in ex.route.steps:
                for t in st.reads:
                    readers.setdefault(t, set()).add(st.index)
            moved: set[str] = set()
            for sp in ex.plan.steps:
                for ev in (*sp.before, *sp.after):
                    if ev.kind in (EventKind.ALLOC, EventKind.FREE):
                        continue
                    moved.add(ev.tensor)
                    if ev.kind is EventKind.RECOMPUTE:  # its recomputation reads the layer's inputs
                        node = ex.net.node(ex.route.tensors[ev.tensor].owner)
                        moved.update(act_id(ex.net.nodes[i].name) for i in node.inputs)
            self.readers, self.moved = readers, moved
        return self.readers.get(tensor, set()) == {step_index} and tensor not in self.moved

    def fuse_relu_backward(self, step: Step, node, inputs, dout, dinputs, grads, params, ctx) -> bool:
        """Fold the backward of a ReLU into the backward of the batch norm or add that follows it (the pair of
        `fuse_relu`, backwards; `FUSES_RELU_BACKWARD`): the batch norm's call computes its output gradient from
        the ReLU's channel by channel, in a scratch it reduces while it is in cache (`batchnorm_backward(...,
        relu=)`); the add's writes that gradient straight to its inputs' gradients in one pass
        (`add_relu_backward`). Neither writes the layer's own output gradient (`dout`): the conditions below make
        the layer its only reader. The same values (tested); True if done. Only where the ReLU's backward is the
        last call emitted, the ReLU reads this layer's output alone and writes exactly this layer's output
        gradient, and nothing this call writes (dx, the parameter gradients) overlaps the ReLU's output or
        gradient, which it reads, unless it is exactly one of them (each element or channel of those is read
        before it is written). The ReLU's own call is dropped (with tracing on, it becomes its step's near-zero
        event)."""
        pending, self.relu_backward = self.relu_backward, None
        flag = FUSES_RELU_BACKWARD.get(node.type_name)
        if pending is None or flag not in self.ex.be.capabilities.fuses or not ctx.training:
            return False
        relu, pos, relu_step, relu_in_use, r, dr, d_in = pending
        if list(relu.inputs) != [node.index] or pos != len(self.calls) - 1 or d_in is None:
            return False
        if not (np.may_share_memory(d_in, dout) and _apart_or_same(d_in, dout)):
            return False
        written = [*dinputs, *grads.values()]
        if not all(w is None or (_apart_or_same(w, r) and _apart_or_same(w, dr)) for w in written):
            return False
        self.kinds["backward"] -= 1
        if self.ex.tracing:
            self.calls[pos] = self.timed(relu_step, _nothing, in_use=relu_in_use)
            self.call_kinds[pos] = "folded"
            self.kinds["folded"] = self.kinds.get("folded", 0) + 1
        else:
            del self.calls[pos], self.call_kinds[pos]
        fused = _bind(node.layer.backward_relu, self.ex.be, inputs, dout, dinputs, grads, params, ctx, r, dr)
        self.emit("backward", self.timed(step, fused))
        kind = f"fused_{node.type_name}_relu_backward"
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        return True

    def update(self, step: Step, on_host: bool = False) -> Call:
        ex = self.ex
        if on_host:  # a host update (decisions/weights.py): a gradient's host buffer exists only once copied out
            def run_host_update() -> None:
                ex._update(step, on_host=True)
            return self.timed(step, run_host_update)
        items = []
        get, be = ex.get, ex.be
        nodes = ex.net.layer_nodes if step.node is None else [ex.net.nodes[step.node]]  # fused: one layer's
        for n in nodes:
            for pname, spec in n.params.items():
                if spec.trainable:
                    state = {s: get(opt_state_id(n.name, pname, s), step) for s in ex.route.optimizer_slots}
                    items.append((get(param_id(n.name, pname), step), get(grad_id(n.name, pname), step), state))
        update = ex.opt.prepare(be, items)  # one call per fused group where the backend fuses (bit-identical)

        def run_update() -> None:  # the divergence guard ran just before, as the "guard" call
            update(ex.iteration)
        return self.timed(step, run_update)

    def timed(self, step: Step, call: Call, in_use: int | None = None) -> Call:
        """With tracing on, the call records a compute event like the interpreted executor's (the pool's bytes in
        use: now, or `in_use` as it was at the step's own lowering); else as is."""
        ex = self.ex
        if not ex.tracing:
            return call
        label, index, trace, t0 = step.label, step.index, ex.trace, ex._t0
        in_use = ex.pool.in_use if in_use is None else in_use
        clock = time.perf_counter

        def traced() -> None:
            t = clock()
            call()
            trace.append(TraceEvent(label, "compute", t - t0, clock() - t, index, in_use))
        return traced


class _RecordedMappings:
    """A paged arena seen through the lowering: `map`/`unmap` run at once and are emitted as calls."""

    def __init__(self, arena, lowering: "_Lowering"):
        self._arena, self._lowering = arena, lowering

    def map(self, *args) -> None:
        self._arena.map(*args)
        self._lowering.emit("map", _bind(self._arena.map, *args))

    def unmap(self, *args) -> None:
        self._arena.unmap(*args)
        self._lowering.emit("unmap", _bind(self._arena.unmap, *args))

    def __getattr__(self, name):
        return getattr(self._arena, name)


def _bind(fn, *args) -> Call:
    """fn(*args) with the arguments fixed now (a closure: no per-call argument tuple is rebuilt)."""
    if len(args) == 1:
        a, = args
        return lambda: fn(a)
    if len(args) == 2:
        a, b = args
        return lambda: fn(a, b)
    if len(args) == 3:
        a, b, c = args
        return lambda: fn(a, b, c)
    return lambda: fn(*args)


def _apart_or_same(a, b) -> bool:
    """Whether arrays a and b share no memory, or are exactly the same elements (same start, shape and strides):
    an elementwise kernel that reads b[i] before it writes a[i] may then write a over b."""
    if not np.may_share_memory(a, b):
        return True
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides and a.dtype == b.dtype)


def _nothing() -> None:
    """The call of a step whose work another call does (a ReLU folded into its batch norm), traced."""


def _read_loss(ex, out) -> Call:
    to_host = ex.be.to_host

    def read() -> None:
        ex.last_loss = float(to_host(out))
    return read


def _count_flops(ex, flops: int) -> Call:
    def count() -> None:
        ex.recomputed_flops += flops
    return count
