"""The CPU's menu: which convolution algorithms a plan for the CPU chooses among, and how the CPU runs them.

A value, made where the run is described (the command line's --no-cpu-winograd and --threads, `get_backend`) and
held by the CPU backend that runs the plan (`CPUBackend.menu`). A plan made from a menu holds it in its route, so
the algorithms a step may run are fixed when the route is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...core.errors import OptionError
from ..base import Capabilities


@dataclass(frozen=True, slots=True)
class CPUMenu:
    """`winograd`: 3x3 stride-1 convolutions with >= 32 channels run Winograd F(2x2, 3x3) (`cpu_winograd`; off:
    the row-shift pair, other rounding, the same guarantees). `threads`: the lanes a convolution's samples and the
    compiled kernels run on (`cpu_lanes`; None: the usable cores, at most `cpu_lanes.MAX_LANES`). Results are the
    same bits whatever the threads."""

    winograd: bool = True
    threads: int | None = None
    capabilities: ClassVar[Capabilities] = Capabilities(name="cpu", device="host")

    def __post_init__(self) -> None:
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise OptionError(f"--threads must be a positive integer, got {self.threads!r}")

    def conv_workspace_options(self, phase: str, x_shape, w_shape, y_shape, stride, padding, dilation,
                               groups: int, dtype=np.float32):
        """The algorithms for `phase` ('fwd' or 'bwd') with their exact workspace bytes, fastest first (the same
        signature as the CUDA backend's)."""
        from .conv import ConvGeometry, conv_options

        n, cin, h, wd = x_shape
        cout, _, kh, kw = w_shape
        g = ConvGeometry(n, cin, h, wd, cout, kh, kw, y_shape[2], y_shape[3], groups, tuple(stride), tuple(padding),
                         tuple(dilation))
        return conv_options(phase, g, np.dtype(dtype).itemsize, tuple(stride), tuple(padding), tuple(dilation),
                            self.winograd)


CPU_MENU = CPUMenu()
"""The CPU's menu with its defaults: what a route built without a menu chooses among."""
