"""One layer on plain arrays, outside any plan (in a throw-away network, so shape inference runs as in a real
graph), for layer tests and gradient checks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..backend import menu_of
from ..backend.precision import is_half, precision
from ..core.errors import DataError, OptionError
from ..core.tensors import Role
from ..graph.network import Network
from ..layers.base import Layer, LayerContext


def _floating(dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or is_half(dtype)


def _stored(be, a: np.ndarray, dtype) -> np.ndarray:
    """`a` as the backend stores it in `dtype` (a half dtype: rounded to nearest even)."""
    out = np.empty(a.shape, dtype)
    be.copy(out, a)
    return out


@dataclass(slots=True)
class LayerRun:
    out: np.ndarray
    dinputs: list[np.ndarray | None] = field(default_factory=list)
    grads: dict[str, np.ndarray] = field(default_factory=dict)
    aux: dict[str, np.ndarray] = field(default_factory=dict)


def _workspace(layer, phase, in_shapes, out_shape, itemsize, algo, backend, accumulate=frozenset()):
    opts = layer.workspace_options(phase, in_shapes, out_shape, itemsize, menu_of(backend), accumulate)
    if not opts:
        return None, None
    chosen = opts[0] if algo is None else next((o for o in opts if o.algo == algo), None)
    if chosen is None:
        raise OptionError(f"{layer.describe()}: no {phase} algorithm {algo!r}; have {[o.algo for o in opts]}")
    return np.zeros(chosen.workspace_bytes, np.uint8), chosen.algo


def run_layer(layer: Layer, inputs: list[np.ndarray], params: dict[str, np.ndarray] | None = None,
              dout: np.ndarray | None = None, *, training: bool = True, backend=None, algo_fwd: str | None = None,
              algo_bwd: str | None = None, rng_key: int = 0, dtype=None, math: str | None = None,
              accumulate: dict[int, np.ndarray] | None = None) -> LayerRun:
    """Forward (and backward given `dout`) of `layer`, with a network's checks. `math` a half mode: arrays stored
    as a plan in that mode stores them. `accumulate` {input slot: a delta}: backward adds that input's delta into
    it, as a fork's later consumer does."""
    from ..backend.cpu.backend import CPUBackend

    be = backend or CPUBackend()
    prec = precision(math or "fp32")
    floats = [x for x in inputs if _floating(x.dtype)]
    net = Network("layer_test", dtype=dtype or (np.float32 if prec.half or not floats else floats[0].dtype))
    if prec.half is not None:
        inputs = [_stored(be, x, prec.dtype(Role.DATA)) if _floating(x.dtype) else x for x in inputs]
    syms = [net.input(x.shape, dtype=net.dtype if is_half(x.dtype) else x.dtype, name=f"in{i}")
            for i, x in enumerate(inputs)]
    node = layer(*syms).node
    in_shapes = [x.shape for x in inputs]
    params = dict(params or {})
    for pname, spec in node.params.items():
        if pname not in params:
            raise DataError(f"{layer.describe()}: parameter {pname!r} {spec.shape} not given")
        if tuple(params[pname].shape) != tuple(spec.shape):
            raise DataError(f"{layer.describe()}: parameter {pname!r} must be {spec.shape}, "
                            f"got {params[pname].shape}")
    if training:
        layer.check_training(in_shapes)
    layer.check_values(inputs)
    if prec.half is not None:
        params = {p: _stored(be, a, prec.dtype(Role.WEIGHT_COPY)) if p in layer.half_params else a
                  for p, a in params.items()}
    out = np.empty(node.shape, prec.dtype(Role.ACTIVATION, layer=layer) if prec.half else node.dtype)
    aux = {k: np.empty(s, prec.dtype(Role.AUX, layer=layer, aux=k) if prec.half else net.dtype)
           for k, s in layer.aux_specs(in_shapes, training=training).items()}
    ws, algo = _workspace(layer, "fwd", in_shapes, node.shape, net.dtype.itemsize, algo_fwd, be)
    ctx = LayerContext(training=training, aux=aux, workspace=ws, algo=algo, rng_key=rng_key)
    layer.forward(be, list(inputs), out, params, ctx)
    run = LayerRun(out=out, aux=aux)
    if dout is None:
        return run
    into = dict(accumulate or {})
    if into and not layer.accumulates_in_place:
        raise OptionError(f"{layer.describe()}: its backward does not add into a delta it is given "
                          f"(accumulate={sorted(into)})")
    ws, algo = _workspace(layer, "bwd", in_shapes, node.shape, net.dtype.itemsize, algo_bwd, be, frozenset(into))
    bctx = LayerContext(training=training, aux=aux, workspace=ws, algo=algo, rng_key=rng_key,
                        accumulate=frozenset(into))
    dinputs = [None if (k in layer.nondiff_inputs or not _floating(x.dtype))
               else np.full(x.shape, np.nan, x.dtype) for k, x in enumerate(inputs)]
    for k, d in into.items():
        dinputs[k] = _stored(be, np.asarray(d), dinputs[k].dtype)
    grads = {p: np.full(s.shape, np.nan, net.dtype) for p, s in node.params.items() if s.trainable}
    saved_in = [x if k in layer.needs_inputs else None for k, x in enumerate(inputs)]
    dout = _stored(be, np.asarray(dout, np.float32), prec.dtype(Role.DELTA, layer=layer)) if prec.half \
        else np.asarray(dout, node.dtype)
    layer.backward(be, saved_in, out if layer.needs_output else None, dout, dinputs, grads, params, bctx)
    run.dinputs, run.grads = dinputs, grads
    return run


def directional_gradcheck(make_layer, inputs: list[np.ndarray], params: dict[str, np.ndarray], *,
                          directions: int = 3, eps: float = 1e-6, seed: int = 0, training: bool = True,
                          rtol: float = 1e-5, atol: float = 1e-8, **kw) -> None:
    """Every gradient against central differences in float64 along random directions v:
    (L(x + eps v) - L(x - eps v)) / 2 eps == <dL/dx, v> with L = sum(out * w)."""
    rng = np.random.default_rng(seed)
    base = run_layer(make_layer(), inputs, params, training=training, **kw)
    w = rng.standard_normal(base.out.shape)
    full = run_layer(make_layer(), inputs, params, dout=w, training=training, **kw)

    def loss(ins, ps):
        return float(np.sum(run_layer(make_layer(), ins, ps, training=training, **kw).out * w))

    targets = [("input", k, x) for k, x in enumerate(inputs) if full.dinputs[k] is not None]
    targets += [("param", name, p) for name, p in params.items() if name in full.grads]
    for kind, key, value in targets:
        analytic = full.dinputs[key] if kind == "input" else full.grads[key]
        for _ in range(directions):
            v = rng.standard_normal(value.shape)

            def shifted(sign, kind=kind, key=key, value=value, v=v):
                ins, ps = list(inputs), dict(params)
                if kind == "input":
                    ins[key] = value + sign * eps * v
                else:
                    ps[key] = value + sign * eps * v
                return loss(ins, ps)

            numeric = (shifted(+1) - shifted(-1)) / (2 * eps)
            exact = float(np.sum(analytic * v))
            if not np.isclose(numeric, exact, rtol=rtol, atol=atol):
                raise AssertionError(f"gradcheck failed for {kind} {key!r}: finite difference {numeric!r} vs "
                                     f"analytic {exact!r}")
