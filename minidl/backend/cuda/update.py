"""The CUDA backend's end of a step: the softmax cross-entropy loss (kernels/loss.cu: half logits and their delta
in a half mode, the loss and its gradient float32) and the optimizer updates (kernels/optim.cu, float32 masters;
their `_dev` variants read the learning rate from device memory inside a captured graph)."""
from __future__ import annotations

import numpy as np

from . import launches
from .ops import I64, on_compute


class UpdateOps:
    """The loss and the optimizer updates; a mixin of `CUDABackend`."""

    # -- loss
    @on_compute
    def softmax_xent_forward(self, logits, labels, loss) -> None:
        self._check_io("softmax_xent_forward", logits=logits)
        self._check("softmax_xent_forward", loss=loss)
        self._check("softmax_xent_forward", I64, labels=labels)
        n = logits.shape[0]
        rows = self.side.get("xent_rows", (n,), np.float32)
        self._launch(launches.softmax_xent_forward(rows, logits, labels, self.limits))
        self._launch(launches.softmax_xent_mean(loss, rows, n, self.limits))

    @on_compute
    def softmax_xent_backward(self, logits, labels, dloss, dlogits) -> None:
        half = self._check_io("softmax_xent_backward", logits=logits, dlogits=dlogits)
        self._check("softmax_xent_backward", dloss=dloss)
        self._check("softmax_xent_backward", I64, labels=labels)
        n = logits.shape[0]
        # scale = 1/N in the kernel, then * dloss on the device: no device->host sync to read dloss (a half form
        # multiplies before it rounds)
        self._launch(launches.softmax_xent_backward(dlogits, logits, labels, 1.0 / n, self.limits,
                                                    dloss=dloss if half else None))
        if half is None:
            self.cp.multiply(dlogits, dloss.reshape(()), out=dlogits)

    # -- optimizers
    @on_compute
    def sgd_update(self, p, g, buf, lr, momentum, dampening, weight_decay, nesterov, first_step) -> None:
        self._check("sgd_update", p=p, g=g, buf=buf)
        gs = self.graph_scalars  # capturing: the learning rate from its device slot (a schedule changes it)
        if gs is not None:
            self._launch(launches.sgd_update_dev(p, g, buf, gs.lr_slot(lr), momentum, dampening, weight_decay,
                                               nesterov, first_step, gs.diverged, self.limits))
            return
        self._launch(launches.sgd_update(p, g, buf, lr, momentum, dampening, weight_decay, nesterov, first_step,
                                       self.limits))

    @on_compute
    def adam_update(self, p, g, m, v, lr, beta1, beta2, eps, weight_decay, step) -> None:
        self._check("adam_update", p=p, g=g, m=m, v=v)
        gs = self.graph_scalars  # capturing: lr and the step (bias corrections) from their device slots
        if gs is not None:
            self._launch(launches.adam_update_dev(p, g, m, v, gs.adam_slot(lr, step), beta1, beta2, eps, weight_decay,
                                                gs.diverged, self.limits))
            return
        self._launch(launches.adam_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, self.limits))
