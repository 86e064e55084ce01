"""Lanes: a convolution's samples split over host threads, the bits the same on any thread count and BLAS kernel.

Rules: a lane runs only work no sum crosses, each sum in one thread's order; a product is cut by its shapes
(`blocks`), never by the lane count; the BLAS runs one thread per call during a step (`blas_pinned`): its own
threads would cut by their count and spin on the lanes' cores (ResNet-56 b32, 2 threads: 316 -> 264 ms pinned).
"""
from __future__ import annotations

import contextvars
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Callable, Sequence

import numpy as np

MAX_LANES = 8  # more split a batch-32 layer too finely to pay their dispatch

_pool: list = []  # [(workers, executor)]
_blas: list = []
_threads: list[int] = []  # innermost last


def cores() -> int:
    """The cores this process may run on, at most `MAX_LANES`."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(MAX_LANES, n))


def count() -> int:
    """Lanes: those `using` set, else `cores()`."""
    return _threads[-1] if _threads else cores()


@contextmanager
def using(threads: int | None):
    """Run on `threads` lanes inside the block (None: unchanged)."""
    if threads is None:
        yield
        return
    _threads.append(int(threads))
    try:
        yield
    finally:
        _threads.pop()


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous [start, end) ranges covering range(n), the first ones one longer."""
    q, r = divmod(n, parts)
    out, s = [], 0
    for k in range(parts):
        e = s + q + (1 if k < r else 0)
        out.append((s, e))
        s = e
    return out


def _executor(workers: int) -> ThreadPoolExecutor:
    if not _pool or _pool[0][0] < workers:
        if _pool:
            _pool.pop()[1].shutdown(wait=True)
        _pool.append((workers, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="minidl-lane")))
    return _pool[0][1]


def _blas_controllers() -> list:
    if not _blas:
        import numpy  # noqa: F401 - threadpoolctl finds only loaded libraries
        from threadpoolctl import ThreadpoolController
        _blas.append(ThreadpoolController().select(user_api="blas").lib_controllers)
    return _blas[0]


_depth = [0]  # 1 inside `blas_pinned`


def blas_pinned():
    """The BLAS at one thread per call inside, restored after; a no-op inside one already open."""
    return nullcontext() if _depth[0] else _pin()


@contextmanager
def _pin():
    libs = _blas_controllers()
    before = [lib.get_num_threads() for lib in libs]
    for lib in libs:
        lib.set_num_threads(1)
    _depth[0] = 1
    try:
        yield
    finally:
        _depth[0] = 0
        for lib, n in zip(libs, before):
            lib.set_num_threads(n)


_PIECE_MIN_MACS = 1 << 21  # multiply-adds per block at least: a hand-off to a lane costs 30-70 us
_PIECE_MIN_COLS = 16  # columns (rows) per block at least
_PIECE_ALIGN = 16
_MAX_PIECES = 2  # one thread pays for each extra block (ResNet-50: +2-5% for 2, +3-9% for 4)


def blocks(m: int, n: int, k: int) -> tuple[int, list[tuple[int, int]]]:
    """(axis, [start, end) blocks) of an (m, k) x (k, n) product's output, along its longer side (the smaller operand
    is packed again)."""
    macs = m * n * k
    for axis, size in ((-1, n), (-2, m)) if n >= m else ((-2, m), (-1, n)):
        parts = min(_MAX_PIECES, macs // _PIECE_MIN_MACS, size // _PIECE_MIN_COLS)
        if parts >= 2:
            parts = 1 << (parts.bit_length() - 1)  # a power of two
            units = -(-size // _PIECE_ALIGN)
            edges = [min(size, e * _PIECE_ALIGN) for _, e in split(units, parts)]
            return axis, list(zip([0] + edges[:-1], edges))
    return -1, [(0, n)]


def matmul(a, b, out) -> None:
    """np.matmul(a, b, out=out) in `blocks`' blocks over the lanes, a stack by samples (`_by_samples`)."""
    m, n = out.shape[-2], out.shape[-1]
    k = a.shape[-1]
    axis, cuts = blocks(m, n, k)
    if axis == -1:
        pieces = [(a, b[..., :, c0:c1], (Ellipsis, slice(None), slice(c0, c1))) for c0, c1 in cuts]
    else:
        pieces = [(a[..., r0:r1, :], b, (Ellipsis, slice(r0, r1), slice(None))) for r0, r1 in cuts]
    lanes = count()
    with blas_pinned():
        if lanes > 1 and _by_samples(a, b, out, lanes, m * n * k):
            def share(s0: int, s1: int) -> None:
                for pa, pb, where in pieces:
                    np.matmul(pa, pb[s0:s1], out=out[s0:s1][where])
            parts = min(lanes, out.shape[0])
            run([lambda s0=s0, s1=s1: share(s0, s1) for s0, s1 in split(out.shape[0], parts)])
            return
        parts = min(lanes, len(pieces))

        def lane(j: int) -> None:
            for pa, pb, where in pieces[j::parts]:
                np.matmul(pa, pb, out=out[where])
        run([lambda j=j: lane(j) for j in range(parts)])


def _by_samples(a, b, out, lanes: int, macs: int) -> bool:
    """Whether `matmul` splits a stack with one broadcast `a` by samples (np.matmul: one GEMM per matrix), where it
    shares out evenly and pays (ResNet-50 1x1 at 2 lanes: 6.9 -> 5.4-6.5 ms)."""
    if out.ndim < 3 or b.ndim != out.ndim or b.shape[0] != out.shape[0]:
        return False
    if not (a.ndim < out.ndim or a.shape[0] == 1):
        return False
    stack = out.shape[0]
    parts = min(lanes, stack)
    return (stack >= 2 and stack * macs >= 2 * _PIECE_MIN_MACS
            and (stack % parts == 0 or stack >= 4 * parts))


def run(tasks: Sequence[Callable[[], None]]) -> None:
    """Run the tasks (disjoint memory), the first on this thread, the BLAS pinned; raise the first error."""
    if len(tasks) == 1:
        tasks[0]()
        return
    with blas_pinned():
        _run_lanes(tasks)


def _run_lanes(tasks: Sequence[Callable[[], None]]) -> None:
    pool = _executor(len(tasks) - 1)
    # the caller's context: np.errstate lives there
    futures = [pool.submit(contextvars.copy_context().run, t) for t in tasks[1:]]
    first: BaseException | None = None
    try:
        tasks[0]()
    except BaseException as e:  # noqa: BLE001 - re-raised below
        first = e
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001
            first = first or e
    if first is not None:
        raise first
