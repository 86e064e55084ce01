"""numpy's own BLAS GEMM callable from compiled (numba) kernels, whose OpenMP regions (~3 us; a Python hand-off:
30-70 us) split small GEMMs. numpy's `cblas_?gemm` is registered under fixed names the cached kernels call
(numba's `np.dot` would call scipy's BLAS: other rounding); on a pinned BLAS `gemm` has np.matmul's bits.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
from numba import prange, types

from ...core.jit_cache import njit
from . import lanes

_SYMBOLS = {"minidl_sgemm": ("scipy_cblas_sgemm64_", "cblas_sgemm64_"),
            "minidl_dgemm": ("scipy_cblas_dgemm64_", "cblas_dgemm64_")}
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_SPINCOUNT = 10_000  # GNU OpenMP's spins after a region (ResNet-56 b32, 2 threads: 231 ms a step; 288 at its default)


def _bind() -> bool:
    """Register numpy's BLAS GEMMs with LLVM under the kernels' names; False if not found."""
    try:
        import numpy  # noqa: F401 - threadpoolctl finds only loaded libraries
        from llvmlite import binding as llvm
        from threadpoolctl import threadpool_info
    except ImportError:
        return False
    for lib in threadpool_info():
        if lib.get("user_api") != "blas" or lib.get("internal_api") != "openblas":
            continue
        try:
            dll = ctypes.CDLL(lib["filepath"])
        except OSError:
            continue
        found = {}
        for name, candidates in _SYMBOLS.items():
            for symbol in candidates:
                fn = getattr(dll, symbol, None)
                if fn is not None:
                    found[name] = ctypes.cast(fn, ctypes.c_void_p).value
                    break
        if len(found) == len(_SYMBOLS):
            for name, address in found.items():
                llvm.add_symbol(name, address)
            return True
    return False


def _openmp() -> bool:
    """Select numba's OpenMP layer unless NUMBA_THREADING_LAYER names another; whether it loads."""
    layer = os.environ.get("NUMBA_THREADING_LAYER", "")
    if layer and layer != "omp":
        return False
    # GNU OpenMP reads its spin count when numba's pool loads; the user's setting wins
    chosen = "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ
    if not chosen:
        os.environ["GOMP_SPINCOUNT"] = str(_SPINCOUNT)
    try:
        from numba.np.ufunc import omppool  # noqa: F401
    except ImportError:
        return False
    finally:
        if not chosen:
            del os.environ["GOMP_SPINCOUNT"]
    import numba
    numba.config.THREADING_LAYER = "omp"
    return True


_BOUND = _bind()
_PARALLEL = _openmp()
_forked: list = []  # set in a forked child: GNU OpenMP cannot run there
os.register_at_fork(after_in_child=lambda: _forked.append(True))

_I = types.int64
_SIG = (types.int32, types.int32, types.int32, _I, _I, _I)
_sgemm = types.ExternalFunction("minidl_sgemm", types.void(*_SIG, types.float32, types.voidptr, _I, types.voidptr,
                                                              _I, types.float32, types.voidptr, _I))
_dgemm = types.ExternalFunction("minidl_dgemm", types.void(*_SIG, types.float64, types.voidptr, _I, types.voidptr,
                                                              _I, types.float64, types.voidptr, _I))
_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)


def available() -> bool:
    """Whether the compiled GEMM is bound."""
    return _BOUND


def parallel() -> bool:
    """Whether compiled kernels may run OpenMP regions (not in a forked child)."""
    return _PARALLEL and not _forked


def workers() -> int:
    """Threads for a compiled kernel's region: the lanes' count, capped by numba's; 1 without regions."""
    n = lanes.count()
    if n == 1 or not parallel():
        return 1
    import numba
    return max(1, min(n, numba.config.NUMBA_NUM_THREADS))


@njit(**_OPTS)
def gemm(a, b, c, trans_a):
    """c = a @ b (a.T @ b with `trans_a`), C-contiguous: the call numpy's matmul makes."""
    m, n = c.shape
    k = b.shape[0]
    lda = a.shape[1]
    ta = _TRANS if trans_a else _NO_TRANS
    if a.itemsize == 4:
        _sgemm(_ROW_MAJOR, ta, _NO_TRANS, m, n, k, np.float32(1.0), a.ctypes.data, lda, b.ctypes.data, n,
               np.float32(0.0), c.ctypes.data, n)
    else:
        _dgemm(_ROW_MAJOR, ta, _NO_TRANS, m, n, k, np.float64(1.0), a.ctypes.data, lda, b.ctypes.data, n,
               np.float64(0.0), c.ctypes.data, n)


@njit(inline="always", **_OPTS)
def _ld(a):
    """BLAS's leading dimension: the row stride, at least the row length for one row."""
    return a.strides[0] // a.itemsize if a.shape[0] > 1 else max(1, a.shape[1])


@njit(**_OPTS)
def gemm_acc(a, b, c, trans_a, trans_b, accumulate):
    """c = op(a) @ op(b), or c += with `accumulate` (beta 1); unit column strides, rows at any stride."""
    m, n = c.shape
    k = a.shape[0] if trans_a else a.shape[1]
    ta = _TRANS if trans_a else _NO_TRANS
    tb = _TRANS if trans_b else _NO_TRANS
    if a.itemsize == 4:
        _sgemm(_ROW_MAJOR, ta, tb, m, n, k, np.float32(1.0), a.ctypes.data, _ld(a), b.ctypes.data, _ld(b),
               np.float32(1.0 if accumulate else 0.0), c.ctypes.data, _ld(c))
    else:
        _dgemm(_ROW_MAJOR, ta, tb, m, n, k, np.float64(1.0), a.ctypes.data, _ld(a), b.ctypes.data, _ld(b),
               np.float64(1.0 if accumulate else 0.0), c.ctypes.data, _ld(c))


@njit(**_OPTS)
def sum_products_nt(a, b, c, accumulate, r0, r1):
    """c[r0:r1] (+)= the sum over s, in order, of a[s, r0:r1] @ b[s].T, the first written unless `accumulate`."""
    for s in range(a.shape[0]):
        gemm_acc(a[s, r0:r1], b[s], c[r0:r1], False, True, accumulate or s > 0)


@njit(**_OPTS, parallel=True)
def sum_products_nt_pieces(a, b, c, accumulate, pieces, workers):
    """`sum_products_nt` over c's rows in the caller's `pieces` blocks, worker t taking t, t + workers, ..."""
    m = c.shape[0]
    for t in prange(workers):
        for q in range(t, pieces, workers):
            sum_products_nt(a, b, c, accumulate, m * q // pieces, m * (q + 1) // pieces)
