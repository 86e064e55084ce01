"""The CUDA backend's dense layers through cuBLAS (`cupy.cublas.gemm`), writing into the arena views given."""
from __future__ import annotations

from .ops import on_compute


class DenseOps:
    """Fully connected layers; a mixin of `CUDABackend`."""

    @on_compute
    def linear_forward(self, x, w, b, y) -> None:
        self._check("linear_forward", x=x, w=w, b=b, y=y)
        self._cublas.gemm("N", "T", x.reshape(x.shape[0], -1), w, out=y)
        if b is not None:
            self.cp.add(y, b, out=y)

    @on_compute
    def linear_backward(self, x, w, dy, dx, dw, db) -> None:
        self._check("linear_backward", x=x, w=w, dy=dy, dx=dx, dw=dw, db=db)
        if dx is not None:
            self._cublas.gemm("N", "N", dy, w, out=dx.reshape(dx.shape[0], -1))
        if dw is not None:
            self._cublas.gemm("T", "N", dy, x.reshape(x.shape[0], -1), out=dw)
        if db is not None:
            self._norm_kernels().sum_f32(dy, axis=0, out=db)
