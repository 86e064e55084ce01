"""Tensor roles and ids: every byte a training step touches, named. The planner sees only `TensorSpec`s, never
arrays; the ids are spelled here alone.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np


class Role(str, enum.Enum):
    """What a tensor is for; memory reports break peak bytes down by role."""

    PARAMETER = "parameter"      # trainable weights
    BUFFER = "buffer"            # persistent non-trainable state (BN running statistics)
    GRADIENT = "gradient"        # gradient of a parameter
    OPTIMIZER = "optimizer"      # optimizer state (momentum, Adam moments)
    ACTIVATION = "activation"    # a layer's output
    AUX = "aux"                  # per-step tensors a layer saves for its backward (BN's mean/invstd)
    DELTA = "delta"              # gradient of an activation
    WORKSPACE = "workspace"      # a kernel's scratch (im2col, cuDNN's)
    DATA = "data"                # network input
    LABEL = "label"              # targets
    BUCKET = "bucket"            # data parallel: gradients packed for the all-reduce, one row per rank
    WEIGHT_COPY = "weight_copy"  # a half-precision mode: the half copy of a master weight that products read
    STAGING = "staging"          # a half-precision mode: float32 copies a CPU kernel stages its half operands in

    @property
    def persistent(self) -> bool:
        """Persistent tensors survive from one training step to the next."""
        return self in (Role.PARAMETER, Role.BUFFER, Role.OPTIMIZER, Role.WEIGHT_COPY)

    @property
    def mixed_only(self) -> bool:
        """Roles only a half-precision mode has: reports list them where a plan has such tensors."""
        return self in (Role.WEIGHT_COPY, Role.STAGING)


@dataclass(slots=True)
class TensorSpec:
    """A tensor as the planner sees it."""

    id: str
    role: Role
    shape: tuple[int, ...]
    dtype: np.dtype
    owner: str  # the layer (or input) the tensor belongs to
    # cached: a ResNet-2500 plan reads it a few 100,000 times (0.3 s a plan)
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.nbytes = int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize


def id_name(tid: str) -> str:
    """'act:conv1' -> 'conv1', for names a user typed (a tensor's layer is its spec's `owner`)."""
    return tid.partition(":")[2] or tid


COMPRESSED_PREFIX = "z:"


def compressed_id(tid: str) -> str:
    """The block holding `tid` compressed between forward and backward."""
    return COMPRESSED_PREFIX + tid


def compressed_source(tid: str) -> str | None:
    """`compressed_id`'s inverse, or None."""
    return tid[len(COMPRESSED_PREFIX):] if tid.startswith(COMPRESSED_PREFIX) else None


def micro_id(tid: str, micro: int | None, again: bool = False) -> str:
    """`act:conv1@2` (micro-batch 2), `act:conv1@2r` (its re-forward's copy); None: the canonical id."""
    return tid if micro is None else f"{tid}@{micro}{'r' if again else ''}"


def act_id(node_name: str) -> str:
    return f"act:{node_name}"


def delta_id(node_name: str) -> str:
    return f"delta:{node_name}"


def partial_delta_id(node_name: str, consumer: str, slot: int) -> str:
    """A later contribution to a fork's delta, added into it then freed."""
    return f"dpart:{node_name}@{consumer}.{slot}"


def param_id(layer: str, pname: str) -> str:
    return f"param:{layer}.{pname}"


def grad_id(layer: str, pname: str) -> str:
    return f"grad:{layer}.{pname}"


def opt_state_id(layer: str, pname: str, slot: str) -> str:
    return f"opt:{layer}.{pname}.{slot}"


def copy_id(layer: str, pname: str) -> str:
    """The half copy of master weight `param_id(layer, pname)` (a half-precision mode)."""
    return f"copy:{layer}.{pname}"


def staging_id(layer: str, phase: str) -> str:
    """The float32 staging of a layer's step in a half-precision mode on the CPU (`phase`: fwd, rfwd, bwd)."""
    return f"stage:{layer}.{phase}"


def aux_id(layer: str, name: str) -> str:
    return f"aux:{layer}.{name}"


def workspace_id(layer: str, phase: str) -> str:
    return f"ws:{layer}.{phase}"


def bucket_id(index: int) -> str:
    """The k-th gradient bucket (0: the first ready in backward)."""
    return f"bucket:{index}"
