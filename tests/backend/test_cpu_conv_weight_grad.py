"""The im2col family's weight gradient compiled (`cpu.conv._sum_weight_grad`, `cpu.gemm_jit.sum_products_nt`):
each sample's product added by the BLAS into dW, dW's rows in fixed blocks. Every algorithm of a layer
(gemm_1x1, im2col, im2col_chunked) and every thread count gives the same bits, which match PyTorch; the numpy
path (prod + add, where numba is missing) computes the same convolution."""
from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from minidl.backend.cpu import conv as cpu_conv
from minidl.backend.cpu import gemm_jit as cpu_gemm_jit
from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.cpu.conv import ConvGeometry

from .conv_checks import assert_same_bits_then_torch

needs_compiled = pytest.mark.skipif(not cpu_conv._compiled_weight_grad(
    ConvGeometry(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, (1, 1), (0, 0), (1, 1)), np.float32),
    reason="numba or the compiled GEMM is not available")

CONFIGS = [  # n, cin, h, w, cout, k, stride, padding
    (4, 256, 7, 7, 512, 1, 1, 0),     # a 1x1 at 7x7: two row blocks (512 * 256 * 49 multiply-adds a sample)
    (3, 64, 15, 14, 96, 1, 2, 0),     # a strided 1x1 (im2col), one block
    (4, 128, 16, 16, 256, 1, 2, 0),   # a strided 1x1, two blocks
    (2, 3, 23, 21, 64, 7, 2, 3),      # a 7x7 stem (im2col)
    (5, 48, 9, 9, 40, 1, 1, 0),       # small: one block, odd row count
]


def _run(cfg, dtype, algo):
    n, cin, h, w, cout, k, s, p = cfg
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, cin, h, w)).astype(dtype)
    wt = rng.standard_normal((cout, cin, k, k)).astype(dtype)
    ho, wo = cpu_conv.conv_output_hw((h, w), (k, k), (s, s), (p, p), (1, 1))
    dy = rng.standard_normal((n, cout, ho, wo)).astype(dtype)
    be = CPUBackend()
    opts = {o.algo: o.workspace_bytes for o in be.conv_workspace_options("bwd", x.shape, wt.shape, dy.shape, (s, s),
                                                                         (p, p), (1, 1), 1, dtype)}
    ws = np.full(opts[algo], 0xFF, np.uint8)  # garbage: nothing may read what it did not write
    dx, dw = np.empty_like(x), np.full_like(wt, np.nan)
    be.conv2d_backward(x, wt, dy, dx, dw, None, (s, s), (p, p), (1, 1), 1, algo, ws)
    y = np.empty_like(dy)
    fwd = {o.algo: o.workspace_bytes for o in be.conv_workspace_options("fwd", x.shape, wt.shape, dy.shape, (s, s),
                                                                        (p, p), (1, 1), 1, dtype)}
    be.conv2d_forward(x, wt, None, y, (s, s), (p, p), (1, 1), 1, algo, np.full(fwd[algo], 0xFF, np.uint8))
    return (x, wt, dy), (y, dx, dw), list(opts)


@pytest.mark.bits
@needs_compiled
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_same_bits_on_any_threads_and_algorithm(cfg, dtype, monkeypatch, lanes):
    """(The BLAS at one thread, as the lanes keep it: left at its own threads, OpenBLAS's float64 forward can
    round otherwise, which is not what this tests.)"""
    results = {}
    algos = _run(cfg, dtype, "im2col")[2]
    assert "im2col" in algos and ("gemm_1x1" in algos) == (cfg[5] == 1 and cfg[6] == 1)
    with threadpool_limits(1, user_api="blas"):
        for threads in (1, 2, 3):
            lanes(threads)
            monkeypatch.setattr(cpu_gemm_jit, "workers", lambda t=threads: t)
            for algo in algos:
                inputs, results[threads, algo], _ = _run(cfg, dtype, algo)
    n, cin, h, w, cout, k, s, p = cfg
    assert_same_bits_then_torch(results, inputs, (s, s), (p, p), tol=1e-3 if dtype == np.float32 else 1e-10)


def test_row_blocks_are_fixed_by_the_shapes():
    g = ConvGeometry(8, 512, 7, 7, 2048, 1, 1, 7, 7, 1, (1, 1), (0, 0), (1, 1))
    assert cpu_conv.weight_grad_pieces(g) == 2
    small = ConvGeometry(8, 16, 16, 16, 32, 1, 1, 8, 8, 1, (2, 2), (0, 0), (1, 1))
    assert cpu_conv.weight_grad_pieces(small) == 1


@needs_compiled
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=str)
def test_the_numpy_path_computes_the_same_convolution(cfg, monkeypatch):
    """Without numba the samples' products go through a scratch and an add: the same convolution, other
    rounding (here float64, to 1e-12)."""
    compiled = _run(cfg, np.float64, "im2col")[1]
    monkeypatch.setattr(cpu_conv, "_compiled_weight_grad", lambda g, dtype: False)
    numpy_path = _run(cfg, np.float64, "im2col")[1]
    for a, b in zip(compiled, numpy_path):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


GROUPED = [(5, 128, 14, 14, 64, 3, 2, 1), (4, 128, 7, 7, 96, 3, 1, 1)]  # `im2col_grouped` (columns side by side)


@pytest.mark.bits
@pytest.mark.parametrize("lanes_n", [2, 3])
@pytest.mark.parametrize("cfg", CONFIGS[1:4] + GROUPED, ids=str)
def test_im2col_split_over_lanes_gives_the_same_bits(cfg, lanes_n, monkeypatch, lanes):
    """A multi-sample im2col and col2im split over the lanes (a share of the samples each; here every size is
    split) build the very columns, and sum the very dx, of the whole-batch pass: y, dx and dW as unsplit."""
    lanes(lanes_n)
    monkeypatch.setattr(cpu_conv, "_IM2COL_SPLIT_MIN", 10**12)
    algo = "im2col_grouped" if cfg in GROUPED else "im2col"
    inputs, whole, algos = _run(cfg, np.float32, algo)
    assert algo in algos
    monkeypatch.setattr(cpu_conv, "_IM2COL_SPLIT_MIN", 1)
    calls, back = [], []
    real, real_back = cpu_conv._im2col_part, cpu_conv._col2im_part
    monkeypatch.setattr(cpu_conv, "_im2col_part", lambda *a: (calls.append(a[0].shape[0]), real(*a)))
    monkeypatch.setattr(cpu_conv, "_col2im_part", lambda *a: (back.append(a[1].shape[0]), real_back(*a)))
    split = _run(cfg, np.float32, algo)[1]
    assert len(calls) >= 2 and sum(calls) % cfg[0] == 0  # the samples went out in shares
    assert len(back) >= 2 and sum(back) % cfg[0] == 0
    for a, b in zip(whole, split):
        assert a.tobytes() == b.tobytes()
