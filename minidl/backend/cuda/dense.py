"""The CUDA backend's dense layers through cuBLAS, writing into the arena views given.

float32 runs `cupy.cublas.gemm`. A half product (`--math bf16|fp16`) runs `cublasGemmEx` on the half storage with
CUBLAS_COMPUTE_32F: float32 accumulation, half A and B; C half for activations and deltas (rounded once, the bias
added through beta = 1 on a C holding it), float32 for weight gradients (GemmEx takes 16BF/16F A, B with a 32F C).
Row-major arrays are passed as their column-major transposes: y (N, O) = x w^T is y^T = w^T x^T. A half call sets
cuBLAS's stream before enqueuing anything, so on a capturing stream it raises cupy's NotImplementedError first
(`CaptureUnsupported`: it then runs eagerly).
"""
from __future__ import annotations

import numpy as np

from . import halves
from .ops import F32, on_compute

#: cudaDataType_t of each device storage dtype (library_types.h: CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14).
CUDA_R = {F32: 0, halves.F16: 2, halves.BF16_BITS: 14}
CUBLAS_COMPUTE_32F = 68     # cublas_api.h cublasComputeType_t: float32 accumulation, no down-conversion
CUBLAS_GEMM_DEFAULT = -1    # cublas_api.h cublasGemmAlgo_t
CUBLAS_OP = {"N": 0, "T": 1}            # cublasOperation_t
CUBLAS_POINTER_MODE_HOST = 0            # alpha, beta: host float32 scalars (COMPUTE_32F's scale type)


class DenseOps:
    """Fully connected layers; a mixin of `CUDABackend`."""

    @on_compute
    def linear_forward(self, x, w, b, y) -> None:
        half = self._check_io("linear_forward", x=x, w=w, b=b, y=y)
        x2 = x.reshape(x.shape[0], -1)
        if half is None:
            self._cublas.gemm("N", "T", x2, w, out=y)
            if b is not None:
                self.cp.add(y, b, out=y)
            return
        (n, i), o = x2.shape, w.shape[0]
        blas = self._blas()
        if b is not None:
            self.cp.copyto(y, b.reshape(1, o))     # C = b, added to x w^T in float32 (beta = 1)
        self._gemm_ex(blas, "T", "N", o, n, i, w, i, x2, i, y, o, beta=0.0 if b is None else 1.0)

    @on_compute
    def linear_backward(self, x, w, dy, dx, dw, db) -> None:
        half = self._check_io("linear_backward", x=x, w=w, dy=dy, dx=dx)
        self._check("linear_backward", dw=dw, db=db)     # gradients: float32 in every mode
        x2 = x.reshape(x.shape[0], -1)
        if half is None:
            if dx is not None:
                self._cublas.gemm("N", "N", dy, w, out=dx.reshape(dx.shape[0], -1))
            if dw is not None:
                self._cublas.gemm("T", "N", dy, x2, out=dw)
        else:
            (n, i), o = x2.shape, w.shape[0]
            blas = self._blas()
            if dx is not None:    # dx (N, I) = dy w: dx^T = w^T dy^T
                self._gemm_ex(blas, "N", "N", i, n, o, w, i, dy, o, dx.reshape(n, i), i)
            if dw is not None:    # dw (O, I) = dy^T x: dw^T = x^T dy, float32
                self._gemm_ex(blas, "N", "T", i, o, n, x2, i, dy, o, dw, i)
        if db is not None:
            getattr(self._norm_kernels(), halves.variant("sum_f32", half))(dy, axis=0, out=db)

    def _gemm_ex(self, blas, transa: str, transb: str, m: int, n: int, k: int, a, lda: int, b, ldb: int, c,
                 ldc: int, beta: float = 0.0) -> None:
        """C (m x n, column-major) = op(A) op(B) + beta C by cublasGemmEx, float32 accumulation and scalars."""
        lib, handle = blas
        lib.gemmEx(handle, CUBLAS_OP[transa], CUBLAS_OP[transb], int(m), int(n), int(k),
                   self._host_scalar(1.0).ctypes.data, self._ptr(a), CUDA_R[np.dtype(a.dtype)], int(lda),
                   self._ptr(b), CUDA_R[np.dtype(b.dtype)], int(ldb),
                   self._host_scalar(beta).ctypes.data, self._ptr(c), CUDA_R[np.dtype(c.dtype)], int(ldc),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)

    def _gemm_strided_ex(self, blas, transa: str, transb: str, m: int, n: int, k: int, a, lda: int, stride_a: int,
                         b, ldb: int, stride_b: int, c, ldc: int, stride_c: int, count: int) -> None:
        """`count` products C_i = op(A_i) op(B_i) (column-major; X_i at X + i * stride_x elements) by
        cublasGemmStridedBatchedEx, float32 accumulation and scalars."""
        lib, handle = blas
        lib.gemmStridedBatchedEx(handle, CUBLAS_OP[transa], CUBLAS_OP[transb], int(m), int(n), int(k),
                                 self._host_scalar(1.0).ctypes.data, self._ptr(a), CUDA_R[np.dtype(a.dtype)],
                                 int(lda), int(stride_a), self._ptr(b), CUDA_R[np.dtype(b.dtype)], int(ldb),
                                 int(stride_b), self._host_scalar(0.0).ctypes.data, self._ptr(c),
                                 CUDA_R[np.dtype(c.dtype)], int(ldc), int(stride_c), int(count), CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT)

    def _blas(self):
        """(cupy's cuBLAS bindings, this device's handle) on the compute stream with host scalars; raises cupy's
        NotImplementedError on a capturing stream."""
        if self._cublas_ex is None:
            from cupy_backends.cuda.libs import cublas as lib

            self._cublas_ex = (lib, self.cp.cuda.device.get_cublas_handle())
        lib, handle = self._cublas_ex
        lib.setStream(handle, self.compute.ptr)
        lib.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
        return lib, handle
