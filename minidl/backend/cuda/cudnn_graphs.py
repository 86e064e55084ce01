"""The cuDNN frontend adapter, the only code that calls `cudnn.*`: graphs built (or loaded from the plan cache),
kept per `GraphKey`, executed.

A convolution graph keeps up to `max_plans` plans (the planner's workspace options), a batch-norm, ReLU or attention
(SDPA) graph the first that builds. Every graph computes in float32 (compute and intermediate FLOAT); its I/O is the
spec's dtype (half graphs store their outputs rounded once, from float32). Rules: a graph loaded from a
`plan_cache.PlanStore` has the recorded plans, indices, names and workspaces, so a warm process plans as a cold one;
engine filters that leave nothing are dropped (`relaxed`), but for attention, which falls back to kernels instead.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from ...core import startup
from . import cudnn_specs
from .plan_cache import GraphEntry, PlanRecord, PlanStore


class GraphUnsupported(RuntimeError):
    """cuDNN has no engine (or no buildable plan) for a graph."""


#: Characters of a fallback reason kept in the report: cuDNN's own errors run to several KB of log lines.
REASON_CHARS = 200
#: Reasons kept in `CudnnGraphs.cache_notes` (the first ones: later ones usually repeat them).
CACHE_NOTES = 8


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """`text`'s first non-empty line, collapsed, at most `limit` characters (cuDNN's errors carry KB of log)."""
    first = next((ln for ln in str(text).splitlines() if ln.strip()), "")
    first = " ".join(first.split())
    return first if len(first) <= limit else first[:limit - 3] + "..."


#: Every CudnnGraphs alive: released before the interpreter shuts down (backend.py's `_release_all`).
LIVE_GRAPHS: "weakref.WeakSet[CudnnGraphs]" = weakref.WeakSet()


@dataclass(slots=True)
class PlanRunner:
    """Where one plan runs: `graph` at plan index `local` (None: its one plan, `graph.execute`) with the
    variant pack keyed by `tensors` (name -> handle, or uid for a deserialized graph)."""

    graph: Any
    local: int | None
    tensors: dict[str, Any]


@dataclass(slots=True)
class BuiltGraph:
    """A validated cuDNN graph with its built execution plans, cached per `GraphKey`."""

    key: cudnn_specs.GraphKey
    graph: Any                          # the graph the plans were built on (None: every plan deserialized)
    tensors: dict[str, Any] | None      # tensor name (cudnn_specs descs) -> cudnn tensor handle of `graph`
    plans: list[cudnn_specs.PlanInfo]   # in cuDNN's heuristic order
    relaxed: tuple[str, ...] = ()       # numerical-note filters dropped because nothing else was supported
    runners: dict[int, PlanRunner] = field(default_factory=dict)   # plan index -> where it runs

    def __post_init__(self) -> None:
        for p in self.plans:
            if p.index not in self.runners:
                self.runners[p.index] = PlanRunner(self.graph, p.index, self.tensors)

    def find(self, index: int) -> cudnn_specs.PlanInfo | None:
        """The built plan numbered `index`, or None."""
        return next((p for p in self.plans if p.index == index), None)

    def plan(self, index: int) -> cudnn_specs.PlanInfo:
        found = self.find(index)
        if found is not None:
            return found
        raise ValueError(f"{self.key.op}: no built execution plan {index}; have "
                         f"{[p.index for p in self.plans]}")


class _Stale(Exception):
    """A cached entry that cannot be used as it is (the reason is the message)."""


class CudnnGraphs:
    """Builds, caches and executes cuDNN frontend graphs (`cudnn.pygraph`) by the documented workflow
    (`create_execution_plans([A, FALLBACK])`, `build_plan_at_index`, `execute_plan_at_index`). `cudnn` is injected
    (host tests pass a fake); `store` the plan cache or None."""

    def __init__(self, cudnn, handle, max_plans: int = 8, store: PlanStore | None = None):
        self.cudnn = cudnn
        self.handle = handle
        self.max_plans = int(max_plans)
        self.store = store
        self._cache: dict[cudnn_specs.GraphKey, BuiltGraph] = {}
        # graphs: built here, loaded whole, loaded with plans rebuilt from (engine, knobs), cached but unusable
        self.stats = {"built": 0, "loaded": 0, "replayed": 0, "stale": 0}
        self.cache_notes: list[str] = []
        LIVE_GRAPHS.add(self)

    def __len__(self) -> int:
        return len(self._cache)

    def ops(self) -> set[str]:
        """The ops of the graphs built or loaded (`GraphKey.op`): which cuDNN graphs a run used."""
        return {key.op for key in self._cache}

    def release(self) -> None:
        """Drop every built graph; later `get`s build them again."""
        self._cache.clear()

    def plan_limit(self, key: cudnn_specs.GraphKey) -> int:
        """Plans kept for `key`: up to `max_plans` for a convolution, else the first."""
        return self.max_plans if key.op.startswith("conv_") else 1

    def _note(self, text: str) -> None:
        if len(self.cache_notes) < CACHE_NOTES:
            self.cache_notes.append(one_line(text))

    def _enum(self, enum: str, member: str):
        return getattr(getattr(self.cudnn, enum), member)

    def _new_graph(self, key: cudnn_specs.GraphKey):
        f = self._enum("data_type", "FLOAT")
        io = self._enum("data_type", cudnn_specs.cudnn_dtype_name(key.spec.dtype))
        return self.cudnn.pygraph(io_data_type=io, intermediate_data_type=f, compute_data_type=f,
                                  handle=self.handle)

    def _float(self):
        return self._enum("data_type", "FLOAT")

    def _tensor(self, g, d: cudnn_specs.TensorDesc):
        return g.tensor(data_type=self._enum("data_type", d.dtype), **d.kwargs())

    def _output(self, t, d: cudnn_specs.TensorDesc, output: bool = True):
        """Shape an op's result as `d`; `output` False: virtual (kept inside the graph)."""
        if output:
            t.set_output(True)
        t.set_dim(list(d.dim))
        t.set_stride(list(d.stride))
        t.set_data_type(self._enum("data_type", d.dtype))
        return t

    # -- graph bodies: each returns {tensor name: handle}
    def _conv_body(self, g, spec: cudnn_specs.ConvSpec, op: str) -> dict[str, Any]:
        d = spec.descs()
        (a, b), out = spec.io(op)
        ta, tb = self._tensor(g, d[a]), self._tensor(g, d[b])
        kw = {**spec.conv_kwargs(), "compute_data_type": self._float()}
        if op in ("fprop", "fprop_bias"):
            t = g.conv_fprop(image=ta, weight=tb, name="fprop", **kw)
        elif op == "wgrad":   # half x and dy in, float32 dw out: weight gradients accumulate in float32
            return {a: ta, b: tb, out: self._output(g.conv_wgrad(image=ta, loss=tb, name="wgrad", **kw), d["dw"])}
        else:
            t = g.conv_dgrad(loss=ta, filter=tb, name="dgrad", **kw)
        if op in ("fprop", "dgrad"):
            return {a: ta, b: tb, out: self._output(t, d[out])}
        # conv + b, or dx + x_acc (x_acc is another tensor of the graph: cuDNN refuses a multi-node graph whose
        # output is one of its inputs; the backend binds both to the delta's memory), in the convolution's
        # epilogue on its float32 result, rounded once when stored
        other = "b" if op == "fprop_bias" else "x_acc"
        extra = self._tensor(g, d[other])
        total = g.add(a=self._output(t, d[out].inner(), output=False), b=extra, compute_data_type=self._float(),
                      name="add_into")
        return {a: ta, b: tb, other: extra, out: self._output(total, d[out])}

    def _bn_body(self, g, spec: cudnn_specs.BNSpec, op: str) -> dict[str, Any]:
        d = spec.descs(op)
        if op == "bn_train":
            ins = {k: self._tensor(g, d[k]) for k in ("x", "scale", "bias", "running_mean", "running_var",
                                                       "epsilon", "momentum")}
            y, mean, invstd, nrm, nrv = g.batchnorm(
                name="bn", input=ins["x"], scale=ins["scale"], bias=ins["bias"],
                in_running_mean=ins["running_mean"], in_running_var=ins["running_var"],
                epsilon=ins["epsilon"], momentum=ins["momentum"], compute_data_type=self._float())
            outs = {"y": y, "mean": mean, "invstd": invstd, "next_running_mean": nrm, "next_running_var": nrv}
        elif op == "bn_infer":
            ins = {k: self._tensor(g, d[k]) for k in ("x", "mean", "invstd", "scale", "bias")}
            y = g.batchnorm_inference(name="bn_infer", input=ins["x"], mean=ins["mean"],
                                      inv_variance=ins["invstd"], scale=ins["scale"], bias=ins["bias"],
                                      compute_data_type=self._float())
            outs = {"y": y}
        else:
            ins = {k: self._tensor(g, d[k]) for k in ("dy", "x", "scale", "mean", "invstd")}
            dx, dscale, dbias = g.batchnorm_backward(name="bn_bwd", grad=ins["dy"], input=ins["x"],
                                                     scale=ins["scale"], mean=ins["mean"],
                                                     inv_variance=ins["invstd"], compute_data_type=self._float())
            outs = {"dx": dx, "dscale": dscale, "dbias": dbias}
        return {**ins, **{k: self._output(t, d[k]) for k, t in outs.items()}}

    def _pointwise_body(self, g, spec: cudnn_specs.PointwiseSpec, op: str) -> dict[str, Any]:
        d = spec.descs(op)
        if op == "relu_fwd":
            x = self._tensor(g, d["x"])
            return {"x": x, "y": self._output(g.relu(name="relu", input=x, compute_data_type=self._float()), d["y"])}
        y, dy = self._tensor(g, d["y"]), self._tensor(g, d["dy"])
        # RELU_BWD: dx = dy where input > 0. Fed the forward OUTPUT y, which is > 0 exactly where x is.
        dx = g.relu_backward(name="relu_bwd", loss=dy, input=y, compute_data_type=self._float())
        return {"y": y, "dy": dy, "dx": self._output(dx, d["dx"])}

    def _sdpa_body(self, g, spec: cudnn_specs.SDPASpec, op: str) -> dict[str, Any]:
        d = spec.descs(op)
        names = ("q", "k", "v") if op == "sdpa_fwd" else ("q", "k", "v", "o", "do", "stats")
        ins = {k: self._tensor(g, d[k]) for k in names}
        kw: dict[str, Any] = {"attn_scale": spec.scale, "compute_data_type": self._float(), "name": op}
        if spec.causal:   # the preferred masking (the bindings list use_causal_mask among the deprecated)
            kw.update(diagonal_alignment=self._enum("diagonal_alignment", "TOP_LEFT"), diagonal_band_right_bound=0)
        if op == "sdpa_fwd":   # statistics in inference too: one graph, the same o whether recomputed or not
            o, stats = g.sdpa(q=ins["q"], k=ins["k"], v=ins["v"], generate_stats=True, **kw)
            outs = {"o": o, "stats": stats}
        else:                  # no atomic sums in minidl
            dq, dk, dv = g.sdpa_backward(q=ins["q"], k=ins["k"], v=ins["v"], o=ins["o"], dO=ins["do"],
                                         stats=ins["stats"], use_deterministic_algorithm=True, **kw)
            outs = {"dq": dq, "dk": dk, "dv": dv}
        return {**ins, **{k: self._output(t, d[k]) for k, t in outs.items()}}

    def _body(self, key: cudnn_specs.GraphKey) -> Callable[[Any], dict[str, Any]]:
        op, spec = key.op, key.spec
        if op.startswith("conv_"):
            return lambda g: self._conv_body(g, spec, op[len("conv_"):])
        if op in cudnn_specs.BN_OPS:
            return lambda g: self._bn_body(g, spec, op)
        if op in cudnn_specs.POINTWISE_OPS:
            return lambda g: self._pointwise_body(g, spec, op)
        if op in cudnn_specs.SDPA_OPS:
            return lambda g: self._sdpa_body(g, spec, op)
        raise ValueError(f"unknown graph op {op!r}")

    # -- build
    def get(self, key: cudnn_specs.GraphKey) -> BuiltGraph:
        """The built graph for `key`, built or loaded on first use. Raises GraphUnsupported."""
        built = self._cache.get(key)
        if built is None:
            with startup.phase("cudnn_graphs"):
                built = self._load(key)
                if built is None:
                    built = self._build_and_record(key)
            self._cache[key] = built
        return built

    def _build_and_record(self, key: cudnn_specs.GraphKey) -> BuiltGraph:
        limit = self.plan_limit(key)
        records: list[PlanRecord] | None = [] if self.store is not None else None
        built = self._build(key, limit, records)
        self.stats["built"] += 1
        if records is not None:
            self.store.save(key, limit, GraphEntry(records, built.relaxed))
        return built

    def _build(self, key: cudnn_specs.GraphKey, limit: int, records: list[PlanRecord] | None = None) -> BuiltGraph:
        body = self._body(key)
        notes = key.filters.numeric_notes()
        # First with the engine filters; if they leave nothing, without them (recorded in `relaxed`), but for
        # attention, whose refused graph has the kernels to fall back to.
        attempts = [notes, ()] if notes and key.op not in cudnn_specs.SDPA_OPS else [notes]
        errors = []
        for deselect in attempts:
            g = self._new_graph(key)
            tensors = body(g)
            kept: list[PlanRecord] | None = [] if records is not None else None
            try:
                plans = self._finalize(g, deselect, limit, tensors, kept)
            except GraphUnsupported as e:
                errors.append(f"{e}" + (f" (with {', '.join(deselect)} deselected)" if deselect else ""))
                continue
            if records is not None:
                records.extend(kept)
            return BuiltGraph(key, g, tensors, plans, tuple(n for n in notes if n not in deselect))
        # The reason first (the report keeps one line of it), the graph last.
        raise GraphUnsupported(f"cuDNN cannot run {key.op}: " + "; ".join(reversed(errors)) + f"; for {key.spec}")

    def _finalize(self, g, deselect: tuple[str, ...], limit: int, tensors: dict[str, Any],
                  records: list[PlanRecord] | None = None) -> list[cudnn_specs.PlanInfo]:
        try:
            g.validate()  # any other error here is a malformed graph (our bug): let it propagate
        except self.cudnn.cudnnGraphNotSupportedError as e:   # e.g. SDPA's head dimension or alignment
            raise GraphUnsupported(f"{type(e).__name__}: {one_line(str(e))}") from e
        try:
            g.build_operation_graph()
            g.create_execution_plans([self._enum("heur_mode", "A"), self._enum("heur_mode", "FALLBACK")])
            if deselect:
                g.deselect_numeric_notes([self._enum("numerical_note", n) for n in deselect])
            g.check_support()
        except Exception as e:  # cudnnGraphNotSupportedError or a cuDNN status error
            raise GraphUnsupported(f"{type(e).__name__}: {one_line(str(e))}") from e
        plans: list[cudnn_specs.PlanInfo] = []
        seen: set[str] = set()
        for i in range(int(g.get_execution_plan_count())):
            if len(plans) >= limit:
                break
            try:
                g.build_plan_at_index(index=i)
            except Exception:  # deselected, or this engine config fails to build: not an option
                continue
            # Only a built plan reports its true workspace (an unbuilt one reads as 0).
            ws = int(g.get_workspace_size_plan_at_index(index=i))
            name = self._plan_name(g, i)
            if name in seen:  # heuristics A and FALLBACK may both list the same engine config
                continue
            seen.add(name)
            plans.append(cudnn_specs.PlanInfo(i, name, ws))
            if records is not None:  # now, while plan i is the graph's selected (last built) plan
                records.append(self._record(g, plans[-1], tensors))
        if not plans:
            raise GraphUnsupported("no execution plan could be built")
        return plans

    @staticmethod
    def _plan_name(g, i: int) -> str:
        try:
            return str(g.get_plan_name_at_index(index=i))
        except Exception:
            return f"plan{i}"

    def _record(self, g, plan: cudnn_specs.PlanInfo, tensors: dict[str, Any]) -> PlanRecord:
        """What the plan cache keeps of plan `plan`: its `(engine_id, knobs)` and serialized form,
        either may be missing."""
        rec = PlanRecord(plan.index, plan.name, plan.workspace_bytes)
        try:
            engine_id, knobs = g.get_engine_and_knobs_at_index(index=plan.index)
            rec.engine_id = int(engine_id)
            rec.knobs = sorted((str(getattr(k, "name", k)), int(v)) for k, v in dict(knobs or {}).items())
        except Exception as e:  # noqa: BLE001 - an engine the frontend cannot name: not replayable
            self._note(f"{plan.name}: no (engine, knobs): {e}")
        try:
            rec.blob = bytes(g.serialize(as_bytes=True))
            rec.uids = {name: int(t.get_uid()) for name, t in tensors.items()}
        except Exception as e:  # noqa: BLE001 - an engine whose plans do not serialize: rebuilt when loaded
            self._note(f"{plan.name}: not serialized: {e}")
            rec.blob, rec.uids = None, {}
        return rec

    # -- load
    def _load(self, key: cudnn_specs.GraphKey) -> BuiltGraph | None:
        """`key`'s graph from the plan cache, or None (an unusable entry counted `stale`, noted)."""
        if self.store is None:
            return None
        entry = self.store.load(key, self.plan_limit(key))
        if entry is None:
            return None
        try:
            built, replayed = self._restore(key, entry)
        except Exception as e:  # noqa: BLE001 - _Stale, or the frontend refusing what it once built
            self.stats["stale"] += 1
            self._note(f"{key.op}: cached plans not usable: {type(e).__name__}: {e}")
            return None
        self.stats["replayed" if replayed else "loaded"] += 1
        return built

    def _restore(self, key: cudnn_specs.GraphKey, entry: GraphEntry) -> tuple[BuiltGraph, bool]:
        """The recorded plans, deserialized where possible, else rebuilt on one fresh graph (raises
        _Stale where a plan cannot be, or reports another workspace)."""
        runners: dict[int, PlanRunner] = {}
        rest = []
        for rec in entry.plans:
            runner = self._deserialize(rec) if rec.blob is not None else None
            if runner is None:
                rest.append(rec)
            else:
                runners[rec.index] = runner
        graph = tensors = None
        if rest:
            graph, tensors = self._replay(key, rest, runners)
        plans = [cudnn_specs.PlanInfo(r.index, r.name, r.workspace_bytes) for r in entry.plans]
        return BuiltGraph(key, graph, tensors, plans, entry.relaxed, runners), bool(rest)

    def _deserialize(self, rec: PlanRecord) -> PlanRunner | None:
        """The serialized plan `rec` in a graph of its own, or None with a note."""
        try:
            g = self.cudnn.pygraph(handle=self.handle)
            g.deserialize(self.handle, rec.blob)
            ws = int(g.get_workspace_size())
        except Exception as e:  # noqa: BLE001 - another cuDNN build, a plan that cannot be loaded here
            self._note(f"{rec.name}: not deserialized: {type(e).__name__}: {e}")
            return None
        if ws != rec.workspace_bytes:
            self._note(f"{rec.name}: deserialized with a workspace of {ws} bytes, recorded {rec.workspace_bytes}")
            return None
        return PlanRunner(g, None, dict(rec.uids))

    def _replay(self, key: cudnn_specs.GraphKey, recs: list[PlanRecord],
                runners: dict[int, PlanRunner]) -> tuple[Any, dict[str, Any]]:
        """Build `recs` on a fresh graph from their `(engine_id, knobs)`, skipping the heuristics."""
        g = self._new_graph(key)
        tensors = self._body(key)(g)
        g.validate()
        g.build_operation_graph()
        for rec in recs:
            if rec.engine_id is None:
                raise _Stale(f"plan {rec.index} ({rec.name}) has no recorded engine to rebuild")
            knobs = {getattr(self.cudnn.knob_type, name): value for name, value in rec.knobs}
            g.create_execution_plan(rec.engine_id, knobs)
            local = int(g.get_execution_plan_count()) - 1
            g.build_plan_at_index(index=local)
            ws = int(g.get_workspace_size_plan_at_index(index=local))
            if ws != rec.workspace_bytes:
                raise _Stale(f"plan {rec.index} ({rec.name}) rebuilt with a workspace of {ws} bytes, recorded "
                             f"{rec.workspace_bytes}")
            runners[rec.index] = PlanRunner(g, local, tensors)
        return g, tensors

    # -- execute
    def execute(self, built: BuiltGraph, pointers: dict[str, int], workspace_ptr: int, plan_index: int) -> None:
        """Run plan `plan_index` of `built`; `pointers`: tensor name -> device (or host scalar) address."""
        runner = built.runners.get(int(plan_index))
        if runner is None:
            built.plan(plan_index)  # raises, naming the plans there are
        missing = sorted(set(runner.tensors) - set(pointers))
        extra = sorted(set(pointers) - set(runner.tensors))
        if missing or extra:
            raise ValueError(f"{built.key.op}: variant pack is missing {missing}, has unknown {extra}")
        pack = {runner.tensors[name]: int(ptr) for name, ptr in pointers.items()}
        if runner.local is None:
            runner.graph.execute(pack, int(workspace_ptr), handle=self.handle)
        else:
            runner.graph.execute_plan_at_index(pack, int(workspace_ptr), index=runner.local, handle=self.handle)
