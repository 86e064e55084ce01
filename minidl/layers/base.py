"""The layer contract: shape inference, parameters, FLOPs, backward needs, forward and backward.

Rules: what the planner needs is *declared*, never discovered by running code: `needs_inputs` / `needs_output`
(what backward reads), `param_specs`, `aux_specs`, `checkpoint`. A layer keeps no array in `self` between
forward and backward. Forward and backward write into the arrays they are given.
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
    """(rows, C) of a tensor worked on along its last axis: (B, T, C) is a (B*T, C) matrix."""
    return math.prod(shape[:-1]), shape[-1]


@dataclass(slots=True)
class ParamSpec:
    """A parameter or buffer of a layer. `init` names an initializer in `minidl.layers.init`."""

    shape: Shape
    init: str
    trainable: bool = True
    fan_in: int = 1
    fan_out: int = 1
    std: float = 1.0  # the "normal" initializer's standard deviation


@dataclass(slots=True)
class LayerContext:
    """Per-call state from the executor; with `recompute`, forward gives the same result without side
    effects."""

    training: bool = True
    aux: dict[str, np.ndarray] = field(default_factory=dict)
    workspace: np.ndarray | None = None
    algo: str | None = None
    rng_key: int = 0
    recompute: bool = False
    accumulate: frozenset[int] = frozenset()  # backward: input slots whose delta it adds into


class Layer:
    """Base class of every layer. Subclasses set the class attributes and override the hooks."""

    type_name: ClassVar[str] = "layer"
    num_inputs: ClassVar[int | None] = 1  # None: variadic (at least 2)
    needs_inputs: ClassVar[tuple[int, ...]] = ()
    needs_output: ClassVar[bool] = False
    checkpoint: ClassVar[bool] = False
    # backward can add into a delta other consumers wrote (`ctx.accumulate`): a fork needs no partial delta
    accumulates_in_place: ClassVar[bool] = False
    is_loss: ClassVar[bool] = False
    uses_rng_key: ClassVar[bool] = False
    nondiff_inputs: ClassVar[tuple[int, ...]] = ()
    # aux a plan may leave out (`Route.without_aux`): backward rebuilds them, with the same bits
    rebuildable_aux: ClassVar[tuple[str, ...]] = ()
    # mixed precision: parameters read as their half copy, aux stored in half
    half_params: ClassVar[tuple[str, ...]] = ()
    half_aux: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str | None = None):
        self.name = name
        self._called = False

    # -- graph building
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

    # -- declarations (pure functions of shapes)
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
        """Raise GraphError naming the layer if it cannot train on these shapes (before planning)."""

    def check_values(self, inputs: Sequence[np.ndarray]) -> None:
        """Raise a MinidlError if the layer cannot compute on these values (`testing.run_layer`)."""

    def check_batch_input(self, k: int, batch: np.ndarray, where: str) -> None:
        """Raise a DataError naming `where` if a fed batch is unusable for input `k`."""

    def param_specs(self, in_shapes: Sequence[Shape]) -> dict[str, ParamSpec]:
        return {}

    def aux_specs(self, in_shapes: Sequence[Shape], training: bool = True) -> dict[str, Shape]:
        return {}

    def flops(self, in_shapes: Sequence[Shape], out_shape: Shape) -> int:
        """Forward FLOPs (a multiply-add is 2)."""
        return int(math.prod(out_shape))

    def backward_flops(self, in_shapes: Sequence[Shape], out_shape: Shape) -> int:
        return 2 * self.flops(in_shapes, out_shape)

    def workspace_options(self, phase: str, in_shapes: Sequence[Shape], out_shape: Shape, itemsize: int, menu,
                          accumulate: frozenset[int] = frozenset()) -> list[WorkspaceOption]:
        """Algorithms for `phase` ('fwd' or 'bwd') from `menu`, the backend the plan is for
        (empty: no choice, no workspace); `accumulate`: the input slots whose delta backward adds into."""
        return []

    def kernels(self) -> tuple[str, ...]:
        """Every backend kernel forward and backward may call (what a half precision must have)."""
        return ()

    def backend_ops(self) -> tuple[str, ...]:
        """Backend methods beyond the common ones: checked before any step (`check_backend`)."""
        return ()

    def config(self) -> dict[str, Any]:
        """Hyper-parameters, for summaries and checkpoints."""
        return {}

    # -- compute
    def forward(self, be, inputs: list[np.ndarray], out: np.ndarray, params: dict[str, np.ndarray],
                ctx: LayerContext) -> None:
        raise NotImplementedError

    def backward(self, be, inputs: list[np.ndarray | None], out: np.ndarray | None, dout: np.ndarray,
                 dinputs: list[np.ndarray | None], grads: dict[str, np.ndarray], params: dict[str, np.ndarray],
                 ctx: LayerContext) -> None:
        raise NotImplementedError

