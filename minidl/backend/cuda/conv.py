"""The CUDA backend's windowed ops: convolutions (cuDNN graphs; every buildable execution plan is a workspace
option the planner chooses among) and pooling (kernels/pool.cu).

A half convolution (`--math bf16|fp16`) runs half graphs: the forward adds its bias in the convolution's epilogue
(`fprop_bias`, a zero bias where the layer has none) so y is rounded once; dgrad writes half dx (an accumulating one
adds in its epilogue, `dgrad_add`: no `+add` route), wgrad float32 dw.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...core.vocab import WorkspaceOption
from ..precision import HALF_DTYPES
from . import cudnn_specs, halves, launches
from .ops import chan4, on_compute

if TYPE_CHECKING:  # pragma: no cover
    from .backend import BuiltGraph


class ConvOps:
    """Convolution and pooling; a mixin of `CUDABackend`."""

    # -- convolution (cuDNN graphs; the planner picks the execution plan)
    def _conv_graph(self, op: str, spec: cudnn_specs.ConvSpec) -> BuiltGraph:
        return self.graphs.get(spec.key(op, self.filters))  # no fallback: GraphUnsupported propagates

    @staticmethod
    def _fprop_op(spec: cudnn_specs.ConvSpec) -> str:
        """The forward graph: a half one adds the bias before rounding; float32 adds it after (`chan4`)."""
        return "fprop_bias" if spec.half else "fprop"

    def _planned_dtype(self, dtype) -> np.dtype:
        """The device dtype of a planner's `dtype`: it names only an itemsize (`np.dtype(f"f{itemsize}")`), so in a
        half mode a 2-byte dtype is the mode's half storage."""
        dt = np.dtype(dtype)
        half = self.filters.half
        return halves.storage_dtype(HALF_DTYPES[half]) if half and dt.itemsize == 2 else dt

    def conv_workspace_options(self, phase: str, x_shape, w_shape, y_shape, stride, padding, dilation,
                               groups: int, dtype=np.float32, accumulate: bool = False) -> list[WorkspaceOption]:
        """The algorithms for `phase` with exact workspaces, fastest first (builds and caches
        the cuDNN graphs); `accumulate`: a backward adding dx into the delta it is given."""
        spec = cudnn_specs.ConvSpec.from_shapes(x_shape, w_shape, y_shape, stride, padding, dilation, groups,
                                                self._planned_dtype(dtype))
        if phase == "fwd":
            return cudnn_specs.conv_options(phase, {"fprop": self._conv_graph(self._fprop_op(spec), spec).plans})
        if phase != "bwd":
            raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
        wgrad = self._conv_graph("wgrad", spec).plans
        # a half delta has no `+add` route (its add would round dx twice): the fused graph or GraphUnsupported
        fused = self._graph(spec.key("dgrad_add", self.filters), required=spec.half) if accumulate else None
        if fused is not None or not accumulate:
            return cudnn_specs.conv_options(phase, {"dgrad": (fused or self._conv_graph("dgrad", spec)).plans,
                                                    "wgrad": wgrad})
        # no fused-add dgrad here (reason in `fallbacks`): `+add` names
        return cudnn_specs.conv_options(phase, {"dgrad": self._conv_graph("dgrad", spec).plans, "wgrad": wgrad},
                                        add_scratch=cudnn_specs.dx_scratch_bytes(spec.x, spec.dtype))

    def _workspace(self, op: str, workspace) -> tuple[int, int]:
        if workspace is None:
            return 0, 0
        self._check(op, np.dtype(np.uint8), workspace=workspace)
        return self._ptr(workspace), int(workspace.nbytes)

    def _choose(self, built: BuiltGraph, phase: str, algo: str | None, which: int,
                ws_bytes: int) -> cudnn_specs.PlanInfo:
        if algo is None:  # e.g. a recomputation: the heuristics' first plan that fits what was handed in
            return cudnn_specs.pick_plan(built.plans, ws_bytes)
        plan = built.plan(cudnn_specs.parse_conv_algo(phase, algo)[which])
        if plan.workspace_bytes > ws_bytes:
            raise ValueError(f"conv2d {phase}: algorithm {algo!r} ({built.key.op} plan {plan.index}, "
                             f"{plan.name}) needs a workspace of {plan.workspace_bytes} bytes, got {ws_bytes}")
        return plan

    @on_compute
    def conv2d_forward(self, x, w, b, y, stride, padding, dilation, groups: int, algo: str | None,
                       workspace) -> None:
        self._check_io("conv2d_forward", x=x, w=w, b=b, y=y)
        spec = cudnn_specs.ConvSpec.from_shapes(x.shape, w.shape, y.shape, stride, padding, dilation, groups, x.dtype)
        ws_ptr, ws_bytes = self._workspace("conv2d_forward", workspace)
        g = self._conv_graph(self._fprop_op(spec), spec)
        plan = self._choose(g, "fwd", algo, 0, ws_bytes)
        pointers = {"x": self._ptr(x), "w": self._ptr(w), "y": self._ptr(y)}
        if spec.half:
            pointers["b"] = self._ptr(b if b is not None else self._constant("zeros", w.shape[0], 0.0, x.dtype))
        self.graphs.execute(g, pointers, ws_ptr, plan.index)
        if b is not None and not spec.half:
            self.cp.add(y, chan4(b), out=y)

    @on_compute
    def conv2d_backward(self, x, w, dy, dx, dw, db, stride, padding, dilation, groups: int, algo: str | None,
                        workspace, accumulate: bool = False) -> None:
        """dx, dw, db given dy (any may be None); `accumulate`: dx += the data gradient, in the
        `dgrad_add` graph or, under a `+add` algorithm, through the workspace's head."""
        half = self._check_io("conv2d_backward", x=x, w=w, dy=dy, dx=dx)
        self._check("conv2d_backward", dw=dw, db=db)     # gradients: float32 in every mode
        spec = cudnn_specs.ConvSpec.from_shapes(x.shape, w.shape, dy.shape, stride, padding, dilation, groups,
                                                x.dtype)
        ws_ptr, ws_bytes = self._workspace("conv2d_backward", workspace)
        if dx is not None and accumulate and cudnn_specs.adds_after(algo):
            if spec.half:
                raise ValueError(f"conv2d bwd: {algo!r} adds dx after the data gradient, which a half delta has "
                                 f"not (ask conv_workspace_options(accumulate=True) in this mode)")
            head = cudnn_specs.dx_scratch_bytes(dx.shape, dx.dtype)
            if ws_bytes < head:
                raise ValueError(f"conv2d bwd: algorithm {algo!r} writes dx into its workspace: needs at least "
                                 f"{head} bytes, got {ws_bytes}")
            g = self._conv_graph("dgrad", spec)
            plan = self._choose(g, "bwd", algo, 0, ws_bytes - head)
            part = workspace[:dx.nbytes].view(dx.dtype).reshape(dx.shape)
            self.graphs.execute(g, {"y": self._ptr(dy), "w": self._ptr(w), "x": self._ptr(part)}, ws_ptr + head,
                                plan.index)
            self.accumulate(dx, part)
        elif dx is not None:
            g = self._conv_graph("dgrad_add" if accumulate else "dgrad", spec)
            plan = self._choose(g, "bwd", algo, 0, ws_bytes)
            pointers = {"y": self._ptr(dy), "w": self._ptr(w), "x": self._ptr(dx)}
            if accumulate:
                pointers["x_acc"] = pointers["x"]
            self.graphs.execute(g, pointers, ws_ptr, plan.index)
        if dw is not None:  # same stream, so it reuses the workspace after dgrad is done with it
            g = self._conv_graph("wgrad", spec)
            plan = self._choose(g, "bwd", algo, 1, ws_bytes)
            self.graphs.execute(g, {"x": self._ptr(x), "y": self._ptr(dy), "w": self._ptr(dw)}, ws_ptr,
                                plan.index)
        if db is not None:
            getattr(self._norm_kernels(), halves.variant("sum_f32", half))(dy, axis=(0, 2, 3), out=db)

    # -- pooling (kernels/pool.cu)
    @on_compute
    def maxpool2d_forward(self, x, y, kernel, stride, padding, dilation) -> None:
        self._check_io("maxpool2d_forward", x=x, y=y)
        self._launch(launches.maxpool2d_forward(y, x, kernel, stride, padding, dilation, self.limits))

    @on_compute
    def maxpool2d_backward(self, x, dy, dx, kernel, stride, padding, dilation) -> None:
        self._check_io("maxpool2d_backward", x=x, dy=dy, dx=dx)
        launch = launches.maxpool2d_backward(dx, dy, x, kernel, stride, padding, dilation, self.limits)
        if launch.name in launches.ZERO_OUTPUT_FIRST:
            dx.fill(0)  # float32 scatters with atomicAdd; the half forms gather
        self._launch(launch)

    @on_compute
    def avgpool2d_forward(self, x, y, kernel, stride, padding, count_include_pad: bool) -> None:
        self._check_io("avgpool2d_forward", x=x, y=y)
        self._launch(launches.avgpool2d_forward(y, x, kernel, stride, padding, count_include_pad, 0, self.limits))

    @on_compute
    def avgpool2d_backward(self, dy, dx, kernel, stride, padding, count_include_pad: bool) -> None:
        self._check_io("avgpool2d_backward", dy=dy, dx=dx)
        self._launch(launches.avgpool2d_backward(dx, dy, kernel, stride, padding, count_include_pad, 0,
                                               self.limits))

    @on_compute
    def global_avgpool_forward(self, x, y) -> None:
        self._check_io("global_avgpool_forward", x=x, y=y)
        self._launch(launches.global_avgpool_forward(y, x, self.limits))

    @on_compute
    def global_avgpool_backward(self, dy, dx) -> None:
        self._check_io("global_avgpool_backward", dy=dy, dx=dx)
        self._launch(launches.global_avgpool_backward(dx, dy, self.limits))
