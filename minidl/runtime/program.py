"""The compiled step: one step walked once through the interpreter's own binding (binding.py), on the executor's
pool, with a sink that records each call; a step is then `for call in calls: call()`.

Rules: the same calls, arguments and order as the interpreter, so the same bits under every plan
(tests/runtime/test_program.py); fusions (a ReLU folded into its neighbour, grouped updates) keep the bits; only
the iteration, the batch and the loss change per step; debug mode is refused, saying so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend.base import FUSES_RELU, FUSES_RELU_BACKWARD
from ..core.tensors import act_id
from ..graph.route import Step
from ..layers.base import LayerContext
from ..memory.plan import EventKind
from .binding import BoundCall, Call, GuardCall, LayerCall, StepBinding

__all__ = ["Program", "GuardCall", "NotLowered", "why_not", "lower"]


@dataclass(slots=True)
class Program:
    """One training step as a flat list of prepared calls."""

    calls: list[Call]
    executor: Any
    keyed: list[tuple[LayerContext, int, int]] = field(default_factory=list)  # (context, node, micro-batch)
    inputs: list[Any] = field(default_factory=list)      # arena views the batch is copied into (data, label)
    input_shapes: list[tuple[int, ...]] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)  # recorded calls per kind
    prologue: list[Call] = field(default_factory=list)   # step 0's events before the batch is loaded
    call_kinds: list[str] = field(default_factory=list)  # the kind of each of `calls`
    prologue_kinds: list[str] = field(default_factory=list)  # the kind of each of `prologue`
    loss_view: Any = None                                 # the loss layer's output
    input_slices: list[tuple[int, int | None, int | None]] = field(default_factory=list)  # per view: (k, lo, hi)
    micro_batches: int = 1

    def step_keys(self, iteration: int) -> list[int]:
        """The dropout key of each of `keyed` (micro-batch m of M: iteration * M + m)."""
        key, M = self.executor.seed_key, self.micro_batches
        return [key(node, iteration * M + micro) for _, node, micro in self.keyed]

    def run(self, x, y) -> float:
        """One step with `Executor.train_step(x, y)`'s effect."""
        ex = self.executor
        for (ctx, _, _), key in zip(self.keyed, self.step_keys(ex.iteration)):
            ctx.rng_key = key
        for call in self.prologue:   # step 0's events, then the batch
            call()
        copy_in = ex.be.copy_in
        arrays = (x, y)
        for view, (k, lo, hi) in zip(self.inputs, self.input_slices):
            copy_in(view, arrays[k] if lo is None else arrays[k][lo:hi])
        for call in self.calls:
            call()
        return ex.end_iteration()

    def __len__(self) -> int:
        return len(self.calls)


class NotLowered(Exception):
    """The executor runs in a mode the compiled step does not record; the reason says which."""


def why_not(ex: StepBinding) -> str | None:
    """Why `ex` cannot be lowered, or None."""
    if ex.debug:
        return "debug mode (residency checks and NaN poisoning) runs the interpreted executor"
    return None


def lower(ex: StepBinding) -> Program:
    """Record `ex`'s step: allocations happen for real, kernels are recorded; raises NotLowered first."""
    reason = why_not(ex)
    if reason:
        raise NotLowered(reason)
    return _Recording(ex).run()


class _Recording:
    """The recording sink: one step's calls, fused where the bits allow."""

    def __init__(self, ex: StepBinding):
        self.ex = ex
        self.calls: list[Call] = []
        self.call_kinds: list[str] = []
        self.loss_view = None
        self.keyed: list[tuple[LayerContext, int, int]] = []
        self.kinds: dict[str, int] = {}
        self.relu_host = None  # the last batch norm or add forward, while a ReLU may fold into it
        self.readers: dict[str, set[int]] | None = None  # `read_only_by`'s tables
        self.moved: set[str] = set()
        self.relu_backward = None  # the last ReLU backward, while it may fold into the next layer's

    def emit(self, kind: str, call: Call) -> None:
        self.calls.append(call)
        self.call_kinds.append(kind)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def run(self) -> Program:
        ex = self.ex
        if ex.plan.paged is None:
            return self._run()
        # A paged arena's mappings are part of the step: each runs now and is recorded in order.
        arena = ex.pool.arena
        ex.pool.arena = _RecordedMappings(arena, self)
        try:
            return self._run()
        finally:
            ex.pool.arena = arena

    def _run(self) -> Program:
        ex, sink = self.ex, self.record
        slots: list = []
        prologue = 0
        for step, sp in zip(ex.route.steps, ex.plan.steps):
            ex.bind_events(sp.before, step, sink)
            if step.index == 0:
                prologue = len(self.calls)
                slots = ex.batch_slots(step)
            ex.bind_compute(step, sp, sink)
            ex.bind_after_compute(step, sink)
            ex.bind_events(sp.after, step, sink)
            ex.bind_progress(step, sink)
        return Program(self.calls[prologue:], ex, keyed=self.keyed, inputs=[v for v, *_ in slots],
                       input_shapes=[tuple(v.shape) for v, *_ in slots], kinds=self.kinds,
                       prologue=self.calls[:prologue], call_kinds=self.call_kinds[prologue:],
                       prologue_kinds=self.call_kinds[:prologue],
                       loss_view=self.loss_view, input_slices=[tuple(rest) for _, *rest in slots],
                       micro_batches=ex.route.micro_batches)

    # -- the sink
    def record(self, call: BoundCall) -> None:
        """Keep `call`: as it is, fused into the call before it, or grouped (updates)."""
        kind = call.kind
        if call.layer is not None:
            if call.layer.node.layer.uses_rng_key:
                self.keyed.append((call.layer.ctx, call.layer.node.index, call.layer.micro))
            if kind == "forward":
                self.forward(call)
            else:
                self.backward(call)
            return
        if kind == "update":
            self.update(call)
            return
        if kind == "loss":
            self.loss_view = call.args[0]
        self.emit(kind, _bind(call.fn, *call.args) if call.args else call.fn)

    def forward(self, call: BoundCall) -> None:
        lc, step = call.layer, call.step
        fusable = not (lc.recompute or lc.ctx.recompute)
        if fusable and self.fuse_relu(step, lc):
            return
        fn = _bind(call.fn, *call.args)
        self.emit("forward", fn if lc.recompute else self.timed(step, fn))
        if fusable and FUSES_RELU.get(lc.node.type_name) in self.ex.be.capabilities.fuses:
            self.relu_host = (len(self.calls) - 1, step, self.ex.pool.in_use, lc)

    def backward(self, call: BoundCall) -> None:
        lc, step = call.layer, call.step
        if self.fuse_relu_backward(step, lc):
            return
        self.emit("backward", self.timed(step, _bind(call.fn, *call.args)))
        if lc.node.type_name == "relu" and not step.seed_delta and not self.ex.be.capabilities.fuses.isdisjoint(
                FUSES_RELU_BACKWARD.values()):
            self.relu_backward = (lc, len(self.calls) - 1, step, self.ex.pool.in_use)

    def fuse_relu(self, step: Step, lc: LayerCall) -> bool:
        """Fold a ReLU's forward into the batch norm or add just before it (`FUSES_RELU`: one pass writes y and
        ReLU(y), the ReLU does not read y again); True if done, and the ReLU then emits nothing. Only when nothing
        ran between the two (that layer's call is the last one emitted: no transfer, no mapping, no other layer),
        the ReLU's input is that layer's output (of the same micro-batch: a packed route interleaves them), and
        the ReLU's output shares no memory with what that layer reads or writes (the plan may place it where a
        tensor freed after that step lay, which the fused call, running at that step's place, would otherwise
        overwrite too early), except that it may be exactly an input
        (the plan put it where an input that dies there lay: both kernels read each input value before they write
        the same position, `_apart_or_same`), nor with that layer's staging (a half mode on the CPU). y is still
        written where anything else may read it; where the
        ReLU's step is its only reader and the plan neither moves nor recomputes it, nor recomputes the ReLU
        (`read_only_by`), the fused call may leave y unwritten (one stream of writes less; counted as
        "output_not_kept"). The values are the same as unfused (tested), so the parameters stay
        bit-identical to the interpreted executor's. With tracing on, the ReLU's step still records its compute
        event (near zero: its work is in the other's), so a trace keeps one event per step."""
        pending, self.relu_host = self.relu_host, None
        node, out = lc.node, lc.out
        if pending is None or node.type_name != "relu" or node.layer.is_loss:
            return False
        pos, host_step, host_in_use, h = pending
        if list(node.inputs) != [h.node.index] or h.micro != lc.micro or pos != len(self.calls) - 1:
            return False
        y = h.out
        touched = [y, *h.params.values(), *h.ctx.aux.values(), *([h.staging] if h.staging is not None else [])]
        if any(np.may_share_memory(out, a) for a in touched) or not all(_apart_or_same(out, x) for x in h.inputs):
            return False
        ex = self.ex
        # a packed route's tensors are renamed per micro-batch: y is kept there
        keep = ex.route.packing is not None or not self.read_only_by(act_id(h.node.name), step.index)
        fused = ex.staged(h.node.layer.forward_relu, h.staging)   # at the host's step: its staging
        self.calls[pos] = self.timed(host_step, _bind(fused, ex.be, h.inputs, y, out, h.params, h.ctx, keep),
                                     in_use=host_in_use)
        if not keep:
            self.kinds["output_not_kept"] = self.kinds.get("output_not_kept", 0) + 1
        kind = f"fused_{h.node.type_name}_relu"
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if ex.tracing:
            self.emit("folded", self.timed(step, _nothing))
        return True

    def read_only_by(self, tensor: str, step_index: int) -> bool:
        """Whether step `step_index` alone reads `tensor` and no event but ALLOC/FREE touches it (nor recomputes a
        reader)."""
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
                    if ev.kind is EventKind.RECOMPUTE:
                        node = ex.net.node(ex.route.tensors[ev.tensor].owner)
                        moved.update(act_id(ex.net.nodes[i].name) for i in node.inputs)
            self.readers, self.moved = readers, moved
        return self.readers.get(tensor, set()) == {step_index} and tensor not in self.moved

    def fuse_relu_backward(self, step: Step, lc: LayerCall) -> bool:
        """Fold the backward of a ReLU into the backward of the batch norm or add that follows it (the pair of
        `fuse_relu`, backwards; `FUSES_RELU_BACKWARD`): the batch norm's call computes its output gradient from
        the ReLU's channel by channel, in a scratch it reduces while it is in cache (`batchnorm_backward(...,
        relu=)`); the add's writes that gradient straight to its inputs' gradients in one pass
        (`add_relu_backward`). Neither writes the layer's own output gradient (`dout`): the conditions below make
        the layer its only reader. The same values (tested); True if done. Only where the ReLU's backward is the
        last call emitted, the ReLU reads this layer's output alone and writes exactly this layer's output
        gradient, and nothing this call writes (dx, the parameter gradients) overlaps the ReLU's output or
        gradient, which it reads, unless it is exactly one of them (each element or channel of those is read
        before it is written), and its staging (a half mode on the CPU) overlaps neither. The ReLU's own call is
        dropped (with tracing on, it becomes its step's near-zero event)."""
        pending, self.relu_backward = self.relu_backward, None
        node, ctx, dout = lc.node, lc.ctx, lc.dout
        flag = FUSES_RELU_BACKWARD.get(node.type_name)
        if pending is None or flag not in self.ex.be.capabilities.fuses or not ctx.training:
            return False
        relu, pos, relu_step, relu_in_use = pending
        r, dr, d_in = relu.out, relu.dout, relu.dinputs[0]
        if (list(relu.node.inputs) != [node.index] or relu.micro != lc.micro or pos != len(self.calls) - 1
                or d_in is None):
            return False
        if not (np.may_share_memory(d_in, dout) and _apart_or_same(d_in, dout)):
            return False
        written = [*lc.dinputs, *lc.grads.values()]
        if not all(w is None or (_apart_or_same(w, r) and _apart_or_same(w, dr)) for w in written):
            return False
        if lc.staging is not None and (np.may_share_memory(lc.staging, r) or np.may_share_memory(lc.staging, dr)):
            return False   # the step's staging may lie where the ReLU's tensors did: they are read inside the call
        self.kinds["backward"] -= 1
        if self.ex.tracing:
            self.calls[pos] = self.timed(relu_step, _nothing, in_use=relu_in_use)
            self.call_kinds[pos] = "folded"
            self.kinds["folded"] = self.kinds.get("folded", 0) + 1
        else:
            del self.calls[pos], self.call_kinds[pos]
        fused = _bind(self.ex.staged(node.layer.backward_relu, lc.staging), self.ex.be, lc.inputs, dout, lc.dinputs,
                      lc.grads, lc.params, ctx, r, dr)
        self.emit("backward", self.timed(step, fused))
        kind = f"fused_{node.type_name}_relu_backward"
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        return True

    def update(self, call: BoundCall) -> None:
        """A host update as it is; on the device, the optimizer prepared once over the items (fused groups,
        bit-identical to item by item)."""
        if call.items is None:
            self.emit("update", self.timed(call.step, _bind(call.fn, *call.args)))
            return
        ex = self.ex
        update = ex.opt.prepare(ex.be, call.items)

        def run_update() -> None:
            if not ex.skip_update:   # fp16: a step whose gradients overflowed is skipped
                update(ex.iteration)
        self.emit("update", self.timed(call.step, run_update))

    def timed(self, step: Step, call: Call, in_use: int | None = None) -> Call:
        """With tracing on, `call` timed on the backend's clock as a compute event (bytes in use: now or
        `in_use`); else as is."""
        ex = self.ex
        if not ex.tracing:
            return call
        label, index, pending, mark = step.label, step.index, ex.timed_calls, ex.call_clock.mark
        in_use = ex.pool.in_use if in_use is None else in_use

        def traced() -> None:
            start = mark()
            call()
            pending.append((label, index, in_use, start, mark()))
        return traced


class _RecordedMappings:
    """A paged arena seen through the recording: `map`/`unmap` run at once and are emitted as calls."""

    def __init__(self, arena, lowering: "_Recording"):
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
    """fn(*args) as a closure: no argument tuple rebuilt per call."""
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
    """Whether a and b share no memory or are exactly the same elements (a kernel reading b[i] before writing
    a[i] may then write over b)."""
    if not np.may_share_memory(a, b):
        return True
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides and a.dtype == b.dtype)


def _nothing() -> None:
    """A step whose work another call does (a folded ReLU), traced."""
