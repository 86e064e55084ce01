"""The CUDA backend's normalizations: batch norm (cuDNN graphs, cupy kernels from `NORM_KERNELS` as the
fallback when cuDNN has no engine or `use_cudnn_bn` is off) and LRN (kernels/elementwise.cu, float32 or half storage).

A half batch norm (`--math bf16|fp16`) has half x, y, dx, dy and float32 scale, bias, statistics and parameter
gradients, in the cuDNN graphs and in the fallback alike. The fallback's half forms read x and dy exactly as float32,
then compute as the float32 kernels (sums in float64; the statistics' kernels are float32's own) and round y and dx
once on store. The backward with the running statistics (no cuDNN op) always runs the fallback.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import cudnn_specs, halves, launches
from .ops import chan4, on_compute

if TYPE_CHECKING:  # pragma: no cover
    from .backend import BuiltGraph

#: The layer kernels whose half forms are `NORM_KERNELS`' cupy kernels (`Capabilities.half_kernels`).
HALF_KERNELS: frozenset[str] = frozenset({"batchnorm_forward_train", "batchnorm_forward_apply",
                                          "batchnorm_forward_eval", "batchnorm_backward",
                                          "batchnorm_backward_eval"})


class NormOps:
    """Batch normalization and local response normalization; a mixin of `CUDABackend`."""

    # -- LRN (kernels/elementwise.cu)
    @on_compute
    def lrn_forward(self, x, y, size: int, alpha: float, beta: float, k: float) -> None:
        self._check_io("lrn_forward", x=x, y=y)
        self._launch(launches.lrn_forward(y, x, size, alpha, beta, k, self.limits))

    @on_compute
    def lrn_backward(self, x, y, dy, dx, size: int, alpha: float, beta: float, k: float) -> None:
        self._check_io("lrn_backward", x=x, y=y, dy=dy, dx=dx)
        self._launch(launches.lrn_backward(dx, x, y, dy, size, alpha, beta, k, self.limits))

    # -- batch normalization (cuDNN graphs, cupy kernels as the fallback)
    def _bn_graph(self, op: str, spec: cudnn_specs.BNSpec) -> BuiltGraph | None:
        """The graph of `op`, or None for the fallback kernels (`use_cudnn_bn` off, or cuDNN refuses: `fallbacks`)."""
        if not self.use_cudnn_bn:
            return None
        return self._graph(spec.key(op, self.filters))

    def _affine(self, weight, bias, c: int):
        scale = weight if weight is not None else self._constant("ones", c, 1.0)
        shift = bias if bias is not None else self._constant("zeros", c, 0.0)
        return scale, shift

    @on_compute
    def batchnorm_forward_train(self, x, weight, bias, running_mean, running_var, y, mean, invstd,
                                momentum: float, eps: float, update_running: bool = True) -> None:
        half = self._check_io("batchnorm_forward_train", x=x, y=y)
        self._check("batchnorm_forward_train", weight=weight, bias=bias, running_mean=running_mean,
                    running_var=running_var, mean=mean, invstd=invstd)
        spec = cudnn_specs.BNSpec.from_shape(x.shape, x.dtype)
        if spec.count < 2:
            raise ValueError(f"batch norm in training needs more than one value per channel, got input {x.shape}")
        c = spec.channels
        # y is rewritten by `batchnorm_forward_apply`, the call a recomputation makes with the saved statistics,
        # so a recomputed y has the same bits (the training graph's own y rounds otherwise)
        built = self._bn_graph("bn_train", spec)
        if built is not None:
            scale, shift = self._affine(weight, bias, c)
            if update_running:
                nrm, nrv = running_mean, running_var  # read and updated in place, as in cuDNN's own samples
            else:
                nrm = self.side.get("bn_next_mean", (c,), np.float32)
                nrv = self.side.get("bn_next_var", (c,), np.float32)
            self._run_graph(built, {"x": x, "y": y, "scale": scale, "bias": shift, "running_mean": running_mean,
                                    "running_var": running_var, "next_running_mean": nrm, "next_running_var": nrv,
                                    "mean": mean, "invstd": invstd},
                            scalars={"epsilon": eps, "momentum": momentum})
        else:
            k = self._norm_kernels()
            m = spec.count
            s = self.side.get("bn_sum", (c,), np.float64)
            ssq = self.side.get("bn_ssq", (c,), np.float64)
            getattr(k, halves.variant("sum", half))(x, axis=(0, 2, 3), out=s)
            k.mean(s, 1.0 / m, mean)
            getattr(k, halves.variant("sqdev", half))(x, chan4(mean), axis=(0, 2, 3), out=ssq)
            k.invstd(ssq, 1.0 / m, float(eps), invstd)
            if update_running:
                k.running(s, ssq, 1.0 / m, m / (m - 1), float(momentum), running_mean, running_var)
        self.batchnorm_forward_apply(x, weight, bias, mean, invstd, y)

    def _bn_apply_fallback(self, x, weight, bias, mean, invstd, y, half) -> None:
        k = self._norm_kernels()
        c = x.shape[1]
        scale, shift = self._affine(weight, bias, c)
        a = self.side.get("bn_a", (c,), np.float32)
        b = self.side.get("bn_b", (c,), np.float32)
        k.coef(invstd, scale, mean, shift, a, b)
        getattr(k, halves.variant("affine", half))(x, chan4(a), chan4(b), y)

    @on_compute
    def batchnorm_forward_apply(self, x, weight, bias, mean, invstd, y) -> None:
        half = self._check_io("batchnorm_forward_apply", x=x, y=y)
        self._check("batchnorm_forward_apply", weight=weight, bias=bias, mean=mean, invstd=invstd)
        built = self._bn_graph("bn_infer", cudnn_specs.BNSpec.from_shape(x.shape, x.dtype))
        if built is None:
            self._bn_apply_fallback(x, weight, bias, mean, invstd, y, half)
            return
        scale, shift = self._affine(weight, bias, x.shape[1])
        self._run_graph(built, {"x": x, "y": y, "mean": mean, "invstd": invstd, "scale": scale, "bias": shift})

    @on_compute
    def batchnorm_forward_eval(self, x, weight, bias, running_mean, running_var, y, eps: float) -> None:
        self._check_io("batchnorm_forward_eval", x=x, y=y)
        self._check("batchnorm_forward_eval", weight=weight, bias=bias, running_mean=running_mean,
                    running_var=running_var)
        inv = self.side.get("bn_eval_invstd", (x.shape[1],), np.float32)
        self._norm_kernels().invstd_from_var(running_var, float(eps), inv)
        self.batchnorm_forward_apply(x, weight, bias, running_mean, inv, y)

    @on_compute
    def batchnorm_backward(self, x, weight, dy, mean, invstd, dx, dweight, dbias) -> None:
        half = self._check_io("batchnorm_backward", x=x, dy=dy, dx=dx)
        self._check("batchnorm_backward", weight=weight, mean=mean, invstd=invstd, dweight=dweight, dbias=dbias)
        spec = cudnn_specs.BNSpec.from_shape(x.shape, x.dtype)
        c = spec.channels
        built = self._bn_graph("bn_backward", spec) if dx is not None else None
        if built is not None:
            scale, _ = self._affine(weight, None, c)
            dw = dweight if dweight is not None else self.side.get("bn_dscale", (c,), np.float32)
            db = dbias if dbias is not None else self.side.get("bn_dbias", (c,), np.float32)
            self._run_graph(built, {"x": x, "dy": dy, "dx": dx, "scale": scale, "mean": mean, "invstd": invstd,
                                    "dscale": dw, "dbias": db})
            return
        self._bn_backward_fallback(x, weight, dy, mean, invstd, dx, dweight, dbias, spec, half=half)

    def _bn_backward_fallback(self, x, weight, dy, mean, invstd, dx, dweight, dbias, spec, batch_stats=True,
                              half=None):
        """The cupy kernels' backward; `half`: x, dy and dx's storage (None: float32)."""
        k = self._norm_kernels()
        c, m = spec.channels, spec.count
        sdy = self.side.get("bn_sdy", (c,), np.float64)
        sdyd = self.side.get("bn_sdyd", (c,), np.float64)
        getattr(k, halves.variant("sum", half))(dy, axis=(0, 2, 3), out=sdy)
        getattr(k, halves.variant("dot", half))(dy, x, chan4(mean), axis=(0, 2, 3), out=sdyd)
        scale, _ = self._affine(weight, None, c)
        kk = self.side.get("bn_k", (c,), np.float32)
        g = self.side.get("bn_g", (c,), np.float32)
        s = self.side.get("bn_s", (c,), np.float32)
        dw = dweight if dweight is not None else self.side.get("bn_dscale", (c,), np.float32)
        db = dbias if dbias is not None else self.side.get("bn_dbias", (c,), np.float32)
        k.bwd_coef(sdy, sdyd, invstd, scale, 1.0 / m, kk, g, s, dw, db)
        if dx is None:
            return
        if batch_stats:
            getattr(k, halves.variant("dx", half))(x, dy, chan4(mean), chan4(kk), chan4(g), chan4(s), dx)
        else:  # fixed statistics: a per-channel affine map, dx = dy * weight * invstd
            getattr(k, halves.variant("scale", half))(dy, chan4(s), dx)

    @on_compute
    def batchnorm_backward_eval(self, x, weight, dy, running_mean, running_var, eps: float, dx, dweight,
                                dbias) -> None:
        """Backward with the running statistics (no cuDNN op covers it): cupy kernels, float32 or half x, dy, dx."""
        half = self._check_io("batchnorm_backward_eval", x=x, dy=dy, dx=dx)
        self._check("batchnorm_backward_eval", weight=weight, running_mean=running_mean, running_var=running_var,
                    dweight=dweight, dbias=dbias)
        spec = cudnn_specs.BNSpec.from_shape(x.shape, x.dtype)
        inv = self.side.get("bn_eval_invstd", (spec.channels,), np.float32)
        self._norm_kernels().invstd_from_var(running_var, float(eps), inv)
        self._bn_backward_fallback(x, weight, dy, running_mean, inv, dx, dweight, dbias, spec, batch_stats=False,
                                   half=half)
