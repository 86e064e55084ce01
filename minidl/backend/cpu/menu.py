"""The CPU's menu: the convolution algorithms a CPU plan chooses among and the lanes it runs them on; held by the
route, so a step's algorithms are fixed at build time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...core.errors import OptionError
from ..base import Capabilities


@dataclass(frozen=True, slots=True)
class CPUMenu:
    """`winograd`: 3x3 stride-1 convolutions with >= 32 channels run Winograd F(2x2, 3x3), else the row-shift pair.
    `threads`: the lanes (`cpu.lanes`; None: the usable cores); the bits are the same on any count."""

    winograd: bool = True
    threads: int | None = None
    capabilities: ClassVar[Capabilities] = Capabilities(name="cpu", device="host")

    def __post_init__(self) -> None:
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise OptionError(f"--threads must be a positive integer, got {self.threads!r}")

    def conv_workspace_options(self, phase: str, x_shape, w_shape, y_shape, stride, padding, dilation,
                               groups: int, dtype=np.float32, accumulate: bool = False):
        """The algorithms for `phase` ('fwd' or 'bwd'; `accumulate`: a backward adding dx into the delta it is
        given) with exact workspace bytes, fastest first."""
        from .conv import ConvGeometry, conv_options

        n, cin, h, wd = x_shape
        cout, _, kh, kw = w_shape
        g = ConvGeometry(n, cin, h, wd, cout, kh, kw, y_shape[2], y_shape[3], groups, tuple(stride), tuple(padding),
                         tuple(dilation))
        return conv_options(phase, g, np.dtype(dtype).itemsize, tuple(stride), tuple(padding), tuple(dilation),
                            self.winograd, accumulate)


CPU_MENU = CPUMenu()
"""The CPU's menu with its defaults: what a route built without a menu chooses among."""
