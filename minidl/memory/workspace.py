"""Convolution workspace sizing: which algorithm each convolution runs, given the memory free at its step.

SuperNeurons' rule: rank a layer's algorithms by speed once per shape and give each step the fastest whose
workspace fits the memory free *at that step*. The menu is the backend's (`Step.workspace_options`: the CPU's
`cpu.conv` table or cuDNN's execution plans), so a GPU plan sizes GPU workspaces. Costs (`CostTable`) are the
menu's `est_cost` (deterministic), or measured once per `cost_key` with `autotune=True` and cached in a JSON
file. Placement (`WorkspaceFitter`) takes the fastest option fitting the largest hole below the budget, records
faster ones as `refused`, else the smallest. Rule: every algorithm of a layer gives the same bits, so this
choice changes memory and speed, never values.
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
    """A step's algorithm and workspace bytes; with `options` (fastest first), placement decides."""

    algo: str | None
    nbytes: int
    refused: list[str] = field(default_factory=list)
    options: list | None = None  # list[WorkspaceOption], fastest first; None: `algo` is final


# -- costs
def cost_key(layer: Layer, phase: str, in_shapes: Sequence[Shape], out_shape: Shape, itemsize: int,
             backend_name: str = "cpu", accumulate: frozenset[int] = frozenset()) -> str:
    """One measurement's identity: backend, layer type and configuration, phase (with the input slots a
    backward accumulates into), shapes, item size; equal keys share a measurement."""
    cfg = json.dumps(layer.config(), sort_keys=True, default=str)
    shapes = ";".join("x".join(map(str, s)) for s in in_shapes)
    phase += "".join(f"+acc{k}" for k in sorted(accumulate))
    return f"{backend_name}|{layer.type_name}|{cfg}|{phase}|{shapes}->{'x'.join(map(str, out_shape))}|{itemsize}"


@dataclass
class CostTable:
    """Seconds (or relative cost) per algorithm, per `cost_key`: the menu's `est_cost`, or with
    `autotune` measured once on `backend` (fastest of `repeats`) and kept in `path`, never measured again."""

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
        """The algorithms this table measures: its backend's (the CPU's without one)."""
        return menu_of(self.backend) if self.backend is not None else CPU_MENU

    def rank(self, layer: Layer, phase: str, in_shapes: Sequence[Shape], out_shape: Shape,
             itemsize: int, options: Sequence[WorkspaceOption] | None = None,
             accumulate: frozenset[int] = frozenset()) -> list[WorkspaceOption]:
        """The options for `phase` (`options`, else the layer's menu), fastest first by this table."""
        opts = list(options) if options is not None else layer.workspace_options(
            phase, in_shapes, out_shape, itemsize, self.menu, accumulate)
        if not self.autotune or not opts:
            return sorted(opts, key=lambda o: (o.est_cost, o.workspace_bytes, o.algo))
        key = cost_key(layer, phase, in_shapes, out_shape, itemsize, self.backend_name, accumulate)
        entry = self.seconds.setdefault(key, {})
        missing = [o for o in opts if o.algo not in entry]
        for o in missing:
            entry[o.algo] = measure(layer, phase, in_shapes, out_shape, itemsize, o, self.repeats, self.backend,
                                    accumulate)
            self.measured += 1
        if missing:
            self.save()
        ranked = [WorkspaceOption(o.algo, o.workspace_bytes, entry[o.algo]) for o in opts]
        return sorted(ranked, key=lambda o: (o.est_cost, o.workspace_bytes, o.algo))

    def best_under(self, layer: Layer, phase: str, in_shapes: Sequence[Shape], out_shape: Shape, itemsize: int,
                   limit: int) -> str:
        """The fastest algorithm whose workspace is at most `limit` bytes, else the smallest."""
        key = (cost_key(layer, phase, in_shapes, out_shape, itemsize, self.backend_name), int(limit))
        if key not in self._best:
            chosen, _ = fit_workspace(self.rank(layer, phase, in_shapes, out_shape, itemsize), limit)
            self._best[key] = chosen.algo
        return self._best[key]


def measure(layer: Layer, phase: str, in_shapes: Sequence[Shape], out_shape: Shape, itemsize: int,
            option: WorkspaceOption, repeats: int = 3, backend=None, accumulate: frozenset[int] = frozenset()) -> float:
    """Seconds of one `phase` call of `layer` with `option` on `backend` (None: CPU) on random data, fastest
    of `repeats`, timed after `synchronize()`."""
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
    ctx = LayerContext(training=True, workspace=ws, algo=option.algo, accumulate=frozenset(accumulate))
    if phase == "fwd":
        def run():
            probe.forward(be, xs, out, params, ctx)
    else:
        dout = xp.asarray(rng.standard_normal(out_shape).astype(dtype))
        dxs = [xp.zeros(s, dtype) for s in in_shapes]  # read where accumulated into
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


# -- ranking
def workspace_choices(route: Route, costs: CostTable | None = None) -> dict[int, "WorkspaceChoice"]:
    """Per step that offers algorithms: the fastest, with every option ranked (for placement)."""

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
        opts = costs.rank(node.layer, phase, in_shapes, out_shape, net.dtype.itemsize, step.workspace_options,
                          step.accumulates_into)
        out[step.index] = WorkspaceChoice(opts[0].algo, opts[0].workspace_bytes, [], opts)
    return out


def frugal_workspace(route: Route, costs: CostTable | None = None) -> dict[int, "WorkspaceChoice"]:
    """Every step on its smallest-workspace algorithm (ties: the faster), fixed: the most memory-frugal choice."""
    return smallest_workspaces(workspace_choices(route, costs), "not tried (most frugal plan)")


def smallest_workspaces(ws: dict[int, "WorkspaceChoice"], why: str) -> dict[int, "WorkspaceChoice"]:
    """`ws` with every open choice fixed on its smallest workspace, faster ones refused `why`."""
    out = {}
    for k, c in ws.items():
        if not c.options:
            out[k] = c
            continue
        o = min(c.options, key=lambda o: (align_up(o.workspace_bytes), o.est_cost))
        out[k] = WorkspaceChoice(o.algo, o.workspace_bytes,
                                 [f"{f.algo}: {why}" for f in c.options if f.est_cost < o.est_cost])
    return out


# -- fitting
def fit_workspace(options: Sequence[WorkspaceOption], free_bytes: int) -> tuple[WorkspaceOption, list[str]]:
    """The fastest option whose rounded workspace fits `free_bytes`, with a note per faster option
    refused; if none fits, the smallest."""
    refused: list[str] = []
    for o in options:
        if align_up(o.workspace_bytes) <= free_bytes:
            return o, refused
        refused.append(f"{o.algo}: needs {format_bytes(align_up(o.workspace_bytes))}, "
                       f"{format_bytes(max(free_bytes, 0))} free")
    smallest = min(options, key=lambda o: (o.workspace_bytes, o.est_cost))
    return smallest, [r for o, r in zip(options, refused) if o is not smallest]


def largest_free_below(pool: "TensorPool", limit: int) -> int:
    """Bytes of the largest free hole of `pool` below `limit` (one crossing it counts up to it)."""
    if hasattr(pool, "free_below"):   # a paged pool: free chunks are usable wherever they are
        return pool.free_below(limit)
    limit = limit // ALIGNMENT * ALIGNMENT
    best = 0
    for b in pool._free.values():
        avail = min(b.offset + b.size, limit) - b.offset
        if avail > best:
            best = avail
    return best


class WorkspaceFitter:
    """The planner's hook: decides each open workspace when it is placed."""

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
