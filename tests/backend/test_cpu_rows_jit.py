"""The row-shift convolution's compiled path (`cpu.rows_jit`): its strided GEMM, its rows, and the bits, which
must not depend on the threads, the algorithm (`rows` or `rows_chunked`) or the workers' slots."""
import os

import numpy as np
import pytest

from minidl.backend.cpu import conv as cpu_conv
from minidl.backend.cpu import jit as cpu_jit
from minidl.backend.cpu import lanes as cpu_lanes
from minidl.backend.cpu.conv import ConvGeometry, _RowShift

from .conv_checks import assert_same_bits_then_torch

rows_jit = cpu_conv.rows_jit()
needs_compiled = pytest.mark.skipif(not cpu_conv._compiled_rows(),
                                    reason="numba or numpy's 64-bit OpenBLAS is missing: the numpy path runs")


@needs_compiled
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_acc_is_the_blas_product_on_windows(dtype):
    """Writing, accumulating, with either operand transposed, on windows of a larger buffer (row stride larger
    than the row) and one-row arrays: the product numpy computes (to rounding where it accumulates)."""
    gemm = cpu_jit.gemm_kernels()
    rng = np.random.default_rng(2)
    buf = rng.standard_normal((48, 1100)).astype(dtype)
    win = buf[:, 38:38 + 1024]
    a = rng.standard_normal((16, 48)).astype(dtype)
    dy = rng.standard_normal((16, 1024)).astype(dtype)
    with cpu_lanes.blas_pinned():
        c = np.full((16, 1024), np.nan, dtype)
        gemm.gemm_acc(a, win, c, False, False, False)
        assert np.array_equal(c, a @ win)
        before = c.copy()
        gemm.gemm_acc(a, win, c, False, False, True)
        np.testing.assert_allclose(c, 2 * before, rtol=1e-6)
        o = np.full((48, 16), np.nan, dtype)
        gemm.gemm_acc(win, dy, o, False, True, False)
        ref = np.empty((48, 16), dtype)
        np.matmul(dy, win.T, out=ref.T)  # the call the numpy path makes
        assert np.array_equal(o, ref)
        out = np.zeros((48, 1024), dtype)
        gemm.gemm_acc(a, dy, out, True, False, True)
        np.testing.assert_allclose(out, a.T @ dy, rtol=1e-5, atol=1e-5)
        one = np.full((1, 1024), np.nan, dtype)
        gemm.gemm_acc(a[3:4], win, one, False, False, False)
        np.testing.assert_allclose(one, a[3:4] @ win, rtol=1e-5, atol=1e-5)  # numpy runs a GEMV here


# (N, Cin, H, W, Cout, stride, padding, dilation): CIFAR's 16-channel 3x3, its stride-2 downsampling, odd batches
# (halves of 2 and 3 samples), one sample, non-square planes, padding beyond the kernel's reach (the input
# gradient then runs by the rows' gradient at stride 1 too), column stride 2, dilation 2
CONFIGS = [(4, 16, 12, 12, 16, (1, 1), (1, 1), (1, 1)), (5, 8, 11, 9, 12, (2, 2), (1, 1), (1, 1)),
           (1, 4, 6, 6, 4, (1, 1), (1, 1), (1, 1)), (3, 6, 7, 10, 5, (1, 1), (3, 0), (1, 1)),
           (7, 5, 9, 8, 6, (1, 2), (1, 1), (1, 1)), (6, 4, 11, 11, 3, (1, 1), (2, 2), (2, 2)),
           (2, 3, 8, 8, 4, (2, 2), (0, 1), (1, 1))]


def _run(cfg, dtype, algo):
    n, cin, h, w, cout, stride, pad, dil = cfg
    ho, wo = cpu_conv.conv_output_hw((h, w), (3, 3), stride, pad, dil)
    g = ConvGeometry(n, cin, h, w, cout, 3, 3, ho, wo, 1, stride, pad, dil)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((n, cin, h, w)).astype(dtype)
    wt = rng.standard_normal((cout, cin, 3, 3)).astype(dtype)
    dy = rng.standard_normal((n, cout, ho, wo)).astype(dtype)
    rs = _RowShift(g, algo, x.dtype.itemsize)
    y, dx, dw = np.empty((n, cout, ho, wo), dtype), np.empty_like(x), np.empty_like(wt)
    # workspaces of exactly the declared size, filled with garbage: nothing may read what it did not write
    rs.forward(x, wt, y, np.full(rs.total("fwd"), 0xFF, np.uint8))
    rs.backward(x, wt, dy, dx, dw, np.full(rs.total("bwd"), 0xFF, np.uint8))
    return (x, wt, dy), (y, dx, dw)


@pytest.mark.bits
@needs_compiled
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_same_bits_on_any_threads_and_algorithm(cfg, dtype, monkeypatch, lanes):
    """1, 2, 3 or 5 threads, `rows` or `rows_chunked`: the same y, dx and dW, bit for bit, and PyTorch's
    convolution and gradients (in float64). Small layers are split too here (by default they stay on one
    thread, `cpu.jit.workers_for`)."""
    monkeypatch.setattr(cpu_conv, "workers_for", lambda values: cpu_jit.gemm_kernels().workers())
    results = {}
    for threads in (1, 2, 3, 5):
        lanes(threads)
        for algo in cpu_conv.ROW_ALGOS:
            inputs, results[threads, algo] = _run(cfg, dtype, algo)
    _, _, _, _, _, stride, pad, dil = cfg
    assert_same_bits_then_torch(results, inputs, stride, pad, dil, tol=1e-4 if dtype == np.float32 else 1e-10)


@needs_compiled
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=str)
def test_the_numpy_path_computes_the_same_convolution(cfg, monkeypatch, lanes):
    """Where numba is missing the numpy path runs: the same convolution (another summation order: its weight
    gradient sums the samples in one sequence, not two halves), still the same on every thread count."""
    compiled = _run(cfg, np.float64, "rows")[1]
    monkeypatch.setattr(cpu_conv, "_compiled_rows", lambda: False)
    per_threads = []
    for threads in (1, 2):
        lanes(threads)
        per_threads.append(_run(cfg, np.float64, "rows")[1])
    for a, b, c in zip(compiled, *per_threads):
        assert np.array_equal(b, c)
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@needs_compiled
def test_rows_and_their_scatter_match_the_numpy_copies():
    """The compiled rows of one sample are numpy's (`_RowShift.im2rows`), at stride 1 and 2 (rows stored
    phase by phase), and `rows2im` adds them back as `_RowShift.rows2im` does."""
    for cfg in CONFIGS:
        n, cin, h, w, cout, stride, pad, dil = cfg
        ho, wo = cpu_conv.conv_output_hw((h, w), (3, 3), stride, pad, dil)
        rs = _RowShift(ConvGeometry(n, cin, h, w, cout, 3, 3, ho, wo, 1, stride, pad, dil), "rows", 4)
        x = np.random.default_rng(1).standard_normal((n, cin, h, w)).astype(np.float32)
        ref = np.full((n, cin, 3, rs.hp, wo), np.nan, np.float32)
        rs.im2rows(x, ref)
        got = np.full_like(ref, np.nan)
        for k in range(n):
            rows_jit.im2rows(x[k], got[k], rs.row_src, rs.col_runs, stride[1])
        assert np.array_equal(got, ref), cfg
        back_ref, back = np.full_like(x, np.nan), np.full_like(x, np.nan)
        rs.rows2im(ref.copy(), back_ref)
        for k in range(n):
            rows_jit.rows2im(got[k], back[k], rs.row_src, rs.col_runs, stride[1])
        assert np.array_equal(back, back_ref), cfg


@needs_compiled
def test_weight_gradient_wants_a_contiguous_dw():
    """dW's memory holds the second half-batch's sum until the end, so a strided dW is refused, by name."""
    g = ConvGeometry(4, 3, 6, 6, 5, 3, 3, 6, 6, 1, (1, 1), (1, 1), (1, 1))
    rs = _RowShift(g, "rows", 4)
    x = np.ones((4, 3, 6, 6), np.float32)
    dw = np.zeros((3, 5, 3, 3), np.float32).transpose(1, 0, 2, 3)
    with pytest.raises(ValueError, match=r"conv2d backward \(rows\): dw must be a C-contiguous float32 array"):
        rs.backward(x, np.ones((5, 3, 3, 3), np.float32), np.ones((4, 5, 6, 6), np.float32), None, dw,
                    np.zeros(rs.total("bwd"), np.uint8))


@needs_compiled
def test_a_forked_child_runs_the_rows_on_one_thread(monkeypatch, lanes):
    """GNU OpenMP does not survive a fork: a child runs the compiled kernels on one thread, with the same bits."""
    lanes(2)
    monkeypatch.setattr(cpu_conv, "workers_for", lambda values: cpu_jit.gemm_kernels().workers())
    ref = _run(CONFIGS[1], np.float32, "rows")[1]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        ok = all(np.array_equal(a, b) for a, b in zip(_run(CONFIGS[1], np.float32, "rows")[1], ref))
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1" and status == 0
