"""The staging a layer's step takes in a half precision: scratch its backend's half kernels need beyond the plan's
tensors (the CPU's float32 copies of half operands, `backend.cpu.half`), found by running the step's own calls
as a dry run (`staging_trace`) on empty arrays stored as `backend.precision` says: the figure is the one the run
takes, for any layer, with no formula kept beside the kernels. Where the backend folds a following ReLU into the
layer's call (`FUSES_RELU`, the compiled step's fusions), a plan counts the larger of the two calls.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..backend.base import FUSES_RELU, FUSES_RELU_BACKWARD, menu_of
from ..backend.precision import Precision
from ..core.tensors import Role
from .base import Layer, LayerContext


def step_staging(layer: Layer, backend, prec: Precision, phase: str, in_shapes, in_dtypes, out_shape, *,
                 training: bool = True, kept_aux=None, wants_dinputs: Sequence[bool] | None = None,
                 accumulate: Sequence[int] = (), fold_relu: bool = False) -> int:
    """The bytes of staging `layer`'s forward (`phase` 'fwd', a recomputation alike) or backward ('bwd') takes on
    `backend` in `prec`, its inputs of `in_shapes` stored in `in_dtypes`; `kept_aux` the aux tensors the plan
    keeps (None: all of them); `wants_dinputs` which inputs' deltas the step writes (None: every differentiable
    one); `accumulate` the inputs whose delta the layer adds into (`ctx.accumulate`);
    `fold_relu`: the larger of the plain call and the one with a following ReLU folded in, where the backend
    folds it. 0 in float32 modes, and on backends that stage nothing."""
    if prec.half is None or not backend.capabilities.half_staging:
        return 0
    in_shapes = [tuple(s) for s in in_shapes]
    inputs = [np.empty(s, d) for s, d in zip(in_shapes, in_dtypes)]
    params = {p: np.empty(spec.shape, prec.dtype(Role.WEIGHT_COPY) if p in layer.half_params else np.float32)
              for p, spec in layer.param_specs(in_shapes).items()}
    aux = {k: np.empty(s, prec.dtype(Role.AUX, layer=layer, aux=k))
           for k, s in layer.aux_specs(in_shapes, training=training).items() if kept_aux is None or k in kept_aux}
    out = np.empty(out_shape, prec.dtype(Role.ACTIVATION, layer=layer))
    opts = layer.workspace_options(phase, in_shapes, tuple(out_shape), 4, menu_of(backend),
                                   accumulate=frozenset(accumulate))
    ctx = LayerContext(training=training, aux=aux, algo=opts[0].algo if opts else None,
                       accumulate=frozenset(accumulate))
    fuses = backend.capabilities.fuses if fold_relu else frozenset()
    trace = backend.staging_trace()
    if phase == "fwd":
        layer.forward(trace, inputs, out, params, ctx)
        if training and FUSES_RELU.get(layer.type_name) in fuses:
            layer.forward_relu(trace, inputs, out, np.empty_like(out), params, ctx)
        return trace.high_water
    floating = lambda x: x.dtype.kind == "f" or prec.half == x.dtype
    wants = wants_dinputs if wants_dinputs is not None else [True] * len(inputs)
    dinputs = [np.empty_like(x) if k not in layer.nondiff_inputs and floating(x) and wants[k] else None
               for k, x in enumerate(inputs)]
    grads = {p: np.empty(spec.shape, np.float32) for p, spec in layer.param_specs(in_shapes).items()
             if spec.trainable}
    saved = [x if k in layer.needs_inputs else None for k, x in enumerate(inputs)]
    dout = np.empty(out_shape, prec.dtype(Role.DELTA, layer=layer))
    layer.backward(trace, saved, out if layer.needs_output else None, dout, dinputs, grads, params, ctx)
    if training and FUSES_RELU_BACKWARD.get(layer.type_name) in fuses and not accumulate:
        layer.backward_relu(trace, saved, dout, dinputs, grads, params, ctx, np.empty_like(out), np.empty_like(dout))
    return trace.high_water
