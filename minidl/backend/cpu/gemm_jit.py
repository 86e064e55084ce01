"""numpy's own BLAS GEMM, callable from compiled (numba) kernels, and those kernels' threads.

Why. A Winograd layer's 16 GEMMs are small ((256, 32) x (32, 32) in CIFAR ResNet-56): OpenBLAS does not
thread one of them, and Python threads cannot split them, since handing work to a thread costs 30-70 us here
(measured), about one GEMM group. Inside a numba kernel compiled with `parallel=True` the same hand-off is one
OpenMP region, ~3 us, with no GIL: two threads then run positions 0, 2, 4, ... and 1, 3, 5, ... side by side.
That needs the GEMM callable from compiled code. numba's own `np.dot` would call scipy's BLAS, another
library (with other rounding than numpy's `matmul`) and another dependency; instead this module resolves the
`cblas_?gemm` of the BLAS numpy itself loaded (found by threadpoolctl) and registers its address under a
fixed name (`minidl_sgemm`, `minidl_dgemm`) with LLVM before any kernel is compiled or loaded from numba's
cache. The kernels refer to the name, not the address, so they can still be cached.

Bits. `gemm` makes exactly the call numpy's `matmul` makes for C-contiguous float32/float64 operands (row-major
`cblas_?gemm`, alpha 1, beta 0; a transposed first operand as `CblasTrans`), and the BLAS runs one thread per
call here (`cpu_lanes.blas_pinned`), so each product has the bits `np.matmul` gives it at one thread, whichever
thread runs it (tested against `np.matmul`).

Beside `gemm` (the Winograd kernels' call), `gemm_acc` takes strided windows, either operand transposed and an
accumulating beta of 1 (the row-shift kernels, `cpu_rows_jit`: the BLAS adds a product to its output as it sums
it, so no scratch product and no separate addition); `sum_products_nt` runs such sums for the im2col family.

Where it is not offered (`available()` False): numpy built against another BLAS than the 64-bit-integer
OpenBLAS of its wheels; then the Winograd kernels run on one thread with `np.matmul`. Where numba's OpenMP
layer does not load (`parallel()` False; its fallback layer costs ~90 us a region, measured), every compiled
kernel runs on one thread. `workers()` says how many threads the compiled kernels use: batch norm splits its
channels over them too (`cpu_norm_jit`).
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
from numba import prange, types

from ...core.jit_cache import njit
from . import lanes

_SYMBOLS = {"minidl_sgemm": ("scipy_cblas_sgemm64_", "cblas_sgemm64_"),
            "minidl_dgemm": ("scipy_cblas_dgemm64_", "cblas_dgemm64_")}  # 64-bit integer interfaces only
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_SPINCOUNT = 10_000  # GNU OpenMP's busy-wait after a region, in spins (see `_openmp`)


def _bind() -> bool:
    """Register numpy's BLAS GEMMs with LLVM under the names the kernels use; False if not found."""
    try:
        import numpy  # noqa: F401 - threadpoolctl finds only the libraries already loaded
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
    """Select numba's OpenMP threading layer (unless the user chose one with NUMBA_THREADING_LAYER) and say
    whether it loads: the only one whose region costs microseconds here."""
    layer = os.environ.get("NUMBA_THREADING_LAYER", "")
    if layer and layer != "omp":
        return False
    # GNU OpenMP reads its spin time when it loads, which importing numba's pool does. Its default (~300,000
    # spins) keeps the idle worker busy for about a millisecond after each region, on the core that the
    # convolution lanes (Python threads) and the BLAS need next; a short spin lets it sleep after ~10 us.
    # Measured, CIFAR ResNet-56 b32 at 2 threads: ~288 ms per step at the default, ~231 at 3,000-10,000 spins,
    # ~263 at 30,000, ~313 at 100,000 (and worse again at 1,000, where it sleeps between a call's regions).
    # Set for that import only, unless the user chose a policy: a library loaded before keeps its own setting.
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
_forked: list = []  # set in a forked child: GNU OpenMP cannot run there (numba would stop the process)
os.register_at_fork(after_in_child=lambda: _forked.append(True))

_I = types.int64
_SIG = (types.int32, types.int32, types.int32, _I, _I, _I)
_sgemm = types.ExternalFunction("minidl_sgemm", types.void(*_SIG, types.float32, types.voidptr, _I, types.voidptr,
                                                              _I, types.float32, types.voidptr, _I))
_dgemm = types.ExternalFunction("minidl_dgemm", types.void(*_SIG, types.float64, types.voidptr, _I, types.voidptr,
                                                              _I, types.float64, types.voidptr, _I))
_OPTS = dict(cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False)


def available() -> bool:
    """Whether the compiled GEMM is bound (and so whether the Winograd kernels use it, on any thread count)."""
    return _BOUND


def parallel() -> bool:
    """Whether compiled kernels may run OpenMP regions: numba's OpenMP layer loads, and this is not a forked
    child (GNU OpenMP's threads do not survive a fork; there the kernels run on one thread)."""
    return _PARALLEL and not _forked


def workers() -> int:
    """How many threads a compiled kernel with an OpenMP region may use: the lanes' count (`cpu_lanes.count`,
    the CPU menu's threads or the usable cores) capped by numba's threads; 1 where regions cannot run. The kernels
    split only work no sum runs across, so their bits never depend on it."""
    n = lanes.count()
    if n == 1 or not parallel():
        return 1
    import numba
    return max(1, min(n, numba.config.NUMBA_NUM_THREADS))


@njit(**_OPTS)
def gemm(a, b, c, trans_a):
    """c = a @ b (c = a.T @ b with `trans_a`): C-contiguous 2-D arrays of one float type, c (m, n) with m, n
    the rows of a (its columns with `trans_a`) and the columns of b. The call numpy's matmul makes."""
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
    """The leading dimension BLAS gets for a 2-D array with unit column stride: its row stride in elements
    (a one-row array's row stride is arbitrary in numpy, and BLAS wants it at least the row's length)."""
    return a.strides[0] // a.itemsize if a.shape[0] > 1 else max(1, a.shape[1])


@njit(**_OPTS)
def gemm_acc(a, b, c, trans_a, trans_b, accumulate):
    """c = op(a) @ op(b), or c += op(a) @ op(b) with `accumulate` (the BLAS's beta = 1: it adds each product,
    as it sums it, to c); op(a) is a.T with `trans_a`, op(b) b.T with `trans_b`. 2-D arrays of one float type
    with unit column strides, rows at any stride (a window of a larger buffer): the row-shift convolution's
    products (`cpu_rows_jit`)."""
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
    """c[r0:r1] (+)= the sum over s, in order, of a[s, r0:r1] @ b[s].T: each product added by the BLAS as it sums
    it (beta = 1), the first written unless `accumulate`. a (n, m, k), b (n, p, k) and c (m, p), unit column
    strides: an im2col-family weight gradient (`cpu_conv`), sample by sample, for one block of its rows."""
    for s in range(a.shape[0]):
        gemm_acc(a[s, r0:r1], b[s], c[r0:r1], False, True, accumulate or s > 0)


@njit(**_OPTS, parallel=True)
def sum_products_nt_pieces(a, b, c, accumulate, pieces, workers):
    """`sum_products_nt` over the whole of c, its rows cut into `pieces` fixed blocks, run on `workers` threads
    (one OpenMP region; worker t takes pieces t, t + workers, ...). The pieces are fixed by the caller from the
    shapes, so the bits never depend on the threads."""
    m = c.shape[0]
    for t in prange(workers):
        for q in range(t, pieces, workers):
            sum_products_nt(a, b, c, accumulate, m * q // pieces, m * (q + 1) // pieces)
