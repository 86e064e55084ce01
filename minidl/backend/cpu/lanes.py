"""Lanes: a convolution's samples split over host threads, with results that do not depend on the thread count.

Why. The convolutions of CIFAR-sized networks are sequences of small per-sample GEMMs ((16, 48) x (48, 1024) in
ResNet-56's first stage). OpenBLAS threads one such product poorly or not at all, so with two cores minidl ran
them as slowly as with one (ResNet-56 b32: 413 ms at 2 threads, 396 at 1, PyTorch 290 -> 175). Running disjoint
ranges of samples on separate threads keeps every core busy: numpy's GEMMs, copies and additions release the
GIL, so Python threads overlap them (measured on the 2-core VM: a (32, 16, 32, 32) row-shift forward 2.3 ->
1.4 ms).

Determinism is the contract: lanes split only work that no sum runs across (the samples of a forward, the
kernel rows of a weight gradient, the blocks of a product), and each lane computes exactly the products and sums
one thread would, in the same order. Where one product is split, its blocks are fixed by its shapes (`blocks`),
never by the lane count: a block of a product need not have the bits of the whole product (OpenBLAS's edge and
small-matrix kernels sum otherwise), so one lane runs the same blocks in turn. So the bits are the same with 1,
2 or 8 threads on any BLAS kernel (the suite checks two: tests/test_second_blas_kernel.py), and every memory
policy still gives the parameters of `none`.

The BLAS runs one thread per call (`blas_pinned`) during every step and convolution, at any lane count: each
lane's GEMMs are its own; OpenBLAS's own threads would cut a large product by their count (other bits), and
an OpenBLAS that also threads the lanes' products puts two threads per core in each other's way (measured:
ResNet-56 b32 at 2 threads, 437 ms per step with lanes over a 2-thread BLAS, 366 with lanes over a 1-thread
BLAS, 440 without lanes). threadpoolctl finds the BLAS numpy loaded and sets its threads through its C API
(~1 us a call).

How many lanes: `count()`, the CPU menu's `threads` while its backend runs a step (`using`, entered by
`CPUBackend.step_scope`), else the cores this process may run on (at most `MAX_LANES`).
`benchmarks/step_vs_torch.py --threads T` sets it to T, like PyTorch's and numpy's threads.
"""
from __future__ import annotations

import contextvars
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Callable, Sequence

import numpy as np

MAX_LANES = 8  # more threads split the samples of a batch-32 layer too finely to pay their dispatch

_pool: list = []  # [(workers, ThreadPoolExecutor)], created on first use
_blas: list = []  # [the BLAS libraries' threadpoolctl controllers], found on first use
_threads: list[int] = []  # the lanes `using` set, innermost last


def cores() -> int:
    """The cores this process may run on, capped at `MAX_LANES`: the lanes when no menu sets them."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(MAX_LANES, n))


def count() -> int:
    """The number of lanes: those `using` set (a CPU menu's threads while its backend runs a step), else the
    usable cores (`cores`)."""
    return _threads[-1] if _threads else cores()


@contextmanager
def using(threads: int | None):
    """Run on `threads` lanes inside the block (None: as outside it)."""
    if threads is None:
        yield
        return
    _threads.append(int(threads))
    try:
        yield
    finally:
        _threads.pop()


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` contiguous, nearly equal ranges covering range(n) (the first ones one longer)."""
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
        import numpy  # noqa: F401 - threadpoolctl finds only the libraries already loaded
        from threadpoolctl import ThreadpoolController
        _blas.append(ThreadpoolController().select(user_api="blas").lib_controllers)
    return _blas[0]


_depth = [0]  # 1 while a `blas_pinned` block is open (the executor's thread opens them; lanes never do)


def blas_pinned():
    """A context with the BLAS at one thread per call, then back to what it was; inside one already open, it
    does nothing (a check, no threadpoolctl call: a convolution's own block inside a step's costs nothing).
    The CPU backend opens one around every training or evaluation step (`CPUBackend.step_scope`), every
    convolution call (`cpu_conv._blas_scope`) and every product here (`matmul`), at any lane count.

    Why always, not only with several lanes: OpenBLAS's own threads cut a large product by their count, and a
    block of a product need not have the bits of the whole (see `blocks`), so with the BLAS's threads free,
    one lane would give other bits than two. Pinned, every product is the BLAS's one-thread call on operands
    fixed by the shapes, and the thread count never reaches the BLAS. It is also faster with lanes: OpenBLAS
    splits a small product over threads at a loss (measured ResNet-56 b32 at 2 threads: 381 ms per step with
    only the lanes' GEMMs pinned, 360 with every small convolution's), and its threads, once woken, spin for a
    long while on the cores that the lanes and the compiled kernels' threads need (measured: 316 -> 264 ms with
    the whole step pinned, the 64-channel backward 110 -> 29 ms; large products are split over the lanes
    instead, `matmul`)."""
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


_PIECE_MIN_MACS = 1 << 21  # each block of a cut product has at least this many multiply-adds (see `blocks`)
_PIECE_MIN_COLS = 16  # ... and at least this many columns (rows), its edges on multiples of `_PIECE_ALIGN`
_PIECE_ALIGN = 16
_MAX_PIECES = 2  # at most this many blocks (see `blocks`)


def blocks(m: int, n: int, k: int) -> tuple[int, list[tuple[int, int]]]:
    """How `matmul` cuts one (m, k) x (k, n) product: (axis, [start, end) blocks) of the output's columns
    (axis -1) or its rows (axis -2), whichever is longer (the other where it has too few); one block for a small
    product. Decided by the
    shapes alone, never by the thread count, so that every block is the same BLAS call however many lanes run
    them, and one lane runs them in turn.

    Why the shapes and not the lanes: OpenBLAS sums an element differently depending on where it falls in its
    kernel's tiles (edge and small-matrix kernels), so a block of a product does not in general have the bits
    of the whole product (seen on Haswell's kernels: (64, 576) x (576, 3136) cut in two by rows). Blocks fixed
    by the shapes give one set of bits on 1, 2 or 8 lanes whatever the kernel. The longer side: a column block
    re-packs all of A (m x k), a row block all of B (k x n), so the smaller operand is the one packed again
    (measured, (512, 4608) x (4608, 196) in four column blocks: 15 -> 20 ms on one thread).
    Each block has at least `_PIECE_MIN_MACS` multiply-adds (a hand-off to a lane costs 30-70 us), and there
    are at most `_MAX_PIECES` (2): one thread pays for every extra block (paired against the whole product on
    one thread, ResNet-50 shapes: +2-5% with two blocks, +3-9% with four), two lanes get even shares, and a
    stack of products still goes to every lane by samples."""
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
    """np.matmul(a, b, out=out) in the fixed blocks of `blocks` (the same for every matrix of a stack), over the
    lanes: a stack of products with one broadcast `a` by its leading axis (`_by_samples`), each share running
    every block of its matrices; else the blocks themselves, a lane taking blocks j, j + lanes, ... On a
    one-thread BLAS throughout (`blas_pinned`): OpenBLAS's own threads would cut a product by their count.

    Why not OpenBLAS's own threads: once woken they spin for a long while after the call, on the cores the
    compiled kernels' OpenMP workers need next (ResNet-50 b8 at 2 threads: batch norm 211 -> 108 ms and the
    64-channel Winograd backward 133 -> 63 ms per step with the products split here). Lanes block when idle.

    Bits: every block is one np.matmul call whose operands' shapes depend on the product's shapes only, and a
    stacked np.matmul runs one GEMM per matrix; so the result is the same on any number of lanes, for a stack
    or each of its matrices alone (im2col and im2col_chunked agree), on any BLAS kernel (tested under two)."""
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
    """Whether `matmul` splits a stacked product by its leading axis (the samples of a convolution: one weight
    `a`, broadcast, against each sample's matrix of `b`): np.matmul runs one GEMM per matrix of the stack, so
    a share of the stack computes exactly those GEMMs (each in the blocks of `blocks`), in any dtype and size.
    Measured at two lanes, ResNet-50's 1x1 products at batch 8: (64, 256) x (256, 3136) 6.9 -> 5.4-6.5 ms,
    (128, 512) x (512, 784) 5.4 -> 4.7, against splitting the rows. Only for stacks that share out evenly
    (or are long), and large enough for a hand-off to pay."""
    if out.ndim < 3 or b.ndim != out.ndim or b.shape[0] != out.shape[0]:
        return False
    if not (a.ndim < out.ndim or a.shape[0] == 1):
        return False
    stack = out.shape[0]
    parts = min(lanes, stack)
    return (stack >= 2 and stack * macs >= 2 * _PIECE_MIN_MACS
            and (stack % parts == 0 or stack >= 4 * parts))


def run(tasks: Sequence[Callable[[], None]]) -> None:
    """Run the tasks, the first on the calling thread and the others on the lane pool, with the BLAS at one
    thread; return when all are done, raising the first error (in task order). The tasks must touch disjoint
    memory."""
    if len(tasks) == 1:
        tasks[0]()
        return
    with blas_pinned():
        _run_lanes(tasks)


def _run_lanes(tasks: Sequence[Callable[[], None]]) -> None:
    pool = _executor(len(tasks) - 1)
    # each lane in a copy of the caller's context: numpy's error state (np.errstate) is a context variable, so
    # a lane computes under the caller's, as the first task does
    futures = [pool.submit(contextvars.copy_context().run, t) for t in tasks[1:]]
    first: BaseException | None = None
    try:
        tasks[0]()
    except BaseException as e:  # noqa: BLE001 - re-raised below, after the other lanes have finished
        first = e
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001
            first = first or e
    if first is not None:
        raise first
