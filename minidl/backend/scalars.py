"""Per-step scalars at fixed device addresses, for a captured CUDA graph (`minidl/runtime/capture.py`).

A kernel launch argument is fixed when a graph is captured, but some arguments change at every step: each dropout
layer's key (a function of the iteration), the learning rate (a schedule) and Adam's step count (its bias
corrections). `StepScalars` gives each of them a slot in device memory instead: the host writes the step's values
into a fixed pinned buffer before each replay, the graph's first node copies that buffer to the device, and the
`*_dev` kernels (kernels/elementwise.cu, kernels/optim.cu) read their value from the slot when they run.

While a capture is under way the backend holds the `StepScalars` (`backend.graph_scalars`) and launches the `_dev`
variant of those four kernels with the slot's address; outside a capture it launches the ordinary ones. Same
arithmetic either way, so eager and replayed steps give the same bits.

Layout: `keys` (uint64), one per dropout layer; `optim` (float64) = [learning rate, Adam's 1-based step];
`diverged` (int32): the divergence guard's flag on the device, zeroed by every step's copy-in, set by
`nonfinite_flag` to the code of the first non-finite guarded tensor, read by the update kernels' graph variants
(which then skip) and copied out to `diverged_out` for the host. fp16's loss scale: `amp` (float32) = [scale,
inverse scale], read by the loss's seed and the unscaling of the gradients (`fill_loss_scale`, `unscale`);
`found_inf` (int32), zeroed like `diverged`, set where a gradient is not finite before its unscaling
(`found_inf_flag`) and copied out to `found_inf_out`: the host reads it to back the scale off.
"""
from __future__ import annotations

from typing import Any

import numpy as np

#: Index of each optimizer scalar in the float64 slots (the `_dev` kernels read [lr] or [lr, step]).
LR, STEP = 0, 1
#: Index of the loss scale and its inverse in the float32 `amp` slots.
SCALE, INV_SCALE = 0, 1


class StepScalars:
    """The slots of one captured step; `backend` provides `host_empty` (pinned) and `scalar_buffer` (device)."""

    def __init__(self, backend, dropout_nodes: list[int]):
        self.nodes = list(dropout_nodes)
        n = max(len(self.nodes), 1)
        self.keys_host = backend.host_empty((n,), np.uint64)
        self.optim_host = backend.host_empty((2,), np.float64)
        self.keys_host[...] = 0
        self.optim_host[...] = 0
        self.keys = backend.scalar_buffer("graph_keys", n, np.uint64)
        self.optim = backend.scalar_buffer("graph_optim", 2, np.float64)
        self.diverged_host = backend.host_empty((1,), np.int32)     # always 0: the flag's start of each step
        self.diverged_host[...] = 0
        self.diverged_out = backend.host_empty((1,), np.int32)      # the flag after the step
        self.diverged_out[...] = 0
        self.diverged = backend.scalar_buffer("graph_diverged", 1, np.int32)
        self.amp_host = backend.host_empty((2,), np.float32)
        self.amp_host[...] = 1
        self.amp = backend.scalar_buffer("graph_amp", 2, np.float32)
        self.found_inf_out = backend.host_empty((1,), np.int32)     # the overflow flag after the step
        self.found_inf_out[...] = 0
        self.found_inf = backend.scalar_buffer("graph_found_inf", 1, np.int32)
        self._slot_of_key: dict[int, int] = {}

    def fill(self, keys: list[int], lr: float, step: int, scale: float | None = None,
             inv_scale: float | None = None) -> None:
        """Write one step's values into the pinned buffers (before the replay whose first node copies them);
        `scale`, `inv_scale`: fp16's loss scale and what the gradients are multiplied by (`LossScaler`)."""
        for i, k in enumerate(keys):
            self.keys_host[i] = np.uint64(int(k) & 0xFFFFFFFFFFFFFFFF)
        self._slot_of_key = {int(k) & 0xFFFFFFFFFFFFFFFF: i for i, k in enumerate(keys)}
        self.optim_host[LR] = float(lr)
        self.optim_host[STEP] = float(step)
        if scale is not None:
            self.amp_host[SCALE] = np.float32(scale)
            self.amp_host[INV_SCALE] = np.float32(inv_scale)

    def copies(self, loss_scale: bool = False) -> list[tuple[Any, np.ndarray]]:
        """(device slot array, pinned host array) pairs the graph copies in before anything else (the flags from
        the pinned zero); `loss_scale`: fp16's slots too."""
        out = [(self.keys, self.keys_host), (self.optim, self.optim_host), (self.diverged, self.diverged_host)]
        return out + ([(self.amp, self.amp_host), (self.found_inf, self.diverged_host)] if loss_scale else [])

    # -- what the backend asks while capturing ----------------------------------------------------------------
    def key_slot(self, key: int):
        """The device slot (a one-element uint64 array) of the dropout layer whose key this step is `key`."""
        i = self._slot_of_key.get(int(key) & 0xFFFFFFFFFFFFFFFF)
        if i is None:
            raise KeyError(f"dropout key {key} is not one of this step's ({len(self._slot_of_key)} dropout layers)")
        return self.keys[i:i + 1]

    def lr_slot(self, lr: float):
        """The learning-rate slot; `lr` (what the optimizer passes now) must be the value written by `fill`."""
        self._same("learning rate", lr, self.optim_host[LR])
        return self.optim[LR:LR + 1]

    def adam_slot(self, lr: float, step: int):
        """The [lr, step] slots of Adam's `_dev` kernel; the values passed must be those written by `fill`."""
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
