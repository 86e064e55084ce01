"""The CUDA backend's windowed ops: convolutions (cuDNN graphs; every buildable execution plan is a workspace
option the planner chooses among) and pooling (kernels/pool.cu)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...core.vocab import WorkspaceOption
from . import cudnn_specs, launches
from .ops import chan4, on_compute

if TYPE_CHECKING:  # pragma: no cover
    from .backend import BuiltGraph


class ConvOps:
    """Convolution and pooling.

    A mixin of `CUDABackend` (backend.py), which holds the streams, the kernels and the helpers these methods
    call (`_check`, `_launch`, `_graph`...)."""

    # -- convolution (cuDNN graphs; the planner picks the execution plan) -----------------------------------
    def _conv_graph(self, op: str, spec: cudnn_specs.ConvSpec) -> BuiltGraph:
        return self.graphs.get(spec.key(op, self.filters))  # no fallback: GraphUnsupported propagates

    def conv_workspace_options(self, phase: str, x_shape, w_shape, y_shape, stride, padding, dilation,
                               groups: int, dtype=np.float32) -> list[WorkspaceOption]:
        """The convolution's algorithms for `phase` ('fwd' or 'bwd') with their exact workspace bytes, fastest
        first: what `Conv2d.workspace_options` returns on the CPU. Builds (and caches) the cuDNN graphs."""
        spec = cudnn_specs.ConvSpec.from_shapes(x_shape, w_shape, y_shape, stride, padding, dilation, groups, dtype)
        if phase == "fwd":
            plans = {"fprop": self._conv_graph("fprop", spec).plans}
        elif phase == "bwd":
            plans = {"dgrad": self._conv_graph("dgrad", spec).plans, "wgrad": self._conv_graph("wgrad", spec).plans}
        else:
            raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
        return cudnn_specs.conv_options(phase, plans)

    def _workspace(self, op: str, workspace) -> tuple[int, int]:
        if workspace is None:
            return 0, 0
        self._check(op, np.dtype(np.uint8), workspace=workspace)
        return self._ptr(workspace), int(workspace.nbytes)

    def _choose(self, built: BuiltGraph, phase: str, algo: str | None, which: int,
                ws_bytes: int) -> cudnn_specs.PlanInfo:
        if algo is None:  # e.g. a recomputation: the heuristics' first plan that fits what was handed in
            return cudnn_specs.pick_plan(built.plans, ws_bytes)
        index = cudnn_specs.parse_conv_algo(phase, algo)[which]
        plan = built.find(index)
        if plan is None:
            # The algorithm was chosen for this convolution on the whole batch, and this call is on a slice of
            # it: a fork's in-place gradient sum takes the input delta one sample at a time (layers/conv.py),
            # and cuDNN builds other engines for one sample. The heuristics' first plan within the same
            # workspace stands in (the same one at every step), and the report's `fallbacks` says so.
            plan = cudnn_specs.pick_plan(built.plans, ws_bytes)
            self.fallbacks.setdefault(
                f"{built.key.op} {algo!r} on a slice", f"plan {index} is not built for this shape (have "
                f"{[p.index for p in built.plans]}): plan {plan.index} ({plan.name}) runs instead")
            return plan
        if plan.workspace_bytes > ws_bytes:
            raise ValueError(f"conv2d {phase}: algorithm {algo!r} ({built.key.op} plan {plan.index}, "
                             f"{plan.name}) needs a workspace of {plan.workspace_bytes} bytes, got {ws_bytes}")
        return plan

    @on_compute
    def conv2d_forward(self, x, w, b, y, stride, padding, dilation, groups: int, algo: str | None,
                       workspace) -> None:
        self._check("conv2d_forward", x=x, w=w, b=b, y=y)
        spec = cudnn_specs.ConvSpec.from_shapes(x.shape, w.shape, y.shape, stride, padding, dilation, groups, x.dtype)
        ws_ptr, ws_bytes = self._workspace("conv2d_forward", workspace)
        g = self._conv_graph("fprop", spec)
        plan = self._choose(g, "fwd", algo, 0, ws_bytes)
        self.graphs.execute(g, {"x": self._ptr(x), "w": self._ptr(w), "y": self._ptr(y)}, ws_ptr, plan.index)
        if b is not None:
            self.cp.add(y, chan4(b), out=y)

    @on_compute
    def conv2d_backward(self, x, w, dy, dx, dw, db, stride, padding, dilation, groups: int, algo: str | None,
                        workspace) -> None:
        self._check("conv2d_backward", x=x, w=w, dy=dy, dx=dx, dw=dw, db=db)
        spec = cudnn_specs.ConvSpec.from_shapes(x.shape, w.shape, dy.shape, stride, padding, dilation, groups,
                                           x.dtype)
        ws_ptr, ws_bytes = self._workspace("conv2d_backward", workspace)
        if dx is not None:
            g = self._conv_graph("dgrad", spec)
            plan = self._choose(g, "bwd", algo, 0, ws_bytes)
            self.graphs.execute(g, {"y": self._ptr(dy), "w": self._ptr(w), "x": self._ptr(dx)}, ws_ptr,
                                plan.index)
        if dw is not None:  # same stream, so it reuses the workspace after dgrad is done with it
            g = self._conv_graph("wgrad", spec)
            plan = self._choose(g, "bwd", algo, 1, ws_bytes)
            self.graphs.execute(g, {"x": self._ptr(x), "y": self._ptr(dy), "w": self._ptr(dw)}, ws_ptr,
                                plan.index)
        if db is not None:
            self._norm_kernels().sum_f32(dy, axis=(0, 2, 3), out=db)

    # -- pooling (kernels/pool.cu) ---------------------------------------------------------------------------
    @on_compute
    def maxpool2d_forward(self, x, y, kernel, stride, padding, dilation) -> None:
        self._check("maxpool2d_forward", x=x, y=y)
        self._launch(launches.maxpool2d_forward(y, x, kernel, stride, padding, dilation, self.limits))

    @on_compute
    def maxpool2d_backward(self, x, dy, dx, kernel, stride, padding, dilation) -> None:
        self._check("maxpool2d_backward", x=x, dy=dy, dx=dx)
        launch = launches.maxpool2d_backward(dx, dy, x, kernel, stride, padding, dilation, self.limits)
        dx.fill(0)  # the kernel scatters with atomicAdd (launches.ZERO_OUTPUT_FIRST)
        self._launch(launch)

    @on_compute
    def avgpool2d_forward(self, x, y, kernel, stride, padding, count_include_pad: bool) -> None:
        self._check("avgpool2d_forward", x=x, y=y)
        self._launch(launches.avgpool2d_forward(y, x, kernel, stride, padding, count_include_pad, 0, self.limits))

    @on_compute
    def avgpool2d_backward(self, dy, dx, kernel, stride, padding, count_include_pad: bool) -> None:
        self._check("avgpool2d_backward", dy=dy, dx=dx)
        self._launch(launches.avgpool2d_backward(dx, dy, kernel, stride, padding, count_include_pad, 0,
                                               self.limits))

    @on_compute
    def global_avgpool_forward(self, x, y) -> None:
        self._check("global_avgpool_forward", x=x, y=y)
        self._launch(launches.global_avgpool_forward(y, x, self.limits))

    @on_compute
    def global_avgpool_backward(self, dy, dx) -> None:
        self._check("global_avgpool_backward", dy=dy, dx=dx)
        self._launch(launches.global_avgpool_backward(dx, dy, self.limits))
