"""The staging a layer's step takes in a half precision (the CPU's float32 copies of half operands), measured by
a dry run of the step's own calls (`staging_trace`): the figure is the run's, with no formula kept beside it.
"""
from __future__ import annotations

import numpy as np

from ..backend.base import menu_of
from ..backend.precision import WEIGHT_COPY, Precision
from ..core.tensors import Role
from .base import Layer, LayerContext


def step_staging(layer: Layer, backend, prec: Precision, phase: str, in_shapes, in_dtypes, out_shape, *,
                 training: bool = True, kept_aux=None) -> int:
    """Staging bytes of `layer`'s `phase` ('fwd', 'bwd') on `backend` in `prec`; `kept_aux` None: all kept.
    0 in float32 modes and on backends that stage nothing."""
    if prec.half is None or not backend.capabilities.half_staging:
        return 0
    in_shapes = [tuple(s) for s in in_shapes]
    inputs = [np.empty(s, d) for s, d in zip(in_shapes, in_dtypes)]
    params = {p: np.empty(spec.shape, prec.dtype(WEIGHT_COPY) if p in layer.half_params else np.float32)
              for p, spec in layer.param_specs(in_shapes).items()}
    aux = {k: np.empty(s, prec.dtype(Role.AUX, layer=layer, aux=k))
           for k, s in layer.aux_specs(in_shapes, training=training).items() if kept_aux is None or k in kept_aux}
    out = np.empty(out_shape, prec.dtype(Role.ACTIVATION, layer=layer))
    opts = layer.workspace_options(phase, in_shapes, tuple(out_shape), 4, menu_of(backend))
    ctx = LayerContext(training=training, aux=aux, algo=opts[0].algo if opts else None)
    trace = backend.staging_trace()
    if phase == "fwd":
        layer.forward(trace, inputs, out, params, ctx)
        return trace.high_water
    floating = lambda x: x.dtype.kind == "f" or prec.half == x.dtype
    dinputs = [np.empty_like(x) if k not in layer.nondiff_inputs and floating(x) else None
               for k, x in enumerate(inputs)]
    grads = {p: np.empty(spec.shape, np.float32) for p, spec in layer.param_specs(in_shapes).items()
             if spec.trainable}
    saved = [x if k in layer.needs_inputs else None for k, x in enumerate(inputs)]
    dout = np.empty(out_shape, prec.dtype(Role.DELTA, layer=layer))
    layer.backward(trace, saved, out if layer.needs_output else None, dout, dinputs, grads, params, ctx)
    return trace.high_water
