"""The CUDA backend's pointwise ops: ReLU (cuDNN graphs in float32, kernels/elementwise.cu as the fallback and in
a half mode), the joins (add, concat) and dropout (kernels/elementwise.cu, the counter-based mask the CPU backend
draws too). Each takes float32 or the mode's half storage, its arrays all one (`_check_io`)."""
from __future__ import annotations

import numpy as np

from . import cudnn_specs, launches
from .ops import on_compute


class PointwiseOps:
    """Activation, joins and dropout; a mixin of `CUDABackend`."""

    # -- activation
    @on_compute
    def relu_forward(self, x, y) -> None:
        half = self._check_io("relu_forward", x=x, y=y)
        built = self._graph(cudnn_specs.PointwiseSpec.from_shape(x.shape, x.dtype).key("relu_fwd", self.filters)) \
            if self.use_cudnn_relu and x.size and half is None else None
        if built is not None:
            self._run_graph(built, {"x": x, "y": y})
        else:
            self._launch(launches.relu_forward(y, x, self.limits))

    @on_compute
    def relu_backward(self, y, dy, dx) -> None:
        half = self._check_io("relu_backward", y=y, dy=dy, dx=dx)
        built = self._graph(cudnn_specs.PointwiseSpec.from_shape(y.shape, y.dtype).key("relu_bwd", self.filters)) \
            if self.use_cudnn_relu and y.size and half is None else None
        if built is not None:
            self._run_graph(built, {"y": y, "dy": dy, "dx": dx})
        else:
            self._launch(launches.relu_backward(dx, y, dy, self.limits))

    # -- joins
    @on_compute
    def add_forward(self, xs: list, y) -> None:
        half = self._check_io("add_forward", y=y, **{f"x{i}": x for i, x in enumerate(xs)})
        if len(xs) == 2:
            self._launch(launches.add_forward(y, xs[0], xs[1], self.limits))
            return
        if len(xs) <= launches.ADD_ARITY or half is None:   # the sum in float32 registers, stored once
            self._launch(launches.add_many(y, *xs[:launches.ADD_ARITY], limits=self.limits))
            for x in xs[launches.ADD_ARITY:]:
                self._launch(launches.add_forward(y, y, x, self.limits))  # out may alias an input
            return
        # more half inputs than one launch reads: one rounding, as the CPU, from a float32 sum in side buffers
        acc = self.side.get("add_sum", y.shape, np.float32)
        part = self.side.get("add_part", y.shape, np.float32)
        self._launch(launches.widen_copy(acc, xs[0], self.limits))
        for x in xs[1:]:
            self._launch(launches.widen_copy(part, x, self.limits))
            self._launch(launches.add_forward(acc, acc, part, self.limits))
        self._launch(launches.round_copy(y, acc, self.limits))

    @on_compute
    def concat_forward(self, xs: list, y) -> None:
        self._check_io("concat_forward", y=y, **{f"x{i}": x for i, x in enumerate(xs)})
        c = 0
        for x in xs:
            self._launch(launches.concat_copy_forward(y, x, c, self.limits))
            c += x.shape[1]

    @on_compute
    def concat_backward(self, dy, dxs: list, channels: list[int]) -> None:
        self._check_io("concat_backward", dy=dy, **{f"dx{i}": d for i, d in enumerate(dxs)})
        c = 0
        for dx, ch in zip(dxs, channels):
            if dx is not None:
                self._launch(launches.concat_copy_backward(dx, dy, c, self.limits))
            c += ch
    # -- dropout
    # captured: the key from its device slot (backend/scalars.py)
    @on_compute
    def dropout_forward(self, x, y, p: float, key: int) -> None:
        self._check_io("dropout_forward", x=x, y=y)
        gs = self.graph_scalars
        self._launch(launches.dropout_forward(y, x, p, key, self.limits) if gs is None else
                     launches.dropout_forward_dev(y, x, p, gs.key_slot(key), self.limits))

    @on_compute
    def dropout_backward(self, dy, dx, p: float, key: int) -> None:
        self._check_io("dropout_backward", dy=dy, dx=dx)
        gs = self.graph_scalars
        self._launch(launches.dropout_backward(dx, dy, p, key, self.limits) if gs is None else
                     launches.dropout_backward_dev(dx, dy, p, gs.key_slot(key), self.limits))
