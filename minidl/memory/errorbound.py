"""The adaptive error bound: the absolute error eb a stored activation may carry so that each backward reader's
gradient stays within relative error rho*; the smallest over the tensor's readers.
- Bilinear (conv, linear): codec errors act as uniform noise (variance eb^2 / 3), so eb = rho* sqrt(3 / F)
  ||G||_F / ||d||_F over fan-in F (rule B), the norms from the last backward (`observe`); before any, the
  conservative eb = sqrt(3) rho* rms(a) (rule B0).
- Normalize (batch norm): eb = sqrt(3) rho* / sqrt(mean_c 1 / sigma_c^2), from the tensor's channels (rule N).
- Sign (ReLU's output): kept exactly by the codec, no bound.
Measured gradient errors: `benchmarks/compression.py`.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from ..core.errors import OptionError

TARGET_REL_ERROR = 0.01
"""rho*: the relative (Frobenius) error of each reader's weight gradient the bound aims at."""

BN_EPS = 1e-5
"""Added to each channel's variance, as batch norm does: a dead channel does not force a zero bound."""


def _stats():
    """The compiled statistics (`codec.sz_jit`), imported on first use: planning never pays numba's import."""
    from ..codec import sz_jit

    return sz_jit


def _norm(a) -> float:
    """Frobenius norm by a float64 reduction (`np.linalg.norm`'s BLAS dot took ~14 ms a call on 2 shared cores)."""
    return math.sqrt(float(np.square(np.asarray(a), dtype=np.float64).sum()))


class ReaderKind(str, enum.Enum):
    BILINEAR = "bilinear"    # weight gradient = stored input (x) delta
    NORMALIZE = "normalize"  # batch norm's input
    SIGN = "sign"            # ReLU's output: only its sign is read


@dataclass(frozen=True, slots=True)
class Reader:
    """A backward step reading a compressed tensor, and what it needs of it."""

    node: str
    kind: ReaderKind


@dataclass(slots=True)
class Measure:
    """The last backward's ||G||_F, ||d||_F and fan-in F of a bilinear layer."""

    grad_norm: float
    delta_norm: float
    fan_in: int


class ErrorBoundRule:
    """Rules B, B0, N and the sign rule, with the measurements rule B adapts from."""

    def __init__(self, target: float = TARGET_REL_ERROR):
        if not (math.isfinite(target) and target > 0):
            raise OptionError(f"error bound target must be a finite relative error > 0, got {target!r}")
        self.target = float(target)
        self.measured: dict[str, Measure] = {}

    def observe(self, node: str, grad_w: np.ndarray, delta: np.ndarray) -> None:
        """Record a bilinear layer's weight gradient and output delta from one backward."""
        g, d = _norm(grad_w), _norm(delta)
        fan_in = int(np.prod(grad_w.shape[1:])) if grad_w.ndim > 1 else 1
        if math.isfinite(g) and math.isfinite(d) and g > 0 and d > 0:
            self.measured[node] = Measure(g, d, fan_in)

    def bound_for(self, x: np.ndarray, reader: Reader) -> float:
        """The bound one reader allows on `x` (inf: no constraint)."""
        rho = self.target
        if reader.kind is ReaderKind.SIGN:
            return math.inf
        if reader.kind is ReaderKind.NORMALIZE:
            x = np.ascontiguousarray(x)
            xs = x.reshape(x.shape[0], x.shape[1], -1) if x.ndim > 1 else x.reshape(1, 1, -1)
            var = _stats().channel_variances(xs)
            var = var[np.isfinite(var)]  # a channel with no finite value constrains nothing
            if not var.size:
                return math.inf
            return math.sqrt(3.0) * rho / math.sqrt(float(np.mean(1.0 / (var + BN_EPS))))
        m = self.measured.get(reader.node)
        if m is None:                                   # rule B0
            _, sq, cnt = _stats().finite_stats(np.ascontiguousarray(x).ravel())
            rms = math.sqrt(sq / cnt) if cnt else 0.0
            return math.sqrt(3.0) * rho * rms
        return rho * math.sqrt(3.0 / m.fan_in) * m.grad_norm / m.delta_norm   # rule B

    def bound(self, x: np.ndarray, readers: list[Reader]) -> float:
        """The smallest bound over `readers`, capped at max|x|, always > 0."""
        top = _stats().finite_stats(np.ascontiguousarray(x).ravel())[0]
        eb = min([self.bound_for(x, r) for r in readers] + [top])
        if not (math.isfinite(eb) and eb > 0):
            eb = top if top > 0 else 1.0   # all zeros: any bound stores them exactly
        return float(eb)
