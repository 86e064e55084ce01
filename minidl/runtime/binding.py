"""The step binding: the executor assembles each call of a step once and hands it, as a `BoundCall`, to a sink
(the interpreter's runs it, the compiled step's records it), so the two cannot drift apart. `StepBinding` is all
of the executor the program and the capture may use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from ..graph.route import Step
    from ..layers.base import LayerContext

Call = Callable[[], Any]


@dataclass(slots=True)
class LayerCall:
    """A layer's forward or backward as assembled: what a runner may fuse, or key per step."""

    node: Any
    inputs: list                    # backward: None where the layer does not read it
    out: Any                        # backward: None unless the layer reads it
    params: dict
    ctx: "LayerContext"
    micro: int = 0                  # the micro-batch (its dropout key: iteration * M + micro)
    recompute: bool = False         # re-run by a RECOMPUTE event (not the route's own step)
    dout: Any = None                # backward: the output's gradient
    dinputs: list | None = None     # backward: where each input's gradient goes (None: not wanted)
    grads: dict | None = None       # backward: the parameters' gradients
    staging: Any = None             # the step's staging (a half mode on the CPU), bound before the call runs


@dataclass(slots=True)
class BoundCall:
    """`fn(*args)` of a `kind` ("forward", "offload", ...) at route step `step`; `layer`: a layer's call as
    assembled; `items`: an update's (param, grad, state) triples."""

    kind: str
    fn: Callable[..., Any]
    args: tuple = ()
    step: "Step | None" = None
    layer: LayerCall | None = None
    items: list | None = None

    def __call__(self) -> Any:
        return self.fn(*self.args)


Sink = Callable[[BoundCall], None]


def run_now(call: BoundCall) -> None:
    """The interpreter's sink."""
    call.fn(*call.args)


@dataclass(slots=True)
class GuardCall:
    """One UPDATE's divergence guard, with what a CUDA graph needs to run it on the device."""

    ex: Any
    step: "Step"
    grads: list   # (layer, parameter, gradient view), in backward order
    buffers: list  # (layer, buffer, view): running statistics, at the first update only

    def __call__(self) -> None:
        self.ex.guard_update(self.step, self.grads, self.buffers)


@dataclass(slots=True)
class UnscaleCall:
    """fp16's unscaling of one UPDATE step's gradients before its guard (`StepBinding.unscale`), and the gradients
    a CUDA graph unscales on the device instead (`minidl.runtime.capture`)."""

    ex: Any
    grads: list   # gradient views, in the guard's order

    def __call__(self) -> None:
        self.ex.unscale(self.grads)


class StepBinding(Protocol):
    """The executor as its step runners see it."""

    be: Any
    net: Any
    route: Any
    plan: Any
    opt: Any
    pool: Any
    trace: list
    tracing: bool
    call_clock: Any      # the backend's CallClock while tracing (None otherwise)
    timed_calls: list    # a traced step's marks, read into `trace` when it ends
    debug: bool
    iteration: int
    last_loss: float
    check_finite: bool
    skip_update: bool    # fp16: this step's gradients overflowed, its update is skipped (`Executor.unscale`)
    scaler: Any          # fp16's LossScaler (None in the other modes)
    host: Any
    host_limit_bytes: int | None
    program_fallback: str | None

    @property
    def t0(self) -> float: ...

    def bind_events(self, events: list, step: "Step", sink: Sink) -> None: ...

    def bind_compute(self, step: "Step", sp: Any, sink: Sink, recompute: bool = False) -> None: ...

    def bind_after_compute(self, step: "Step", sink: Sink) -> None: ...

    def bind_progress(self, step: "Step", sink: Sink) -> None: ...

    def batch_slots(self, step: "Step") -> list[tuple[Any, int, int | None, int | None]]: ...

    def seed_key(self, node_index: int, iteration: int) -> int: ...

    def staged(self, fn, staging): ...

    def guard_update(self, step: "Step", grads: list | None = None, buffers: list | None = None) -> None: ...
    def unscale(self, grads: list) -> None: ...

    def end_iteration(self) -> float: ...
