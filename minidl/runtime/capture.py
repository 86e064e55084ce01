"""One CUDA graph per step: the compiled program (program.py) captured once and replayed.

On the GPU about 80 ms of every ResNet-50 step was host-side dispatch (Python per kernel, ../shared/GPU.md). The
compiled program already fixes every call, view, algorithm and workspace before the first step; a CUDA graph
records the kernels those calls enqueue once, and a step becomes one `cudaGraphLaunch` (the divergence guard
included: see below), or a few with the calls cupy cannot capture between them (cuBLAS: see below).

Rules this module keeps:
- Replay runs exactly the calls the eager program runs, in its order, on the same stream, with the same arguments:
  the parameters are bit-identical to the compiled eager loop's (tests/backend/test_capture.py checks the order
  and the arguments against fakes; tests/backend/test_capture_gpu.py the bits, behind `-m gpu`).
- What changes per step lives at fixed addresses: the batch and labels are copied into fixed pinned staging
  buffers on the host, and the graph's first nodes copy them into the arena; the loss is copied out by the graph
  into a fixed pinned buffer that the host reads after the step. The host blocks once per step (to read it).
- The first `WARMUP_STEPS` run eagerly: they build the cuDNN graphs, compile and load the kernels and size the
  side buffers, none of which may happen while a stream is captured.
- The scalars that change per step are in device memory too (`backend/scalars.py`): each dropout layer's key,
  the learning rate (a schedule) and Adam's step count (its bias corrections) are written by the host into a
  fixed pinned buffer before each replay, copied to the device by the graph's first node, and read there by the
  `_dev` kernels, which the backend launches instead of the ordinary ones while a capture is under way.
- Every other value baked into the captured kernels as a launch argument must not change between replays: the
  optimizer's other hyper-parameters, SGD's first-step flag and whether the divergence guard is on are checked
  before every replay (the `signature`); a change re-captures, one at every step gives up (the eager loop runs,
  and says why).
- The divergence guard runs on the device: the host guard (`Executor.guard_update`) reads the loss and the
  gradients before an update may run, which a graph cannot stop for. So each guard becomes `nonfinite_flag`
  launches (kernels/elementwise.cu) on the same gradients, then the loss (kept in a slot at the loss layer), then
  the running statistics (at the first update), in the host guard's order; the first non-finite one leaves its
  code in a device flag, the update kernels' graph variants skip while it is set, and after the step the host
  reads the flag and raises the host guard's very error (`_raise_if_diverged`). Same state as eager: unfused,
  nothing updated; fused, the layers updated before the bad gradient. A step is then one graph. A backend
  without a device guard splits the step at each guard instead (a host call between graphs, named in
  `describe()`), and refuses a split that would fall between a host copy and its wait.
- Half precision: the weight copies' refresh after an update is device work like the update (it rewrites each
  copy from its master: on a step whose update was skipped the copy's bits come out unchanged). fp16's loss scale
  and its inverse are two more slots (`StepScalars.amp`), read by the loss's seed (`fill_loss_scale`) and the
  gradients' unscaling (`unscale`). Its skip is the device guard's: each gradient is checked (`found_inf_flag`,
  before it is unscaled, as `LossScaler.unscale` checks it) into a `found_inf` flag; the guard then checks the loss
  and the running statistics first and the unscaled gradients last, so a non-finite loss or statistic keeps its
  code, and an overflow leaves a gradient's, which skips the updates as a divergence would. After the replay the
  host reads both flags: overflow alone is the skipped step the eager loop makes (`skip_update`), then the scale
  advances on the host (`LossScaler.update`, the "scale" call, run after the graph). fp16 is captured only with
  the device guard on (without it nothing on the device could skip an update).
- A call the backend cannot capture runs eagerly between graphs. cupy refuses every cuBLAS call on a capturing
  stream (the dense layers' `cupy.cublas.gemm`, the batched products' and attention's `cupy.matmul`), raising
  the error the backend names in `CaptureUnsupported`, before it enqueues anything. `record` captures each
  segment in one pass: at such an error it drops that capture (it may hold part of the call's work), captures
  the calls before the failing one again as one graph, makes the call an eager segment and goes on capturing
  after it. A step is then graph, eager call(s), graph, ...: the eager calls are enqueued on the compute stream
  behind the graph before them (stream order, no host wait) with `graph_scalars` still set, so a call with a
  `_dev` variant launches it as inside a graph (this step's slots, skipped after a flagged guard). The same
  kernels run as in the compiled loop, so the bits are its bits. `describe()` says how many calls run eagerly
  and why; such a call between a host copy and its wait refuses the capture (a graph must end with its copies
  joined), and a cupy allocation inside it is no capture error (only the kept graphs are checked).
- A plan that cannot be captured falls back to the compiled eager loop, and `Executor.graph_fallback` says why in
  one line: no graph capture on this backend, not compiled, tracing, the paged arena's mappings, data parallel,
  micro-batches (a loss read per micro-batch), compression (the codec runs on the host), host copies that may go
  to the disk tier (`--host-limit`), a host update, an optimizer other than SGD and
  Adam, an allocation made by cupy inside a captured graph (a temporary the graph would keep reusing), a call
  that cannot be captured between a host copy and its wait, or the capture's own error.
- Host copies (offload/prefetch) are captured with the compute they overlap: each copy waits on its stream for
  an event recorded on compute, and compute waits for the copy's `done` event at RELEASE/WAIT, so the graph has
  the same dependencies as the eager step. The host store's buffers are fixed per tensor, so the graph's copies
  always read and write the same pinned memory. The copies' events belong to the graph: the store forgets them
  after the capture (`HostStore.drop_captured`) and counts each replay's copies without times
  (`HostStore.untimed_copies`; the JSON's `transfer_hidden_fraction` is then null: `--cuda-graph off` measures
  the overlap eagerly).

Rationale: capture is at the program's granularity (not per layer) because the program is already the whole
step as a flat list; segments fall out of the call kinds the lowering records (`Program.call_kinds`).
Limitations: on the H200 (docs/gpu.md) cupy's cuBLAS refusal failed the capture of every network with a dense
layer; the eager calls between graphs that answer it are tested on the host only (the emulated capture of
tests/backend/test_capture.py), not yet on a GPU, and nothing about graphs is measured. Copies inside a graph
are not timed.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable

import numpy as np

from ..backend.base import backend_name
from ..backend.scalars import StepScalars
from ..core import startup

#: Call kinds the graph contains (they only enqueue device work on the compute stream).
DEVICE_KINDS = frozenset({"forward", "backward", "accumulate", "seed", "update", "refresh"})
#: Host copies: captured too (on their own streams, joined to compute by events) where the host store's copies
#: are stream copies between fixed pinned buffers (`HostStore.capturable`); their times are then not measured.
COPY_KINDS = frozenset({"offload", "release", "prefetch", "wait"})
#: Call kinds run on the host between graphs, with the reason.
HOST_KINDS = {"guard": "the divergence guard reads the loss and gradients on the host before the update"}
#: Host-only bookkeeping, run once per step outside the graphs.
HOISTED_KINDS = frozenset({"recompute_flops"})
#: Host calls that read what the step's flags say: run after the replay, once they are read (fp16's scale).
AFTER_KINDS = frozenset({"scale"})
#: Call kinds a capture cannot contain, with the reason the fallback gives.
REFUSED_KINDS = {
    "map": "the paged arena maps and unmaps chunks on the host at every step (driver calls a graph cannot replay)",
    "unmap": "the paged arena maps and unmaps chunks on the host at every step (driver calls a graph cannot replay)",
    "progress": "data parallel: the gradient all-reduce runs host calls (MPI/NCCL) inside the step",
    "allreduce": "data parallel: the gradient all-reduce runs host calls (MPI/NCCL) inside the step",
    "reduced": "data parallel: the gradient all-reduce runs host calls (MPI/NCCL) inside the step",
    "compress": "lossy compression encodes and decodes on the host (the sz codec) inside the step",
    "decompress": "lossy compression encodes and decodes on the host (the sz codec) inside the step",
    "observe": "lossy compression encodes and decodes on the host (the sz codec) inside the step",
}
#: Why host copies are not captured when they cannot be.
COPIES_REFUSED = ("host copies: a host limit (--host-limit) may put them on the disk tier, which a graph cannot "
                  "contain")
#: Steps run eagerly before the capture (they build what a capture cannot).
WARMUP_STEPS = 1


class CaptureRefused(Exception):
    """The step cannot be captured; the message says why (one line)."""


def why_not(ex, program) -> str | None:
    """Why executor `ex`'s compiled `program` cannot be captured as CUDA graphs (None: it can be tried)."""
    be = ex.be
    if not be.capabilities.graph_capture:
        return f"backend '{backend_name(be)}' has no graph capture (CUDA only): the compiled loop runs"
    if program is None:
        return f"the step is not compiled ({ex.program_fallback})"
    if ex.tracing:
        return "tracing times every call on the host; a graph runs them as one launch"
    if program.micro_batches > 1:
        return ("micro-batches: the host reads each micro-batch's loss and copies in its slice of the batch "
                "(one staging buffer and one loss per step is what a graph replays)")
    if any(sp.on_host for sp in ex.plan.steps):
        return "a host update (decisions/weights.py) runs the optimizer on the host inside the step"
    for kind in program.prologue_kinds + program.call_kinds:
        if kind in REFUSED_KINDS:
            return REFUSED_KINDS[kind]
        if kind in COPY_KINDS:
            if not be.capabilities.stream_copies:
                return "host copies run on a host thread on this backend, which a graph cannot contain"
            if ex.host_limit_bytes is not None:
                return COPIES_REFUSED
            continue
        if kind not in DEVICE_KINDS and kind not in HOST_KINDS and kind not in HOISTED_KINDS and kind != "loss" \
                and kind not in AFTER_KINDS and kind != "unscale":
            return f"call kind '{kind}' is unknown to minidl.runtime.capture"
    kind = _optimizer_kind(ex.opt)
    if kind not in ("sgd", "adam"):
        return (f"optimizer '{kind}': only SGD's and Adam's per-step scalars have device slots "
                f"(backend/scalars.py); a graph would replay the captured step's")
    if program.loss_view is None:
        return "the network has no loss layer whose value a graph could copy out"
    if ex.scaler is not None and not (be.capabilities.device_guard and ex.check_finite):
        return ("fp16's loss scale: a step whose gradients overflow is skipped on the device by the divergence "
                "guard's flag, which this run does not have (no device guard, or the guard off)")
    return None


def _optimizer_kind(opt) -> str:
    try:
        return str(opt.config().get("type", type(opt).__name__))
    except Exception:  # noqa: BLE001 - no config: not one we know
        return type(opt).__name__


def signature(ex) -> tuple:
    """The host values the captured kernels hold as launch arguments: a replay is valid while they hold."""
    cfg = ex.opt.config()
    return tuple(sorted((k, repr(v)) for k, v in cfg.items() if k != "lr")) + (
        ("first_update", ex.iteration == 0), ("guard", bool(ex.check_finite)))


@dataclass(slots=True)
class Segment:
    """One part of a step: a captured `graph`, a `host` call (after a wait), or `eager` calls enqueued behind the
    graph before them; `reason` says why a segment is not a graph."""

    calls: list[Callable[[], Any]]
    kinds: list[str]
    graph: Any = None
    host: Callable[[], Any] | None = None
    reason: str = ""
    eager: bool = False


#: How each call kind changes the number of host copies in flight.
COPY_BALANCE = {"offload": 1, "prefetch": 1, "release": -1, "wait": -1}


def split(program, copy_in: list[Callable[[], Any]], copy_out: Callable[[], Any], guard: bool = True,
          device_guard: Callable[..., Callable[[], Any]] | None = None,
          epilogue: list[Callable[[], Any]] = ()) -> tuple[list[Segment], list, list]:
    """The program's calls as segments: maximal runs of device calls (to capture) and the host calls between
    them. The prologue (step 0's events, device calls and copies) then `copy_in` (the batch: staging -> arena)
    open the first graph, in the eager loop's order; `copy_out` (the loss -> pinned) takes the
    place of the loss read; `guard` False leaves the divergence guard out (`Executor.check_finite` off: it would
    return at once); `device_guard(guard_call)`, where the backend can, is the device call that replaces a guard
    (then the step is one graph; fp16's unscaling becomes part of it: `device_guard(guard_call, unscale_call)`);
    `epilogue` closes the last graph. Returns (segments, hoisted host calls, host calls to run after the replay)."""
    first = list(program.prologue) + list(copy_in)   # step 0's events (weights, packs swapped in), then the batch
    segments: list[Segment] = [Segment(first, list(program.prologue_kinds) + ["copy_in"] * len(copy_in))]
    hoisted, after = [], []
    unscale = None   # fp16: the unscaling the next guard does on the device
    # host copies started and not yet waited for: a graph must end with none (its streams joined)
    in_flight = sum(COPY_BALANCE.get(kind, 0) for kind in program.prologue_kinds)
    for call, kind in zip(program.calls, program.call_kinds):
        if kind in HOISTED_KINDS:
            hoisted.append(call)
            continue
        if kind in AFTER_KINDS:
            after.append(call)
            continue
        if kind == "unscale":
            unscale = call
            continue
        if kind == "guard" and not guard:
            continue
        if kind == "guard" and device_guard is not None:
            call, kind, unscale = device_guard(call, unscale), "device_guard", None
        elif kind in HOST_KINDS:
            if in_flight:
                raise CaptureRefused(f"{HOST_KINDS[kind]}, between a host copy and its wait (a graph must end "
                                     f"with its copies joined): an unfused update, or no guard, avoids it")
            segments.append(Segment([], [], host=call, reason=HOST_KINDS[kind]))
            continue
        in_flight += COPY_BALANCE.get(kind, 0)
        if kind == "loss":
            call, kind = copy_out, "copy_out"
        if segments[-1].host is not None:
            segments.append(Segment([], []))
        segments[-1].calls.append(call)
        segments[-1].kinds.append(kind)
    if epilogue:
        if segments[-1].host is not None:
            segments.append(Segment([], []))
        segments[-1].calls.extend(epilogue)
        segments[-1].kinds.extend(["epilogue"] * len(epilogue))
    if unscale is not None:
        raise CaptureRefused("fp16's unscaling is done on the device by the divergence guard, which this step "
                             "does not have")
    return [s for s in segments if s.host is not None or s.calls], hoisted, after


class GraphStep:
    """`run(x, y)` has `Program.run(x, y)`'s effect, as captured graphs (again whenever `signature` changes)."""

    def __init__(self, ex, program):
        self.ex, self.program, self.be = ex, program, ex.be
        be = self.be
        self.staging = [be.host_empty(shape, view.dtype) for view, shape in zip(program.inputs, program.input_shapes)]
        lv = program.loss_view
        self.loss_flat = lv.reshape(-1)   # 0-d host<->device copies are fragile
        self.loss_host = be.host_empty(tuple(self.loss_flat.shape), lv.dtype)
        self.scalars = StepScalars(be, [node for _, node, _ in program.keyed])
        self.loss_slot = be.scalar_buffer("graph_loss", int(self.loss_flat.size), lv.dtype)
        # device guard code - 1 -> (step, layer, parameter or buffer, whether a buffer); layer None: the loss
        self.codes: list[tuple[Any, str | None, str | None, bool]] = []
        self.segments: list[Segment] | None = None
        self.hoisted: list[Callable[[], Any]] = []
        self.after: list[Callable[[], Any]] = []
        self.signature: tuple | None = None
        self.copies: list[tuple[str, str, int]] = []   # (kind, tensor, bytes) copied inside the graphs
        self.captures = 0
        self.replays = 0
        self.eager_steps = 0
        self._changed_last = False

    # -- capture
    def capture(self) -> None:
        """Capture the step's device segments. Raises CaptureRefused."""
        with startup.phase("capture"):
            self._capture()

    def _capture(self) -> None:
        be, program = self.be, self.program
        scaled = self.ex.scaler is not None
        copy_in = [_copy(be.copy_in_async, dev, host) for dev, host in self.scalars.copies(scaled)]
        copy_in += [_copy(be.copy_in_async, view, buf) for view, buf in zip(program.inputs, self.staging)]
        sc = self.scalars
        guard = bool(self.ex.check_finite)
        device_guard = epilogue = None
        self.codes = []
        if guard and be.capabilities.device_guard:
            device_guard = self._device_guard
            epilogue = [_copy(be.copy_out_async, sc.diverged, sc.diverged_out)]
            if scaled:
                epilogue.append(_copy(be.copy_out_async, sc.found_inf, sc.found_inf_out))
            loss_out = self._keep_loss   # the loss kept where the guards can read it, and copied out
        else:
            loss_out = _copy(be.copy_out_async, self.loss_flat, self.loss_host)
        segments, hoisted, after = split(program, copy_in, loss_out, guard=guard, device_guard=device_guard,
                                         epilogue=epilogue or [])
        host = self.ex.host
        if host is not None and host.capturable is not None:
            raise CaptureRefused(host.capturable)
        be.prepare_graph()
        be.graph_scalars = self.scalars  # the backend launches the `_dev` kernels, reading these slots
        skipped, self.ex.skip_update = self.ex.skip_update, False   # the updates are recorded; the flags skip them
        try:
            segments, copies = record(be, segments, host)
        finally:
            be.graph_scalars = None
            self.ex.skip_update = skipped
            if host is not None:  # the copies issued while capturing belong to a graph: never to be settled
                host.drop_captured()
        self.segments, self.hoisted, self.after, self.copies = segments, hoisted, after, copies
        self.captures += 1

    # -- the divergence guard on the device
    def _keep_loss(self) -> None:
        """The loss into its own slot (its block may be reused before the guard) and out to pinned memory."""
        be = self.be
        be.copy(self.loss_slot, self.loss_flat)
        be.copy_out_async(self.loss_slot, self.loss_host)

    def _device_guard(self, guard_call, unscale_call=None) -> Callable[[], Any]:
        """The device call replacing `guard_call` (a binding.GuardCall): `nonfinite_flag` on each gradient, then
        on the loss, then on each running statistic, in the host guard's order; each gets a code (an index into
        `self.codes`) the host reads back after the step to raise the very error the host guard raises. With
        fp16's `unscale_call` (a binding.UnscaleCall) first each of its gradients is checked into `found_inf` and
        unscaled, and the gradients' checks come last (see the module docstring)."""
        be, checks = self.be, []
        grads = []
        for layer, pname, g in guard_call.grads:
            self.codes.append((guard_call.step, layer, pname, False))
            grads.append((g, len(self.codes)))
        if unscale_call is None:
            checks += grads
        self.codes.append((guard_call.step, None, None, False))
        checks.append((self.loss_slot, len(self.codes)))
        for layer, name, b in guard_call.buffers:
            self.codes.append((guard_call.step, layer, name, True))
            checks.append((b, len(self.codes)))
        if unscale_call is not None:
            checks += grads
        scaler = self.ex.scaler
        unscaled = [] if unscale_call is None else unscale_call.grads

        def run() -> None:
            if unscaled:
                inv = scaler.inv_scale
                for g in unscaled:
                    be.found_inf_flag(g)
                    be.unscale(g, inv)
            for arr, code in checks:
                be.guard_nonfinite(arr, code)
        return run

    def _raise_if_diverged(self) -> None:
        """After a replay with the device guard: the first non-finite tensor's code, if any, raised as the host
        guard raises it (its message, its note on fused updates already applied); no update ran after it. fp16:
        a gradient's code after an overflow is the skipped step (`skip_update`), not a divergence."""
        code = int(self.scalars.diverged_out[0])
        if self.ex.scaler is not None:
            self.ex.skip_update = bool(self.scalars.found_inf_out[0])
            if self.ex.skip_update and code and self.codes[code - 1][1] is not None and not self.codes[code - 1][3]:
                return
        if not code:
            return
        step, layer, name, buffer = self.codes[code - 1]
        bad = [] if layer is None else [(layer, name, np.full(1, np.nan, np.float32))]
        self.ex.guard_update(step, [] if buffer else bad, bad if buffer else [])
        raise RuntimeError(f"the device guard flagged code {code} but the host guard found nothing")  # noqa

    # -- one step
    def run(self, x, y) -> float:
        ex, program = self.ex, self.program
        if self.eager_steps < WARMUP_STEPS:
            self.eager_steps += 1
            return program.run(x, y)
        it = ex.iteration
        keys = program.step_keys(it)
        for (ctx, _, _), key in zip(program.keyed, keys):
            ctx.rng_key = key
        sc = ex.scaler
        self.scalars.fill(keys, getattr(ex.opt, "lr", 0.0), it + 1, *((sc.scale, sc.inv_scale) if sc else ()))
        sig = signature(ex)
        if sig != self.signature:
            if self.signature is not None and self._changed_last:
                raise CaptureRefused("the optimizer's launch arguments (hyper-parameters other than the learning "
                                     "rate) change at every step; a graph would replay the captured ones")
            self._changed_last = self.signature is not None
            self.capture()
            self.signature = sig
        else:
            self._changed_last = False
        for buf, arr in zip(self.staging, (x, y)):
            np.copyto(buf, arr, casting="unsafe")
        be = self.be
        for seg in self.segments:
            if seg.graph is not None:
                be.launch_graph(seg.graph)
            elif seg.eager:
                self._run_eager(seg)
            else:  # a host call waits for the graphs before it
                be.wait_compute()
                ex.last_loss = float(self.loss_host.reshape(-1)[0])
                seg.host()
        for call in self.hoisted:
            call()
        be.wait_compute()   # compute joined every copy stream
        ex.last_loss = float(self.loss_host.reshape(-1)[0])
        if self.copies:
            ex.host.count_replayed(self.copies)
        if self.codes:
            self._raise_if_diverged()
        for call in self.after:
            call()
        self.replays += 1
        return ex.end_iteration()

    def _run_eager(self, seg: Segment) -> None:
        """Enqueue the uncapturable calls behind the graph before them; `graph_scalars` stays set, so their `_dev`
        variants read this step's slots and skip after a flagged guard."""
        be = self.be
        be.graph_scalars = self.scalars
        try:
            for call in seg.calls:
                call()
        finally:
            be.graph_scalars = None

    @property
    def graphs(self) -> int:
        """Graphs launched per step (0 before the capture)."""
        return sum(1 for s in self.segments or () if s.graph is not None)

    @property
    def eager_calls(self) -> int:
        """Calls per step run eagerly between the graphs."""
        return sum(len(s.calls) for s in self.segments or () if s.eager)

    def describe(self) -> str:
        """One line for reports: how the step runs."""
        if self.segments is None:
            return "cuda graph: not captured yet (warm-up step)"
        graphs = self.graphs
        hosts = sorted({s.reason for s in self.segments if s.host is not None})
        line = f"cuda graph: {graphs} graph{'s' if graphs != 1 else ''} per step"
        if self.codes:
            line += " (divergence guard on the device)"
        if hosts:
            line += " (split where " + "; ".join(hosts) + ")"
        eager = [s for s in self.segments if s.eager]
        if eager:
            n = self.eager_calls
            kinds = sorted({k for s in eager for k in s.kinds})
            reasons = sorted({s.reason for s in eager})
            line += (f", {n} call{'s' if n != 1 else ''} ({', '.join(kinds)}) run eagerly between them (the backend "
                     f"cannot capture them: {'; '.join(reasons)})")
        return line


def record(be, segments: list[Segment], host=None) -> tuple[list[Segment], list[tuple[str, str, int]]]:
    """Capture each device segment in one pass; at a `CaptureUnsupported` call, the calls before it are captured
    again and the call made eager. Returns (segments, the kept graphs' host copies); raises CaptureRefused."""
    rec = _Recorder(be, host)
    out: list[Segment] = []
    for seg in segments:
        out += [seg] if seg.host is not None else rec.segment(seg)
    if rec.grown:
        raise CaptureRefused(f"cupy allocated {rec.grown} bytes outside the arena while capturing (a temporary the "
                             f"graph would keep using after cupy reuses its memory)")
    return out, rec.copies


class _Recorder:
    """The captures of `record`: what the kept graphs allocated (`grown`) and the host copies they hold."""

    def __init__(self, be, host):
        self.be, self.host = be, host
        self.unsupported = tuple(be.CaptureUnsupported)
        self.grown = 0
        self.copies: list[tuple[str, str, int]] = []
        self._strays = 0

    def segment(self, seg: Segment) -> list[Segment]:
        """`seg` as graphs and eager segments."""
        calls, kinds = seg.calls, seg.kinds
        # host copies in flight before each call
        in_flight = list(accumulate((COPY_BALANCE.get(k, 0) for k in kinds), initial=0))
        out: list[Segment] = []
        start = 0
        while start < len(calls):
            self._begin()
            i = start
            try:
                while i < len(calls):
                    calls[i]()
                    i += 1
            except self.unsupported as e:
                self._drop()
                reason = f"{type(e).__name__}: {_one_line(e)}"
            except Exception as e:
                self._drop()
                raise CaptureRefused(f"the capture failed: {type(e).__name__}: {_one_line(e)}") from e
            else:
                out.append(self._keep(calls[start:], kinds[start:]))
                break
            kind = kinds[i]
            if kind in COPY_KINDS:
                raise CaptureRefused(f"the backend cannot capture a host copy ({kind}: {reason})")
            if in_flight[i]:
                raise CaptureRefused(f"a {kind} call the backend cannot capture ({reason}) falls between a host "
                                     f"copy and its wait, where it cannot run between graphs (a graph must end "
                                     f"with its copies joined)")
            if i > start:   # the calls before it, captured again
                out.append(self._capture(calls[start:i], kinds[start:i]))
            if out and out[-1].eager:
                out[-1].calls.append(calls[i])
                out[-1].kinds.append(kind)
                if reason not in out[-1].reason.split("; "):
                    out[-1].reason += f"; {reason}"
            else:
                out.append(Segment([calls[i]], [kind], eager=True, reason=reason))
            start = i + 1
        return out

    def _begin(self) -> None:
        self._strays = self.be.stray_bytes
        self.be.begin_graph()

    def _keep(self, calls, kinds) -> Segment:
        graph = self.be.end_graph()
        self.grown += self.be.stray_bytes - self._strays
        if self.host is not None:
            self.copies += self.host.drop_captured()
        return Segment(list(calls), list(kinds), graph=graph)

    def _drop(self) -> None:
        _end_quietly(self.be)
        if self.host is not None:
            self.host.drop_captured()

    def _capture(self, calls, kinds) -> Segment:
        self._begin()
        try:
            for call in calls:
                call()
        except Exception as e:
            self._drop()
            raise CaptureRefused(f"the capture failed: {type(e).__name__}: {_one_line(e)}") from e
        return self._keep(calls, kinds)


def _copy(fn, a, b) -> Callable[[], Any]:
    return lambda: fn(a, b)


def _end_quietly(be) -> None:
    try:
        be.end_graph()
    except Exception:  # noqa: BLE001 - an invalidated capture raises when ended
        pass


def _one_line(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def graph_step(ex, program) -> tuple[GraphStep | None, str | None]:
    """(a GraphStep for `ex`, None) when its program can be captured, else (None, the reason)."""
    reason = why_not(ex, program)
    if reason is not None:
        return None, reason
    return GraphStep(ex, program), None
