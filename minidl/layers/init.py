"""Parameter initializers (PyTorch's defaults). Each parameter draws from its own generator, seeded by (run seed,
CRC32 of its name): inserting a layer leaves the others' values unchanged."""
from __future__ import annotations

import math
import zlib

import numpy as np

from .base import ParamSpec


def param_rng(seed: int, qualified_name: str) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(qualified_name.encode())])


def initial_values(spec: ParamSpec, rng: np.random.Generator, dtype) -> np.ndarray:
    """The initial values of a parameter as a host array."""
    out = np.empty(spec.shape, dtype)
    initialize(spec, out, rng)
    return out


def initialize(spec: ParamSpec, out: np.ndarray, rng: np.random.Generator) -> None:
    """Fill the host array `out` according to `spec.init`."""
    kind = spec.init
    if kind == "zeros":
        out.fill(0)
    elif kind == "ones":
        out.fill(1)
    elif kind in ("kaiming_uniform", "bias_uniform"):
        # PyTorch's conv/linear default: kaiming_uniform(a=sqrt(5)), bound 1/sqrt(fan_in); bias likewise
        bound = 1.0 / math.sqrt(max(1, spec.fan_in))
        out[...] = rng.uniform(-bound, bound, size=out.shape)
    elif kind == "kaiming_normal_fan_out":
        # torchvision's ResNet: kaiming_normal_(mode="fan_out", nonlinearity="relu")
        out[...] = rng.standard_normal(out.shape) * math.sqrt(2.0 / max(1, spec.fan_out))
    elif kind == "normal":
        # nn.Embedding's N(0, 1), or the model's std
        out[...] = rng.standard_normal(out.shape) if spec.std == 1.0 else rng.standard_normal(out.shape) * spec.std
    elif kind == "xavier_uniform":
        bound = math.sqrt(6.0 / max(1, spec.fan_in + spec.fan_out))
        out[...] = rng.uniform(-bound, bound, size=out.shape)
    else:
        raise ValueError(f"unknown initializer {kind!r}")
