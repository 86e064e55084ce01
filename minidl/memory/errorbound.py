"""The adaptive error bound: how much absolute error a stored activation may carry, per tensor, per iteration.

A compressed activation is read back in backward by the layers that declared they need it (`needs_inputs`,
`needs_output`). The bound is chosen so that each such reader's *weight gradient* stays within a relative error
`target` (rho*, default 1 %) of the exact one. Three kinds of reader are allowed (`ReaderKind`); any other reader
(max-pool, whose backward re-finds the argmax; LRN; the loss) makes the tensor ineligible, so that its gradients
stay exact (see `decisions/compress.py`).

**Bilinear readers (convolution, linear): the derivation.** Their weight gradient is bilinear in the stored
input a and the output's delta d:

    G[o, c, k] = sum_{n, p} a[n, c, p + k] * d[n, o, p]        (linear: G = d^T a)

Storing a' = a + e with |e| <= eb gives the gradient error E[o, c, k] = sum_{n, p} e[n, c, p + k] d[n, o, p].
The worst case, |E[o, c, k]| <= eb * ||d_o||_1, is far too pessimistic: it needs every error to take the sign of
the delta it meets. The codec's errors behave like independent uniform noise on [-eb, eb] (midpoint
quantization of values that span many bins), mean 0 and variance eb^2 / 3, uncorrelated with d. Then E[o, c, k]
has variance eb^2 / 3 * ||d_o||_2^2, and summing over the F = C * KH * KW entries of each output filter:

    E ||E||_F^2 = eb^2 * F / 3 * ||d||_F^2     =>     rho = ||E||_F / ||G||_F ~ eb * sqrt(F / 3) * ||d||_F / ||G||_F

so the bound that gives relative gradient error rho* is

    eb = rho* * sqrt(3 / F) * ||G||_F / ||d||_F                                           (rule B)

**How it adapts.** ||G|| / ||d|| is measured in every backward pass (`observe`), and the bound of the *next*
iteration's compression follows it: a tensor is compressed in forward, before its own iteration's delta exists, so
the last measured ratio is the best estimate (it drifts slowly: both norms shrink together as the loss falls, and
the ratio tracks the scale of the activations the layer sees). Before the first measurement (iteration 0) the
rule uses the tensor itself: if a and d were uncorrelated, ||G||_F ~ sqrt(F) * rms(a) * ||d||_F, which turns
rule B into eb = sqrt(3) * rho* * rms(a); correlation only makes ||G|| larger, so this first bound is the
conservative one (rule B0).

**Normalizing readers (batch norm)** read their input to rebuild x_hat = (a - mean_c) / sigma_c; an error e
becomes e / sigma_c in x_hat, which enters d gamma and the input delta linearly. Keeping the relative rms error
of x_hat at rho* over the whole tensor gives eb = sqrt(3) * rho* / sqrt(mean_c 1 / sigma_c^2), with sigma_c the
tensor's own batch std per channel (plus BN's eps): known at compression time, no measurement needed (rule N).

**Sign readers (ReLU, reading its output)** only ask `out > 0`, which the codec keeps exactly (zeros are exact
and no sign flips), so they impose no bound at all. A tensor read only by sign readers is stored at the largest
useful bound, max|a| (every nonzero value lands in the first bin: a one-bit mask, in effect).

The tensor's bound is the smallest over its readers. The measured relative gradient error against rho* is in
`benchmarks/compression.py` (docs/reproductions.md, COMET).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from ..core.errors import OptionError

TARGET_REL_ERROR = 0.01
"""rho*: the relative error (Frobenius norm) of each reader's weight gradient the bound aims at."""

BN_EPS = 1e-5
"""Added to each channel's variance, as batch norm does, so a dead channel does not force a zero bound."""


def _stats():
    """The compiled statistics (`codec.sz_jit`: max |x|, rms, per-channel variance over finite values, one pass
    each), imported on first use: planning, which imports this module, never pays numba's import. They replaced
    numpy reductions over float64 copies that cost as much as the codec itself in a compressed step."""
    from ..codec import sz_jit

    return sz_jit


def _norm(a) -> float:
    """Frobenius norm accumulated in float64 by a plain reduction: `np.linalg.norm` goes through BLAS dot, which
    cost ~14 ms per call on the shared 2-core machine (thread hand-offs) and tripled a ResNet-20/digits step."""
    return math.sqrt(float(np.square(np.asarray(a), dtype=np.float64).sum()))


class ReaderKind(str, enum.Enum):
    BILINEAR = "bilinear"    # weight gradient = stored input (x) delta: convolution, linear
    NORMALIZE = "normalize"  # batch norm's input
    SIGN = "sign"            # ReLU's output: only its sign is read


@dataclass(frozen=True, slots=True)
class Reader:
    """A backward step that reads a compressed tensor: the layer's name and what it needs from the tensor."""

    node: str
    kind: ReaderKind


@dataclass(slots=True)
class Measure:
    """The last backward's norms of a bilinear layer: ||G||_F, ||d||_F and the fan-in F of one output."""

    grad_norm: float
    delta_norm: float
    fan_in: int


class ErrorBoundRule:
    """Rules B, B0, N and the sign rule above, with the measurements rule B adapts from."""

    def __init__(self, target: float = TARGET_REL_ERROR):
        if not (math.isfinite(target) and target > 0):
            raise OptionError(f"error bound target must be a finite relative error > 0, got {target!r}")
        self.target = float(target)
        self.measured: dict[str, Measure] = {}

    def observe(self, node: str, grad_w: np.ndarray, delta: np.ndarray) -> None:
        """Record one backward pass of bilinear layer `node`: its weight gradient and its output's delta."""
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
            var = var[np.isfinite(var)]  # a channel with no finite value has no variance: it constrains nothing
            if not var.size:
                return math.inf
            return math.sqrt(3.0) * rho / math.sqrt(float(np.mean(1.0 / (var + BN_EPS))))
        m = self.measured.get(reader.node)
        if m is None:                                   # rule B0: nothing measured yet
            _, sq, cnt = _stats().finite_stats(np.ascontiguousarray(x).ravel())
            rms = math.sqrt(sq / cnt) if cnt else 0.0
            return math.sqrt(3.0) * rho * rms
        return rho * math.sqrt(3.0 / m.fan_in) * m.grad_norm / m.delta_norm   # rule B

    def bound(self, x: np.ndarray, readers: list[Reader]) -> float:
        """The smallest bound over `readers`, capped at max|x| (a larger one changes nothing), always > 0."""
        top = _stats().finite_stats(np.ascontiguousarray(x).ravel())[0]
        eb = min([self.bound_for(x, r) for r in readers] + [top])
        if not (math.isfinite(eb) and eb > 0):
            eb = top if top > 0 else 1.0   # all zeros (or a zero rms): any bound stores them exactly
        return float(eb)
