"""Winograd on several threads (`cpu.gemm_jit`, `cpu.winograd_jit`'s compiled path): numpy's own GEMM called
from compiled code, the workers' shares and scratch slots, and the bits, which must not depend on any of it."""
import numpy as np
import pytest

from minidl.backend.cpu import jit as cpu_jit
from minidl.backend.cpu import lanes as cpu_lanes
from minidl.backend.cpu import winograd as cpu_winograd
from minidl.backend.cpu.conv import ConvGeometry

gemm_jit = cpu_winograd.gemm_jit()
needs_gemm = pytest.mark.skipif(gemm_jit is None or not gemm_jit.available(),
                                reason="numpy's BLAS is not the 64-bit OpenBLAS of its wheels")


@needs_gemm
@pytest.mark.bits
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mkn", [(256, 32, 32), (37, 19, 45), (2, 64, 3), (512, 64, 64)])
def test_compiled_gemm_gives_the_bits_of_matmul(dtype, mkn):
    """The call numpy's matmul makes for matrices, so its bits, plain and with the first operand transposed,
    for the whole product and for blocks of its rows down to two (the forward's pieces; a block need not have
    the bits of the whole product's rows, so the pieces are fixed by the shapes). A single row numpy runs as a
    matrix-vector product, another BLAS call."""
    m, k, n = mkn
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    c = np.full((m, n), np.nan, dtype)
    with cpu_lanes.blas_pinned():
        gemm_jit.gemm(a, b, c, False)
        assert np.array_equal(c, a @ b)
        v, dm = rng.standard_normal((300, m)).astype(dtype), rng.standard_normal((300, n)).astype(dtype)
        gemm_jit.gemm(v, dm, c, True)
        assert np.array_equal(c, np.matmul(v.T, dm))
        for rows in (slice(m // 3, m), slice(m - 2, m), slice(0, 2)):
            part = np.full((rows.stop - rows.start, n), np.nan, dtype)
            gemm_jit.gemm(a[rows], b, part, False)
            assert np.array_equal(part, a[rows] @ b)


# (N, Cin, H, W, Cout, padding): no padding, padding 2, channel blocks cut short, a 2x2 image (one group each);
# several groups with a short last one and odd halves (4 + 4 + 3 samples of 7 tile rows; 3 + 2 of 5), and the
# shapes of CIFAR ResNet-56's two Winograd stages (8 and 4 groups)
SHAPES = [(10, 33, 7, 9, 40, 0), (5, 33, 7, 9, 40, 1), (3, 40, 6, 5, 35, 2), (2, 48, 2, 2, 32, 1),
          (11, 33, 13, 11, 40, 1), (5, 130, 9, 9, 40, 1), (32, 32, 16, 16, 32, 1), (32, 64, 8, 8, 64, 1)]


def _geometry(shape):
    n, c, h, w, co, p = shape
    return ConvGeometry(n, c, h, w, co, 3, 3, h + 2 * p - 2, w + 2 * p - 2, 1, (1, 1), (p, p), (1, 1))


def _run(shape, dtype, by_position=False):
    n, c, h, w, co, p = shape
    g = _geometry(shape)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((co, c, 3, 3)).astype(dtype)
    dy = rng.standard_normal((n, co, g.ho, g.wo)).astype(dtype)
    wg = cpu_winograd._Winograd(g, x.dtype.itemsize, by_position=by_position)
    y, dx, dw = np.empty((n, co, g.ho, g.wo), dtype), np.empty_like(x), np.empty_like(wt)
    # workspaces of exactly the declared size, filled with garbage: the slots must not read what they did not write
    wg.forward(x, wt, y, np.full(wg.total("fwd"), 0xFF, np.uint8))
    wg.backward(x, wt, dy, dx, dw, np.full(wg.total("bwd"), 0xFF, np.uint8))
    return y, dx, dw


@pytest.mark.bits
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_same_bits_on_any_threads_path_and_variant(shape, dtype, monkeypatch, lanes):
    """1, 2, 3 or 5 threads, the compiled path or the numpy one, the whole-tile variant or the by-position one:
    the same y, dx and dW, bit for bit (the planner may mix them, the machine decides the threads). Small
    layers are split too here (they run on one thread by default, `cpu.jit.workers_for`)."""
    monkeypatch.setattr(cpu_jit, "PARALLEL_MIN", 0)
    results = {}
    for threads in (1, 2, 3, 5):
        lanes(threads)
        if gemm_jit is not None and gemm_jit.parallel():
            assert cpu_winograd.workers(1) == min(threads, gemm_jit.workers())  # split, even this small
        results[threads] = _run(shape, dtype)
    lanes(2)
    results["by position"] = _run(shape, dtype, by_position=True)
    for key, got in results.items():
        for a, b, name in zip(got, results[1], ("y", "dx", "dW")):
            assert np.array_equal(a, b), (key, name)
    # Where numpy's GEMM is not bound for compiled code (decided once per process), both variants run numpy's
    # matmul and sum dU's groups in one sequence rather than two halves: the same bits as each other, and y, dx
    # (no sum over tiles there) as the compiled path's; dW to rounding, or to the bit with a single group.
    monkeypatch.setattr(cpu_winograd, "_compiled_gemm", lambda: False)
    numpy_path = _run(shape, dtype), _run(shape, dtype, by_position=True)
    groups = cpu_winograd._Winograd(_geometry(shape), np.dtype(dtype).itemsize).groups
    for got in numpy_path:
        for a, b, c, name in zip(got, numpy_path[0], results[1], ("y", "dx", "dW")):
            assert np.array_equal(a, b), ("numpy by position", name)
            if name != "dW" or groups == 1:
                assert np.array_equal(a, c), ("numpy", name)
            else:
                np.testing.assert_allclose(a, c, rtol=1e-4 if dtype == np.float32 else 1e-12,
                                           atol=1e-3 if dtype == np.float32 else 1e-10)


def test_workers_follow_the_lanes(monkeypatch, lanes):
    lanes(1)
    assert cpu_winograd.workers() == 1
    lanes(2)
    parallel = gemm_jit is not None and gemm_jit.available() and gemm_jit.parallel()
    assert cpu_winograd.workers() == (2 if parallel else 1)
    assert cpu_winograd.workers(cpu_jit.PARALLEL_MIN - 1) == 1  # a small layer: one thread
    assert cpu_winograd.workers(10**6, cpu_winograd.MAX_SPLIT_CHANNELS + 16) == 1  # rows not split beyond 256
    monkeypatch.setattr(cpu_winograd, "_compiled_gemm", lambda: False)
    assert cpu_winograd.workers() == 1


def test_slots_lie_in_dead_memory_and_fit_two_workers():
    """A worker's slot: its input block (the larger) and 256 values. The forward's slots lie from the transposed
    weight on, the weight gradient's from the product buffer on; for ResNet shapes at least two fit, and for a
    plane too large for two, fewer workers run (the workspace never grows for threads)."""
    g = ConvGeometry(32, 32, 16, 16, 32, 3, 3, 16, 16, 1, (1, 1), (1, 1), (1, 1))
    wg = cpu_winograd._Winograd(g, 4)
    ws = np.zeros(wg.total("bwd"), np.uint8)
    per = 18 * 18 * 16 + 256
    slots = wg._slots(ws, np.dtype(np.float32), wg.fwd_layout["wt"][0], wg.fwd_total, 8)
    assert slots.shape == (min(8, (wg.fwd_total - wg.fwd_layout["wt"][0]) // (4 * per)), per)
    assert len(slots) >= 2
    assert len(wg._slots(ws, np.dtype(np.float32), wg.dw_layout["prod"][0], wg.dw_total, 2)) == 2
    for n, c, hw in [(8, 64, 56), (8, 128, 28), (8, 256, 14)]:  # ResNet-50's 3x3 stride-1 shapes
        big = cpu_winograd._Winograd(ConvGeometry(n, c, hw, hw, c, 3, 3, hw, hw, 1, (1, 1), (1, 1), (1, 1)), 4)
        wsb = np.zeros(big.total("bwd"), np.uint8)
        assert len(big._slots(wsb, np.dtype(np.float32), big.fwd_layout["wt"][0], big.fwd_total, 2)) == 2
    huge = cpu_winograd._Winograd(ConvGeometry(1, 32, 600, 600, 32, 3, 3, 600, 600, 1, (1, 1), (1, 1), (1, 1)), 4)
    wsh = np.zeros(huge.total("fwd"), np.uint8)
    assert len(huge._slots(wsh, np.dtype(np.float32), huge.fwd_layout["wt"][0], huge.fwd_total, 2)) == 1


@pytest.mark.bits
def test_a_forked_child_runs_winograd_on_one_thread(monkeypatch, lanes):
    """GNU OpenMP's threads do not survive a fork (numba stops a child that starts a region): a child falls back
    to one thread, with the same bits."""
    import os
    lanes(2)
    monkeypatch.setattr(cpu_jit, "PARALLEL_MIN", 0)
    ref = _run(SHAPES[0], np.float32)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        ok = cpu_winograd.workers() == 1 and all(np.array_equal(a, b) for a, b in zip(_run(SHAPES[0], np.float32),
                                                                                      ref))
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1" and status == 0
