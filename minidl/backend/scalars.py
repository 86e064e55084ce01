"""Per-step scalars at fixed device addresses for a captured CUDA graph (`minidl/runtime/capture.py`): dropout keys,
the learning rate and Adam's step live in device slots the graph's first node fills from pinned buffers, read by
the `*_dev` kernels (eager's bits). `diverged`, the guard's flag, is zeroed by each copy-in, set by
`nonfinite_flag`, read by the update kernels (which then skip), copied out to `diverged_out`. fp16: `amp` holds
[scale, inverse scale] (the loss's seed, the gradients' unscaling); `found_inf`, zeroed like `diverged`, is set where
a gradient is not finite before its unscaling and copied out to `found_inf_out` for the host to back the scale off.
"""
from __future__ import annotations

from typing import Any

import numpy as np

#: Index of each optimizer scalar in the float64 slots.
LR, STEP = 0, 1
#: Index of the loss scale and its inverse in the float32 `amp` slots.
SCALE, INV_SCALE = 0, 1


class StepScalars:
    """The slots of one captured step (`backend`: `host_empty`, pinned; `scalar_buffer`, device)."""

    def __init__(self, backend, dropout_nodes: list[int]):
        self.nodes = list(dropout_nodes)
        n = max(len(self.nodes), 1)
        self.keys_host = backend.host_empty((n,), np.uint64)
        self.optim_host = backend.host_empty((2,), np.float64)
        self.keys_host[...] = 0
        self.optim_host[...] = 0
        self.keys = backend.scalar_buffer("graph_keys", n, np.uint64)
        self.optim = backend.scalar_buffer("graph_optim", 2, np.float64)
        self.diverged_host = backend.host_empty((1,), np.int32)  # always 0
        self.diverged_host[...] = 0
        self.diverged_out = backend.host_empty((1,), np.int32)
        self.diverged_out[...] = 0
        self.diverged = backend.scalar_buffer("graph_diverged", 1, np.int32)
        self.amp_host = backend.host_empty((2,), np.float32)
        self.amp_host[...] = 1
        self.amp = backend.scalar_buffer("graph_amp", 2, np.float32)
        self.found_inf_out = backend.host_empty((1,), np.int32)
        self.found_inf_out[...] = 0
        self.found_inf = backend.scalar_buffer("graph_found_inf", 1, np.int32)
        self._slot_of_key: dict[int, int] = {}

    def fill(self, keys: list[int], lr: float, step: int, scale: float | None = None,
             inv_scale: float | None = None) -> None:
        """Write one step's values into the pinned buffers; `scale`, `inv_scale`: fp16's loss scale and its
        inverse."""
        for i, k in enumerate(keys):
            self.keys_host[i] = np.uint64(int(k) & 0xFFFFFFFFFFFFFFFF)
        self._slot_of_key = {int(k) & 0xFFFFFFFFFFFFFFFF: i for i, k in enumerate(keys)}
        self.optim_host[LR] = float(lr)
        self.optim_host[STEP] = float(step)
        if scale is not None:
            self.amp_host[SCALE] = np.float32(scale)
            self.amp_host[INV_SCALE] = np.float32(inv_scale)

    def copies(self, loss_scale: bool = False) -> list[tuple[Any, np.ndarray]]:
        """(device slot, pinned host array) pairs the graph copies in first; `loss_scale`: fp16's slots too."""
        out = [(self.keys, self.keys_host), (self.optim, self.optim_host), (self.diverged, self.diverged_host)]
        return out + ([(self.amp, self.amp_host), (self.found_inf, self.diverged_host)] if loss_scale else [])

    def key_slot(self, key: int):
        """The device slot of the dropout layer whose key this step is `key`."""
        i = self._slot_of_key.get(int(key) & 0xFFFFFFFFFFFFFFFF)
        if i is None:
            raise KeyError(f"dropout key {key} is not one of this step's ({len(self._slot_of_key)} dropout layers)")
        return self.keys[i:i + 1]

    def lr_slot(self, lr: float):
        """The learning-rate slot; `lr` must be the value `fill` wrote."""
        self._same("learning rate", lr, self.optim_host[LR])
        return self.optim[LR:LR + 1]

    def adam_slot(self, lr: float, step: int):
        """The [lr, step] slots of Adam's `_dev` kernel; the values must be those `fill` wrote."""
        self._same("learning rate", lr, self.optim_host[LR])
        self._same("Adam step", step, self.optim_host[STEP])
        return self.optim[LR:STEP + 1]

    def scale_slot(self, scale: float):
        """The loss scale's slot (the seed of the loss's gradient); `scale` must be the value written by `fill`."""
        self._same("loss scale", np.float32(scale), self.amp_host[SCALE])
        return self.amp[SCALE:SCALE + 1]

    def inv_scale_slot(self, inv_scale: float):
        """The inverse scale's slot (the gradients' unscaling); the value passed must be the one written by `fill`."""
        self._same("inverse loss scale", np.float32(inv_scale), self.amp_host[INV_SCALE])
        return self.amp[INV_SCALE:INV_SCALE + 1]

    @staticmethod
    def _same(what: str, passed, written) -> None:
        if float(passed) != float(written):
            raise ValueError(f"captured {what} {passed} is not the step's value {float(written)} in device memory")
