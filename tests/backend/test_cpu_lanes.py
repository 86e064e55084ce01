"""Convolution lanes (`cpu.lanes`): samples split over threads, with the same bits whatever the thread count."""
import threading

import numpy as np
import pytest

from minidl.backend.cpu import conv as cpu_conv
from minidl.backend.cpu import lanes as cpu_lanes
from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.cpu.menu import CPUMenu

from .conv_checks import assert_same_bits_then_torch


def test_split_covers_the_range_in_order():
    for n in range(0, 12):
        for parts in range(1, 5):
            ranges = cpu_lanes.split(n, parts)
            assert len(ranges) == parts
            assert [i for a, b in ranges for i in range(a, b)] == list(range(n))
            sizes = [b - a for a, b in ranges]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_count_is_the_menus_threads_inside_a_step_else_the_cores():
    assert cpu_lanes.count() == cpu_lanes.cores() and 1 <= cpu_lanes.cores() <= cpu_lanes.MAX_LANES
    with cpu_lanes.using(3):
        assert cpu_lanes.count() == 3
        with cpu_lanes.using(None):
            assert cpu_lanes.count() == 3
    assert cpu_lanes.count() == cpu_lanes.cores()
    seen = []
    with CPUBackend(CPUMenu(threads=3)).step_scope():
        seen.append(cpu_lanes.count())
    assert seen == [3] and cpu_lanes.count() == cpu_lanes.cores()
    for bad in (0, -2, "two", 1.5):
        with pytest.raises(ValueError, match=f"--threads must be a positive integer, got {bad!r}"):
            CPUMenu(threads=bad)


def test_run_uses_threads_and_raises_the_first_error():
    seen, lock = [], threading.Lock()

    def task(k):
        def run():
            with lock:
                seen.append((k, threading.current_thread().name))
        return run
    cpu_lanes.run([task(k) for k in range(3)])
    assert sorted(k for k, _ in seen) == [0, 1, 2]
    assert dict(seen)[0] == threading.current_thread().name  # the first task runs on the caller's thread
    assert all(name.startswith("minidl-lane") for k, name in seen if k)

    done = []

    def fail(msg):
        def run():
            raise RuntimeError(msg)
        return run
    with pytest.raises(RuntimeError, match="lane 1"):
        cpu_lanes.run([lambda: done.append(0), fail("lane 1"), fail("lane 2")])
    assert done == [0]  # the other lanes ran to their end before the error was raised


def test_blas_pinned_restores_the_threads():
    libs = cpu_lanes._blas_controllers()  # the BLAS libraries loaded when lanes first ran (numpy's among them)
    if not libs:
        pytest.skip("numpy's BLAS is not visible to threadpoolctl")
    before = [lib.get_num_threads() for lib in libs]
    with cpu_lanes.blas_pinned():
        assert [lib.get_num_threads() for lib in libs] == [1] * len(libs)
        with cpu_lanes.blas_pinned():  # nested: still one, and the outer block restores
            assert [lib.get_num_threads() for lib in libs] == [1] * len(libs)
        assert [lib.get_num_threads() for lib in libs] == [1] * len(libs)
    assert [lib.get_num_threads() for lib in libs] == before


# (N, Cin, H, W, Cout, stride): small per-sample GEMMs, so the row-shift loops run in lanes
LANE_CONFIGS = [(7, 16, 12, 12, 16, 1), (9, 8, 11, 9, 12, 2), (2, 16, 8, 8, 16, 1), (1, 4, 6, 6, 4, 1),
                (5, 32, 8, 8, 32, 1)]


def _conv_all(cfg, algo):
    n, cin, h, w, cout, s = cfg
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, cin, h, w)).astype(np.float32)
    wt = (rng.standard_normal((cout, cin, 3, 3)) * 0.1).astype(np.float32)
    be = CPUBackend(CPUMenu(winograd=False))   # 32 channels run Winograd by default; this is the row-shift
    ho, wo = cpu_conv.conv_output_hw((h, w), (3, 3), (s, s), (1, 1), (1, 1))
    y = np.empty((n, cout, ho, wo), np.float32)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    g = _geom(cfg)  # workspaces of exactly the declared size: lanes stay inside them
    ws_f = np.zeros(cpu_conv.conv_workspace_bytes(algo, "fwd", g, 4), np.uint8)
    ws_b = np.zeros(cpu_conv.conv_workspace_bytes(algo, "bwd", g, 4), np.uint8)
    be.conv2d_forward(x, wt, None, y, (s, s), (1, 1), (1, 1), 1, algo, ws_f)
    dx, dw = np.empty_like(x), np.empty_like(wt)
    be.conv2d_backward(x, wt, dy, dx, dw, None, (s, s), (1, 1), (1, 1), 1, algo, ws_b)
    return (x, wt, dy), (y, dx, dw)


def _geom(cfg):
    n, cin, h, w, cout, s = cfg
    ho, wo = cpu_conv.conv_output_hw((h, w), (3, 3), (s, s), (1, 1), (1, 1))
    return cpu_conv.ConvGeometry(n, cin, h, w, cout, 3, 3, ho, wo, 1, (s, s), (1, 1), (1, 1))


@pytest.mark.bits
@pytest.mark.parametrize("cfg", LANE_CONFIGS, ids=str)
def test_same_bits_whatever_the_lanes(cfg, monkeypatch, lanes):
    """The numpy path of the row-shift pair (where numba or numpy's 64-bit OpenBLAS is missing; the compiled
    path is `test_cpu_rows_jit`'s): 1, 2, 3 or 5 lanes, `rows` (lanes) or `rows_chunked` (one thread), the very
    same y, dx and dW; and the kernel rows split over lanes still give the convolution's gradient (PyTorch)."""
    monkeypatch.setattr(cpu_conv, "_compiled_rows", lambda: False)
    results = {}
    for threads in (1, 2, 3, 5):
        lanes(threads)
        for algo in ("rows", "rows_chunked"):
            inputs, results[threads, algo] = _conv_all(cfg, algo)
    assert_same_bits_then_torch(results, inputs, cfg[5], 1)


def test_lanes_for_rows_whatever_the_gemms(monkeypatch, lanes):
    lanes(4)
    small = _geom((8, 16, 32, 32, 16, 1))
    big = cpu_conv.ConvGeometry(8, 64, 56, 56, 64, 3, 3, 56, 56, 1, (1, 1), (1, 1), (1, 1))
    assert cpu_conv._RowShift(small, "rows", 4).lanes(4) == 4
    assert cpu_conv._RowShift(small, "rows", 4).lanes(2) == 2
    assert cpu_conv._RowShift(small, "rows_chunked", 4).lanes(4) == 1  # one sample's buffer: one lane
    assert cpu_conv._RowShift(big, "rows", 4).lanes(4) == 4  # large ones too: OpenBLAS's threads would spin
    one = _geom((1, 16, 32, 32, 16, 1))
    assert cpu_conv._RowShift(one, "rows", 4).lanes(4) == 1  # one sample: nothing to split


def test_a_convolution_pins_the_blas_on_any_lanes(monkeypatch, lanes):
    """A convolution call runs on a one-thread BLAS whatever the lanes and the batch (OpenBLAS's own threads
    would cut a large product by their count: other bits); inside a step's pin it calls nothing."""
    libs = cpu_lanes._blas_controllers()
    if not libs:
        pytest.skip("numpy's BLAS is not visible to threadpoolctl")
    before = [lib.get_num_threads() for lib in libs]
    for threads in ("1", "2"):
        lanes(threads)
        for n in (1, 8):
            with cpu_conv._blas_scope(_geom((n, 16, 32, 32, 16, 1))):
                assert [lib.get_num_threads() for lib in libs] == [1] * len(libs)
            assert [lib.get_num_threads() for lib in libs] == before
    with cpu_lanes.blas_pinned():
        monkeypatch.setattr(cpu_lanes, "_blas_controllers", lambda: pytest.fail("pinned twice"))
        with cpu_conv._blas_scope(_geom((8, 16, 32, 32, 16, 1))):
            pass


CASES = [((64, 576), (576, 3136), False, False), ((8, 4608), (4608, 512), False, False),
         ((576, 64), (3136, 576), True, True), ((37, 300), (300, 129), False, False),
         ((4, 256, 64), (4, 64, 196), False, False), ((1, 300, 512), (6, 512, 196), False, False),
         ((1024, 256), (256, 196), False, False), ((8, 2048), (1000, 2048), False, True),
         ((436, 111), (111, 298), False, False), ((275, 571), (571, 284), False, False),
         ((64, 256), (8, 256, 3136), False, False), ((1, 64, 256), (6, 256, 196), False, False),
         ((64, 256), (3, 256, 500), False, False), ((2, 64, 256), (2, 256, 300), False, False),
         ((2048, 512), (512, 20), False, False)]


def _blockwise(a, b):
    """The product as `cpu.lanes.matmul` promises it: every matrix of the stack alone, in the blocks of
    `cpu.lanes.blocks`, each one np.matmul call."""
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    axis, cuts = cpu_lanes.blocks(m, n, k)
    shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    out = np.empty(shape + (m, n), np.result_type(a, b))
    for idx in np.ndindex(*shape):
        ai = a[tuple(i if d > 1 else 0 for i, d in zip(idx[len(idx) - a.ndim + 2:], a.shape[:-2]))]
        bi = b[tuple(i if d > 1 else 0 for i, d in zip(idx[len(idx) - b.ndim + 2:], b.shape[:-2]))]
        for c0, c1 in cuts:
            if axis == -1:
                np.matmul(ai, bi[:, c0:c1], out=out[idx][:, c0:c1])
            else:
                np.matmul(ai[c0:c1], bi, out=out[idx][c0:c1])
    return out


@pytest.mark.bits
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_gives_the_same_bits_on_any_lanes(dtype, monkeypatch, lanes):
    """1, 2, 3 or 5 lanes, plain, transposed and stacked operands, shapes of ResNet-50's layers and odd ones:
    the bits of the fixed blocks run one by one, a stack's matrices each alone (so a stack and its matrices
    one at a time agree: im2col and im2col_chunked)."""
    rng = np.random.default_rng(4)
    for sa, sb, ta, tb in CASES:
        a = rng.standard_normal(sa).astype(dtype)
        b = rng.standard_normal(sb).astype(dtype)
        a, b = (a.T if ta else a), (b.T if tb else b)
        with cpu_lanes.blas_pinned():  # as in a step
            ref = _blockwise(a, b)
        for threads in ("1", "2", "3", "5"):
            lanes(threads)
            out = np.full_like(ref, np.nan)
            cpu_lanes.matmul(a, b, out)
            assert np.array_equal(out, ref), (sa, sb, ta, tb, threads)


def test_blocks_are_fixed_by_the_shapes():
    """The longer side (the other where it is too short); at most two, edges on multiples of 16, covering the
    axis in order; one block for a small product."""
    assert cpu_lanes.blocks(512, 196, 4608) == (-2, [(0, 256), (256, 512)])
    assert cpu_lanes.blocks(64, 3136, 576) == (-1, [(0, 1568), (1568, 3136)])
    assert cpu_lanes.blocks(2048, 20, 512) == (-2, [(0, 1024), (1024, 2048)])
    assert cpu_lanes.blocks(64, 300, 256) == (-1, [(0, 160), (160, 300)])
    assert cpu_lanes.blocks(37, 129, 300) == (-1, [(0, 129)])  # 1.4M multiply-adds: whole
    for m, n, k in [(64, 300, 256), (8, 1000, 2048), (275, 284, 571), (512, 49, 4608), (16, 17, 100000)]:
        axis, cuts = cpu_lanes.blocks(m, n, k)
        size = n if axis == -1 else m
        assert cuts[0][0] == 0 and cuts[-1][1] == size and len(cuts) in (1, 2)
        assert all(e0 == s1 and e0 % 16 == 0 for (_, e0), (s1, _) in zip(cuts, cuts[1:]))


def test_a_step_pins_the_blas(monkeypatch, lanes):
    """`CPUBackend.step_scope` pins the BLAS on any lane count (its threads would spin on the cores the lanes and
    the OpenMP workers need, and cut a product by their own count); a convolution keeps it pinned."""
    libs = cpu_lanes._blas_controllers()
    if not libs:
        pytest.skip("numpy's BLAS is not visible to threadpoolctl")
    before = [lib.get_num_threads() for lib in libs]
    big = cpu_conv.ConvGeometry(8, 64, 56, 56, 64, 3, 3, 56, 56, 1, (1, 1), (1, 1), (1, 1))
    lanes(2)
    with CPUBackend().step_scope():
        assert [lib.get_num_threads() for lib in libs] == [1] * len(libs)
        with cpu_conv._blas_scope(big):
            assert [lib.get_num_threads() for lib in libs] == [1] * len(libs)
        with cpu_conv._blas_scope(_geom((8, 16, 32, 32, 16, 1))):
            assert [lib.get_num_threads() for lib in libs] == [1] * len(libs)
    assert [lib.get_num_threads() for lib in libs] == before
    lanes(1)
    with CPUBackend().step_scope():
        assert [lib.get_num_threads() for lib in libs] == [1] * len(libs)
    assert [lib.get_num_threads() for lib in libs] == before


@pytest.mark.bits
def test_matmul_splits_a_stack_by_samples_in_any_dtype(monkeypatch, lanes):
    """One broadcast weight against a stack (a convolution's samples): a share of the stack a lane, float64
    too, each matrix in its blocks; a stack that shares out unevenly and is short (3 on 2 lanes) goes out by
    blocks instead. The same bits either way."""
    lanes(2)
    tasks = []
    real = cpu_lanes.run
    monkeypatch.setattr(cpu_lanes, "run", lambda ts: (tasks.append(len(ts)), real(ts)))
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((64, 256)), rng.standard_normal((8, 256, 300))
    out = np.empty((8, 64, 300))
    with cpu_lanes.blas_pinned():
        cpu_lanes.matmul(a, b, out)
        assert tasks == [2] and np.array_equal(out, _blockwise(a, b))
        tasks.clear()
        cpu_lanes.matmul(a, b[:3], out[:3])
        assert tasks == [len(cpu_lanes.blocks(64, 300, 256)[1])] and np.array_equal(out[:3], _blockwise(a, b[:3]))
