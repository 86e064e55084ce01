"""The layer contract: shape inference, parameters, FLOPs, backward needs, forward and backward.

A layer is a description plus two kernels-calling methods. Everything the memory planner needs is *declared*
here as class attributes or pure functions of the input shapes, never discovered by running code:

- `needs_inputs` / `needs_output`: which of its inputs and its output the backward reads (Chainer's
  `retain_inputs` / `retain_outputs`). Liveness, offload and recomputation all read this declaration, so a
  layer must never keep an array in `self` between forward and backward: it would be invisible to the planner.
- `param_specs`: parameters and persistent buffers, with their shapes.
- `aux_specs`: small tensors forward saves for backward (BN's batch mean and inverse std), also planned;
  `rebuildable_aux` names those a plan may choose not to keep (attention's scores, rebuilt in backward).
- `checkpoint`: whether recomputation keeps this layer's output (conv, linear, joins) or may drop it
  (cheap layers: ReLU, BN, pooling, LRN, dropout).

Forward and backward write into arrays they are given (outputs, deltas, gradients, workspace), all of which
the executor has carved out of its tensor pool; they return nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import numpy as np

from ..core.errors import GraphError
from ..core.symbol import Symbol
from ..core.vocab import WorkspaceOption  # noqa: F401  (re-exported: layers declare their algorithms with it)

Shape = tuple[int, ...]


def last_axis_rows(shape: Shape) -> tuple[int, int]:
    """(rows, C) of a tensor worked on along its last axis (layer norm, softmax, a per-token linear): every other
    axis is a row, so a (B, T, C) tensor is the (B*T, C) matrix its kernels take."""
    return math.prod(shape[:-1]), shape[-1]


@dataclass(slots=True)
class ParamSpec:
    """A parameter or buffer of a layer. `init` names an initializer in `minidl.layers.init`."""

    shape: Shape
    init: str
    trainable: bool = True
    fan_in: int = 1
    fan_out: int = 1
    std: float = 1.0  # the "normal" initializer's standard deviation (GPT-2 and BERT draw their tables at 0.02)


@dataclass(slots=True)
class LayerContext:
    """Per-call state handed to forward/backward by the executor (never stored in the layer).

    `recompute` is True when forward runs again in backward to rebuild a dropped output: layers must then
    produce exactly the same result without side effects (BN reuses its saved batch statistics and does
    not touch its running statistics again; dropout replays the same mask from `rng_key`).
    """

    training: bool = True
    aux: dict[str, np.ndarray] = field(default_factory=dict)
    workspace: np.ndarray | None = None
    algo: str | None = None
    rng_key: int = 0
    recompute: bool = False
    accumulate: dict[int, np.ndarray] = field(default_factory=dict)
    """backward: input slot -> a one-sample scratch, for the inputs whose delta (`dinputs[slot]`) already holds
    other consumers' contributions: the layer adds its own into it (layers with `accumulates_in_place`)."""


class Layer:
    """Base class of every layer. Subclasses set the class attributes and override the hooks."""

    type_name: ClassVar[str] = "layer"
    num_inputs: ClassVar[int | None] = 1  # None: variadic (at least 2)
    needs_inputs: ClassVar[tuple[int, ...]] = ()
    needs_output: ClassVar[bool] = False
    checkpoint: ClassVar[bool] = False
    # backward can add its input's delta into a delta other consumers already wrote (`ctx.accumulate`), one sample
    # at a time: a fork then needs no full-size partial delta (graph/route.py)
    accumulates_in_place: ClassVar[bool] = False
    is_loss: ClassVar[bool] = False
    # Whether forward/backward read `ctx.rng_key` (it changes every iteration; the compiled step refreshes it).
    uses_rng_key: ClassVar[bool] = False
    # Inputs that never receive a gradient (labels of a loss).
    nondiff_inputs: ClassVar[tuple[int, ...]] = ()
    # Aux tensors backward can rebuild from what it reads anyway (attention's probabilities, from q and k): a plan
    # may leave them out of its route (`Route.without_aux`); the layer then gets no array for them in `ctx.aux`,
    # and forward and backward take the path that rebuilds them, with the same bits.
    rebuildable_aux: ClassVar[tuple[str, ...]] = ()
    # In a mixed-precision mode (`backend.precision`): the parameters the kernels read as their half copy (a
    # product's operands), and the aux tensors stored in half (scores; the others are statistics, float32).
    half_params: ClassVar[tuple[str, ...]] = ()
    half_aux: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str | None = None):
        self.name = name
        self._called = False

    # -- graph building -------------------------------------------------------------------------------
    def __call__(self, *inputs: "Symbol") -> "Symbol":
        if not inputs:
            raise GraphError(f"{self.describe()}: called with no inputs")
        for i, s in enumerate(inputs):
            if not isinstance(s, Symbol):
                raise GraphError(f"{self.describe()}: input {i} is {type(s).__name__}, expected a Symbol "
                                 f"returned by net.input() or by another layer")
        net = inputs[0].network
        if any(s.network is not net for s in inputs):
            raise GraphError(f"{self.describe()}: inputs come from different networks")
        if self._called:
            raise GraphError(f"{self.describe()}: this layer object was already called once; minidl does not "
                             f"share weights between calls, create a new layer instead")
        n = self.num_inputs
        if n is None and len(inputs) < 2:
            raise GraphError(f"{self.describe()}: needs at least 2 inputs, got {len(inputs)}")
        if n is not None and len(inputs) != n:
            raise GraphError(f"{self.describe()}: takes {n} input(s), got {len(inputs)}")
        self._called = True
        return net._add_layer(self, list(inputs))

    def describe(self) -> str:
        return f"layer '{self.name or '?'}' ({self.type_name})"

    # -- declarations (pure functions of shapes) -------------------------------------------------------
    def infer_shape(self, in_shapes: Sequence[Shape]) -> Shape:
        """Return the output shape, or raise ValueError saying what is wrong (wrapped into a GraphError)."""
        raise NotImplementedError

    def infer_dtype(self, in_dtypes: Sequence[np.dtype], net_dtype: np.dtype) -> np.dtype:
        return net_dtype

    def check_input_dtypes(self, in_dtypes: Sequence[np.dtype]) -> None:
        """Raise ValueError if an input dtype is wrong (default: all floating)."""
        for i, dt in enumerate(in_dtypes):
            if i in self.nondiff_inputs:
                continue
            if not np.issubdtype(dt, np.floating):
                raise ValueError(f"input {i} has dtype {np.dtype(dt).name}, expected a floating dtype")

    def check_training(self, in_shapes: Sequence[Shape]) -> None:
        """Raise GraphError naming the layer if it cannot train on inputs of these shapes (BN on one value per
        channel); checked when a training route is built (before planning) and by `testing.run_layer` in
        training mode, while evaluation stays allowed."""

    def check_values(self, inputs: Sequence[np.ndarray]) -> None:
        """Raise a MinidlError if the layer cannot compute on these input values (a loss on labels outside
        [0, classes)): run by `testing.run_layer` before forward. In a network the executor checks each batch
        (`Executor.check_batch`), so a layer's kernels can index with its labels unchecked."""

    def check_batch_input(self, k: int, batch: np.ndarray, where: str) -> None:
        """Raise a DataError naming `where` if `batch`, fed from a network input to this layer's input `k`, is
        unusable (token indices outside an embedding's table): run by the executor on every batch, before it is
        copied in, so the kernels can index with it unchecked."""

    def param_specs(self, in_shapes: Sequence[Shape]) -> dict[str, ParamSpec]:
        return {}

    def aux_specs(self, in_shapes: Sequence[Shape], training: bool = True) -> dict[str, Shape]:
        return {}

    def flops(self, in_shapes: Sequence[Shape], out_shape: Shape) -> int:
        """Forward FLOPs (multiply-adds count as 2). Backward is estimated as twice this by default."""
        return int(math.prod(out_shape))

    def backward_flops(self, in_shapes: Sequence[Shape], out_shape: Shape) -> int:
        return 2 * self.flops(in_shapes, out_shape)

    def workspace_options(self, phase: str, in_shapes: Sequence[Shape], out_shape: Shape,
                          itemsize: int, menu) -> list[WorkspaceOption]:
        """Algorithms this layer can run `phase` ('fwd' or 'bwd') with; empty means no choice, no workspace.

        `menu` is what the plan is for (the CPU's menu, the cuDNN model, a live backend): the algorithms and their
        workspace sizes are its own (cuDNN's execution plans are not the CPU's im2col).
        """
        return []

    def kernels(self) -> tuple[str, ...]:
        """Every backend kernel forward and backward may call, the compiled step's fusions included: what a
        backend needs in a half precision for this layer (`backend.precision.check_half_kernels`)."""
        return ()

    def backend_ops(self) -> tuple[str, ...]:
        """The backend methods this layer calls beyond those every backend has (the convolutional family's):
        a backend that lacks one cannot run the layer, and the executor says so, naming the layer, before any
        step runs (`check_backend`)."""
        return ()

    def config(self) -> dict[str, Any]:
        """Hyper-parameters, for summaries and checkpoints."""
        return {}

    # -- compute -------------------------------------------------------------------------------------------
    def forward(self, be, inputs: list[np.ndarray], out: np.ndarray, params: dict[str, np.ndarray],
                ctx: LayerContext) -> None:
        raise NotImplementedError

    def backward(self, be, inputs: list[np.ndarray | None], out: np.ndarray | None, dout: np.ndarray,
                 dinputs: list[np.ndarray | None], grads: dict[str, np.ndarray], params: dict[str, np.ndarray],
                 ctx: LayerContext) -> None:
        raise NotImplementedError

