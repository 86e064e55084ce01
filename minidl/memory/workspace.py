"""Convolution workspace sizing: which algorithm each convolution runs, given the memory free at its step.

A convolution can be computed several ways that give the same numbers but need different scratch space
("workspace"). On the CPU (`minidl.backend.cpu.conv`):

- ``im2col``          builds the column matrix of the whole batch: the largest workspace, usually fastest;
- ``im2col_chunked``  builds it one sample at a time: 1/N of the workspace, a little slower;
- ``gemm_1x1``        a 1x1 stride-1 convolution *is* a GEMM on the input: no workspace at all;
- ``rows`` / ``rows_chunked`` replace the im2col pair for convolutions with stride 1 down the rows (most 3x3
  ones): only the kw column taps are built, the kh row taps are views (whole batch / one sample at a time).
  A layer's menu is one family or the other, fixed by its configuration, so whatever fits, the bits are the same.
- ``winograd`` / ``winograd_by_position`` replace them for 3x3 stride-1 layers with >= 32 channels (on by
  default): Winograd F(2x2, 3x3) on all 16 tile positions at once, or one position at a time in a sixteenth of
  the memory, summed in the same order.

cuDNN offers the same kind of menu on a GPU (implicit GEMM with no workspace, FFT and Winograd with a lot).
SuperNeurons' rule, which minidl follows: try every algorithm once per shape, remember how fast each one is,
and at every step give the convolution the fastest algorithm whose workspace fits in the memory that is free
*at that step*. Memory is tight exactly where activations pile up (the end of forward, the start of backward);
elsewhere the fast, hungry algorithm costs nothing.

The pieces:

0. **The menu** is the backend's: the route asks each layer, once per step, which algorithms the backend
   the plan is for can run it with (`Step.workspace_options`; the CPU table above, or cuDNN's execution plans
   with their workspace sizes on CUDA). Every pass below reads that list, so a plan for a GPU sizes GPU
   workspaces, and its algorithm names are the ones the GPU backend executes.

1. **Costs** (`CostTable`). By default the cost of an algorithm is the menu's own estimate
   (`WorkspaceOption.est_cost`, a relative number): deterministic, which keeps plans reproducible in tests.
   `CostTable(autotune=True)` instead *measures* each algorithm once per (backend, layer type, configuration,
   phase, shapes, dtype) on that backend, like `cudnnFindConvolutionForwardAlgorithm`, and caches the seconds
   in memory and, with `path=`, in a JSON file that later runs load instead of measuring again. Measured times
   are noisy, so a plan made from them can differ between machines or runs that re-measure; a cache file pins
   them. That is why measuring is opt-in.

2. **Ranking** (`workspace_choices`). For every step that offers algorithms, the options sorted fastest first
   by the cost table, handed to the planner as a `WorkspaceChoice` with `options`.

3. **Fitting** (`fit_workspace`, `WorkspaceFitter`). With a budget, the planner's placement pass places a
   step's workspace after the step's other allocations, asks how large the largest hole *below the budget* is
   at that moment, and takes the fastest option whose (rounded) workspace fits it. Faster options that did not
   fit are recorded as `refused` on the step, and reports print them ("im2col refused: needs 18.4 MiB, 6.1 MiB
   free"). If nothing fits, the smallest workspace is taken and the plan fails the budget check, naming the
   smallest budget that works.

Because every algorithm gives bit-identical results, this choice changes memory and speed, never values.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..backend import backend_name, menu_of
from ..backend.cpu.menu import CPU_MENU
from ..core.errors import OptionError
from ..core.vocab import WorkspaceOption
from ..graph.route import Phase, Route
from ..layers.base import Layer, LayerContext
from .pool import ALIGNMENT, align_up, format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .plan import StepPlan
    from .pool import TensorPool

Shape = tuple[int, ...]


@dataclass(slots=True)
class WorkspaceChoice:
    """The algorithm a step runs and its workspace bytes. With `options` (ranked fastest first) and a budget,
    placement re-decides at the step itself: the fastest option whose workspace fits the memory free then."""

    algo: str | None
    nbytes: int
    refused: list[str] = field(default_factory=list)
    options: list | None = None  # list[WorkspaceOption], fastest first; None: `algo` is final


# -- costs ------------------------------------------------------------------------------------------------------
def cost_key(layer: Layer, phase: str, in_shapes: Sequence[Shape], out_shape: Shape, itemsize: int,
             backend_name: str = "cpu") -> str:
    """The identity of one measurement: backend, layer type and configuration, phase, shapes and item size.

    Two convolutions with the same key run the same kernels on the same amount of data, so one measurement
    serves both (a ResNet-2500 has thousands of convolutions but a few dozen distinct keys).
    """
    cfg = json.dumps(layer.config(), sort_keys=True, default=str)
    shapes = ";".join("x".join(map(str, s)) for s in in_shapes)
    return f"{backend_name}|{layer.type_name}|{cfg}|{phase}|{shapes}->{'x'.join(map(str, out_shape))}|{itemsize}"


@dataclass
class CostTable:
    """Seconds (or relative cost) per algorithm, per `cost_key`.

    autotune=False (default): costs are the menu's `est_cost`; deterministic, nothing is run.
    autotune=True: each (key, algorithm) is measured once on `backend` (None: the CPU backend; `repeats`
    runs, the fastest kept), cached here and, with `path`, written to a JSON file that is read back on
    construction. Entries already in the file are never measured again, so a cache file makes planning
    deterministic as well.
    """

    autotune: bool = False
    backend: object = None
    path: str | Path | None = None
    repeats: int = 3
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    measured: int = 0  # measurements made by this table (not loaded from the file)
    _best: dict[tuple[str, int], str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.path is not None and Path(self.path).exists():
            data = json.loads(Path(self.path).read_text())
            self.seconds.update({k: dict(v) for k, v in data.get("seconds", {}).items()})

    def save(self) -> None:
        if self.path is None:
            return
        p = Path(self.path)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps({"format": "minidl-workspace-costs/1", "seconds": self.seconds}, indent=1,
                                  sort_keys=True))
        tmp.replace(p)

    @property
    def backend_name(self) -> str:
        return backend_name(self.backend)

    @property
    def menu(self):
        """The algorithms this table measures: its backend's (the CPU's menu without one)."""
        return menu_of(self.backend) if self.backend is not None else CPU_MENU

    def rank(self, layer: Layer, phase: str, in_shapes: Sequence[Shape], out_shape: Shape,
             itemsize: int, options: Sequence[WorkspaceOption] | None = None) -> list[WorkspaceOption]:
        """The options for `phase` (`options`, else the layer's menu on this table's backend), fastest first,
        with `est_cost` set to this table's cost."""
        opts = list(options) if options is not None else layer.workspace_options(
            phase, in_shapes, out_shape, itemsize, self.menu)
        if not self.autotune or not opts:
            return sorted(opts, key=lambda o: (o.est_cost, o.workspace_bytes, o.algo))
        key = cost_key(layer, phase, in_shapes, out_shape, itemsize, self.backend_name)
        entry = self.seconds.setdefault(key, {})
        missing = [o for o in opts if o.algo not in entry]
        for o in missing:
            entry[o.algo] = measure(layer, phase, in_shapes, out_shape, itemsize, o, self.repeats, self.backend)
            self.measured += 1
        if missing:
            self.save()
        ranked = [WorkspaceOption(o.algo, o.workspace_bytes, entry[o.algo]) for o in opts]
        return sorted(ranked, key=lambda o: (o.est_cost, o.workspace_bytes, o.algo))

    def best_under(self, layer: Layer, phase: str, in_shapes: Sequence[Shape], out_shape: Shape, itemsize: int,
                   limit: int) -> str:
        """cudnnFind's question: the fastest algorithm whose workspace is at most `limit` bytes (memoized by
        shape and limit). If none fits, the one with the smallest workspace."""
        key = (cost_key(layer, phase, in_shapes, out_shape, itemsize, self.backend_name), int(limit))
        if key not in self._best:
            chosen, _ = fit_workspace(self.rank(layer, phase, in_shapes, out_shape, itemsize), limit)
            self._best[key] = chosen.algo
        return self._best[key]


def measure(layer: Layer, phase: str, in_shapes: Sequence[Shape], out_shape: Shape, itemsize: int,
            option: WorkspaceOption, repeats: int = 3, backend=None) -> float:
    """Seconds one `phase` call of `layer` takes with `option` on `backend` (None: the CPU backend), on random
    data (fastest of `repeats`). Arrays are made with the backend's array module (`xp`) and the clock is read
    after `synchronize()`, so a GPU's asynchronous kernels are timed to completion."""
    from ..backend.cpu.backend import CPUBackend
    from ..graph.network import Network

    be = backend if backend is not None else CPUBackend()
    xp = be.xp
    sync = be.synchronize
    dtype = np.float32 if itemsize == 4 else np.float64
    rng = np.random.default_rng(0)
    net = Network("autotune", dtype=dtype)
    syms = [net.input(s, name=f"in{i}") for i, s in enumerate(in_shapes)]
    probe = type(layer).__new__(type(layer))  # a fresh copy: a layer object joins only one graph
    probe.__dict__.update(layer.__dict__)
    probe._called = False
    node = probe(*syms).node
    xs = [xp.asarray(rng.standard_normal(s).astype(dtype)) for s in in_shapes]
    params = {p: xp.asarray(rng.standard_normal(spec.shape).astype(dtype) * 0.1) for p, spec in node.params.items()}
    out = xp.empty(out_shape, dtype)
    ws = xp.empty(max(option.workspace_bytes, 1), np.uint8)
    ctx = LayerContext(training=True, workspace=ws, algo=option.algo)
    if phase == "fwd":
        def run():
            probe.forward(be, xs, out, params, ctx)
    else:
        dout = xp.asarray(rng.standard_normal(out_shape).astype(dtype))
        dxs = [xp.empty(s, dtype) for s in in_shapes]
        grads = {p: xp.empty(spec.shape, dtype) for p, spec in node.params.items() if spec.trainable}

        def run():
            probe.backward(be, xs, out, dout, dxs, grads, params, ctx)
    run()  # warm up (page faults, caches, a GPU's lazy graph builds)
    sync()
    best = math.inf
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


# -- ranking ------------------------------------------------------------------------------------------------------
def workspace_choices(route: Route, costs: CostTable | None = None) -> dict[int, "WorkspaceChoice"]:
    """Per step that offers algorithms: the fastest one, plus every option ranked fastest first.

    Handed to `make_plan(..., workspace=...)`. Without a budget the fastest is used everywhere (exactly what
    `default_workspace` does); with one, placement re-decides per step by the memory free then.
    """

    costs = costs or CostTable()
    net = route.network
    out: dict[int, WorkspaceChoice] = {}
    for step in route.steps:
        if step.workspace is None:
            continue
        node = net.nodes[step.node]
        phase = "fwd" if step.phase is Phase.FORWARD else "bwd"
        in_shapes, out_shape = route.shapes_of(node.index)  # a micro-batch's, on a packed route
        if costs.autotune and costs.backend_name != route.backend_name:
            raise OptionError(f"the cost table measures on backend '{costs.backend_name}' but the route lists "
                              f"the algorithms of backend '{route.backend_name}'")
        opts = costs.rank(node.layer, phase, in_shapes, out_shape, net.dtype.itemsize, step.workspace_options)
        out[step.index] = WorkspaceChoice(opts[0].algo, opts[0].workspace_bytes, [], opts)
    return out


def frugal_workspace(route: Route, costs: CostTable | None = None) -> dict[int, "WorkspaceChoice"]:
    """Every step on its smallest-workspace algorithm (ties: the faster), fixed: the most memory-frugal choice."""
    return smallest_workspaces(workspace_choices(route, costs), "not tried (most frugal plan)")


def smallest_workspaces(ws: dict[int, "WorkspaceChoice"], why: str) -> dict[int, "WorkspaceChoice"]:
    """`ws` with every open choice (one with options) fixed on its smallest workspace (ties: the faster), each
    faster option noted as refused with `why`; fixed choices are kept as they are."""
    out = {}
    for k, c in ws.items():
        if not c.options:
            out[k] = c
            continue
        o = min(c.options, key=lambda o: (align_up(o.workspace_bytes), o.est_cost))
        out[k] = WorkspaceChoice(o.algo, o.workspace_bytes,
                                 [f"{f.algo}: {why}" for f in c.options if f.est_cost < o.est_cost])
    return out


# -- fitting ------------------------------------------------------------------------------------------------------
def fit_workspace(options: Sequence[WorkspaceOption], free_bytes: int) -> tuple[WorkspaceOption, list[str]]:
    """The fastest option (options are ranked fastest first) whose rounded workspace fits in `free_bytes`,
    and a note for each faster option refused for lack of memory. If none fits: the smallest workspace."""
    refused: list[str] = []
    for o in options:
        if align_up(o.workspace_bytes) <= free_bytes:
            return o, refused
        refused.append(f"{o.algo}: needs {format_bytes(align_up(o.workspace_bytes))}, "
                       f"{format_bytes(max(free_bytes, 0))} free")
    smallest = min(options, key=lambda o: (o.workspace_bytes, o.est_cost))
    return smallest, [r for o, r in zip(options, refused) if o is not smallest]


def largest_free_below(pool: "TensorPool", limit: int) -> int:
    """Bytes of the largest free hole of `pool` that lies below `limit` (a hole crossing it counts up to it)."""
    if hasattr(pool, "free_below"):   # a paged pool: free chunks are usable wherever they are
        return pool.free_below(limit)
    limit = limit // ALIGNMENT * ALIGNMENT
    best = 0
    for b in pool._free.values():  # the free holes only (not every block): cheap even for huge plans
        avail = min(b.offset + b.size, limit) - b.offset
        if avail > best:
            best = avail
    return best


class WorkspaceFitter:
    """The planner's hook (see `planner._place_schedule`): decides each open workspace when it is placed."""

    def __init__(self, route: Route, ws: dict[int, "WorkspaceChoice"], budget: int, steps: list["StepPlan"]):
        self.route, self.ws, self.budget, self.steps = route, ws, int(budget), steps
        self.step_of = {route.steps[k].workspace: k for k, c in ws.items() if c.options}
        self._reason: dict[str, str] = {}

    def is_open(self, tid: str) -> bool:
        return tid in self.step_of

    def choose(self, tid: str, pool: "TensorPool") -> int:
        k = self.step_of[tid]
        free = largest_free_below(pool, self.budget)
        chosen, refused = fit_workspace(self.ws[k].options, free)
        sp = self.steps[k]
        sp.algo, sp.workspace_bytes, sp.refused = chosen.algo, chosen.workspace_bytes, refused
        why = f"workspace of {chosen.algo} (fastest that fits {format_bytes(free)} free under the budget)"
        if refused:
            why += "; refused " + ", ".join(r.split(":")[0] for r in refused)
        self._reason[tid] = why
        return chosen.workspace_bytes

    def reason(self, tid: str) -> str:
        return self._reason.get(tid, "workspace")
