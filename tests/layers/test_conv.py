"""Conv2d against PyTorch, finite differences, and itself: every algorithm must give bit-identical results."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minidl import GraphError, Network
from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.cpu.menu import CPU_MENU, CPUMenu
from minidl.layers import Conv2d, LayerContext
from minidl.testing import directional_gradcheck, run_layer

# (N, Cin, H, W, Cout, kernel, stride, padding, dilation, groups, bias)
CONFIGS = [
    (2, 3, 7, 9, 4, 3, 1, 1, 1, 1, True),            # odd sizes, 'same' padding
    (3, 4, 7, 9, 8, 3, 2, 0, 1, 2, False),           # stride 2, groups 2, no bias
    (1, 4, 9, 7, 8, 3, 3, 2, 1, 4, True),            # stride 3, padding 2, groups 4, batch 1
    (2, 4, 9, 9, 4, 3, 1, 2, 2, 1, True),            # dilation 2
    (2, 4, 8, 8, 4, 3, 1, 1, 1, 4, True),            # depthwise
    (3, 6, 6, 7, 12, 3, 2, 1, 1, 6, False),          # depthwise, channel multiplier 2, stride 2
    (3, 8, 5, 7, 16, 1, 1, 0, 1, 1, True),           # 1x1 (gemm_1x1 applies)
    (2, 8, 5, 7, 8, 1, 1, 0, 1, 2, False),           # 1x1 grouped (gemm_1x1 applies)
    (2, 8, 7, 7, 4, 1, 2, 0, 1, 1, True),            # 1x1 stride 2 (ResNet downsample)
    (2, 4, 6, 6, 6, 1, 1, 1, 1, 1, True),            # 1x1 with padding
    (1, 3, 15, 13, 5, 7, 2, 3, 1, 1, True),          # 7x7 s2 p3 (ResNet stem)
    (3, 2, 5, 6, 3, (2, 3), (1, 2), (1, 0), (2, 1), 1, True),  # non-square everything
    (2, 3, 5, 5, 2, 5, 1, 0, 1, 1, True),            # 1x1 output
    (1, 2, 3, 3, 2, 3, 1, 2, 1, 1, False),           # padding wider than the kernel reach: empty taps
    (2, 4, 6, 6, 8, 2, 2, 0, 1, 1, True),            # even kernel
    (3, 4, 9, 8, 6, 3, 2, 1, 1, 1, True),            # 3x3 stride 2 (row-shift by phases), odd height
    (2, 3, 8, 7, 4, 3, 2, 0, 1, 1, False),           # 3x3 stride 2, no padding
    (2, 3, 11, 9, 5, 3, (2, 1), 1, 2, 1, True),      # 3x3 stride (2, 1), dilation 2: phases (0, 0, 0)
    (2, 4, 8, 8, 4, 3, 2, 2, 1, 1, True),            # 3x3 stride 2, padding 2
    (3, 128, 5, 6, 8, 3, 1, 1, 1, 1, True),          # small plane, long columns: im2col_grouped, one group
    (5, 128, 14, 14, 6, 3, 1, 1, 1, 1, False),       # im2col_grouped, 3 + 2 samples: dW summed over two groups
    (3, 130, 7, 7, 5, 3, 2, 1, 1, 1, True),          # im2col_grouped at stride 2 (ResNet-50's downsampling 3x3)
    (2, 48, 6, 11, 4, 5, 1, (2, 1), (1, 2), 1, True),  # im2col_grouped: 5x5, dilation, odd padding
]

# Winograd (on the CPU menu by default, off with CPUMenu(winograd=False)): 3x3, stride 1, >= 32 channels in and out
WINOGRAD_PAIR = ["winograd", "winograd_by_position"]
WINOGRAD_CONFIGS = [
    (3, 32, 7, 9, 40, 3, 1, 1, 1, 1, True),          # odd sizes (partial tiles), 40 = 2.5 channel blocks
    (2, 33, 8, 8, 32, 3, 1, 0, 1, 1, False),         # no padding, a 1-channel last block
    (5, 64, 5, 6, 48, 3, 1, (2, 1), 1, 1, True),     # padding 2 and 1
    (10, 64, 8, 8, 64, 3, 1, 1, 1, 1, False),        # 8 + 2 samples: dW summed over two groups
    (2, 48, 1, 1, 32, 3, 1, 1, 1, 1, True),          # a 1x1 image
]

RNG = np.random.default_rng(0)


def _data(cfg, dtype=np.float32, rng=RNG):
    n, c, h, w, co, k, s, p, d, g, bias = cfg
    kh, kw = (k, k) if isinstance(k, int) else k
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((co, c // g, kh, kw)).astype(dtype)
    b = rng.standard_normal(co).astype(dtype)
    params = {"weight": wt, **({"bias": b} if bias else {})}
    return x, params


def _layer(cfg):
    n, c, h, w, co, k, s, p, d, g, bias = cfg
    return Conv2d(co, k, stride=s, padding=p, dilation=d, groups=g, bias=bias)


def _algos(cfg):
    n, c, h, w = cfg[:4]
    return _layer(cfg).algorithms((n, c, h, w))


def _close(got, ref, rtol=1e-4, atol=1e-5):
    ref = ref.detach().numpy()
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol * scale)


def _torch_ref(cfg, x, params, dy):
    n, c, h, w, co, k, s, p, d, g, bias = cfg
    tx = torch.tensor(x, requires_grad=True)
    tw = torch.tensor(params["weight"], requires_grad=True)
    tb = torch.tensor(params["bias"], requires_grad=True) if bias else None
    ty = F.conv2d(tx, tw, tb, stride=s, padding=p, dilation=d, groups=g)
    ty.backward(torch.tensor(dy))
    return ty, tx.grad, tw.grad, (tb.grad if bias else None)


def _run(cfg, x, params, dy, algo):
    return run_layer(_layer(cfg), [x], params, dout=dy, algo_fwd=algo, algo_bwd=algo)


def _id(c):
    return "x".join(map(str, c[:5])) + f"-k{c[5]}s{c[6]}p{c[7]}d{c[8]}g{c[9]}".replace(" ", "")


def _assert_bit_identical(runs):
    """Every algorithm's output, input delta and parameter gradients equal the first one's, bit for bit (a layer's
    menu is the row-shift pair or the im2col family, never both: see cpu.conv.uses_rows)."""
    ref = next(iter(runs.values()))
    assert len(runs) >= 2 or list(runs) == ["im2col_grouped"]  # that one: the layer's only algorithm
    for algo, r in runs.items():
        assert np.array_equal(r.out, ref.out), algo
        assert np.array_equal(r.dinputs[0], ref.dinputs[0]), algo
        for name in r.grads:
            assert np.array_equal(r.grads[name], ref.grads[name]), (algo, name)


@pytest.mark.bits
@pytest.mark.parametrize("cfg", CONFIGS, ids=_id)
def test_matches_torch_and_algorithms_agree_bitwise(cfg):
    x, params = _data(cfg)
    out_shape = _layer(cfg).infer_shape([x.shape])
    dy = RNG.standard_normal(out_shape).astype(np.float32)
    ty, tdx, tdw, tdb = _torch_ref(cfg, x, params, dy)
    assert tuple(ty.shape) == out_shape
    runs = {}
    for algo in _algos(cfg):
        r = _run(cfg, x, params, dy, algo)
        _close(r.out, ty)
        _close(r.dinputs[0], tdx)
        _close(r.grads["weight"], tdw)
        if tdb is not None:
            _close(r.grads["bias"], tdb)
        runs[algo] = r
    _assert_bit_identical(runs)


@pytest.mark.parametrize("cfg", [
    (5, 16, 13, 11, 32, 3, 1, 1, 1, 1, True),
    (4, 32, 10, 10, 64, 1, 1, 0, 1, 1, True),
    (4, 32, 10, 10, 64, 1, 1, 0, 1, 2, False),
    (3, 24, 17, 15, 16, 5, 2, 2, 1, 2, True),
    (6, 64, 7, 7, 64, 3, 1, 1, 1, 1, False),
    (8, 16, 32, 32, 16, 3, 1, 1, 1, 1, False),       # CIFAR ResNet's first stage (row-shift)
    (3, 8, 12, 10, 8, (3, 5), (1, 2), (1, 2), (2, 1), 1, True),  # row-shift with column stride and dilation
    (6, 32, 14, 14, 32, 3, 2, 1, 1, 1, False),       # ResNet's downsampling 3x3 (row-shift by phases)
])
@pytest.mark.bits
def test_bit_identical_across_algorithms_larger(cfg):
    """Big enough that BLAS blocks and threads; every algorithm still gives the very same bits."""
    rng = np.random.default_rng(1)
    x, params = _data(cfg, rng=rng)
    dy = rng.standard_normal(_layer(cfg).infer_shape([x.shape])).astype(np.float32)
    runs = {a: _run(cfg, x, params, dy, a) for a in _algos(cfg)}
    _assert_bit_identical(runs)


@pytest.mark.parametrize("cfg", [
    (2, 3, 5, 6, 4, 3, 2, 1, 1, 1, True),
    (2, 4, 5, 5, 4, 3, 1, 1, 2, 2, True),
    (3, 4, 4, 3, 6, 1, 1, 0, 1, 2, True),
    (3, 128, 3, 4, 3, 3, 1, 1, 1, 1, True),          # im2col_grouped
])
def test_gradcheck_float64(cfg):
    x, params = _data(cfg, np.float64, np.random.default_rng(2))
    for algo in _algos(cfg):
        directional_gradcheck(lambda: _layer(cfg), [x], params, algo_fwd=algo, algo_bwd=algo, rtol=1e-6,
                              atol=1e-9)


def test_backward_parts_optional():
    """dx, dW, db may each be unwanted (None): the rest is unchanged, bit for bit."""
    be = CPUBackend()
    cfg = (3, 4, 7, 9, 8, 3, 2, 1, 1, 2, True)
    x, params = _data(cfg)
    w = params["weight"]
    layer = _layer(cfg)
    out_shape = layer.infer_shape([x.shape])
    dy = RNG.standard_normal(out_shape).astype(np.float32)
    full = _run(cfg, x, params, dy, "im2col_chunked")
    for algo in _algos(cfg):
        need = layer.workspace_options("bwd", [x.shape], out_shape, 4, CPU_MENU)[0].workspace_bytes
        ws = np.zeros(need * 2, np.uint8)
        dx = np.full_like(x, np.nan)
        be.conv2d_backward(x, w, dy, dx, None, None, (2, 2), (1, 1), (1, 1), 2, algo, ws)
        assert np.array_equal(dx, full.dinputs[0])
        dw, db = np.full_like(w, np.nan), np.full(8, np.nan, np.float32)
        be.conv2d_backward(x, w, dy, None, dw, db, (2, 2), (1, 1), (1, 1), 2, algo, ws)
        assert np.array_equal(dw, full.grads["weight"]) and np.array_equal(db, full.grads["bias"])


def test_workspace_sizes_exact():
    # a 5x5 kernel at stride 2: the im2col family. K = Cin*kh*kw columns of P = Ho*Wo outputs per sample.
    layer = Conv2d(4, 5, stride=2, padding=2)
    in_shapes, out_shape = [(2, 3, 7, 9)], (2, 4, 4, 5)
    k, p = 3 * 5 * 5, 4 * 5
    fwd = {o.algo: o.workspace_bytes for o in layer.workspace_options("fwd", in_shapes, out_shape, 4, CPU_MENU)}
    bwd = {o.algo: o.workspace_bytes for o in layer.workspace_options("bwd", in_shapes, out_shape, 4, CPU_MENU)}
    assert fwd == {"im2col": 2 * k * p * 4, "im2col_chunked": k * p * 4}
    # backward: the column buffer (reused for dcols), 64-byte aligned, then a weight-sized dW product buffer
    assert 2 * k * p * 4 == 12000 and k * p * 4 == 6000
    assert bwd == {"im2col": 12032 + 4 * k * 4, "im2col_chunked": 6016 + 4 * k * 4}
    f64 = {o.algo: o.workspace_bytes for o in layer.workspace_options("fwd", in_shapes, out_shape, 8, CPU_MENU)}
    assert f64 == {"im2col": 2 * k * p * 8, "im2col_chunked": k * p * 8}
    # stride 1 down the rows: the row-shift pair. Rows buffer: K3 = Cin*kw taps of the padded plane
    # Hp x Wo = (7+2) x 9 per sample; then the kernel rows of the weight (kh, Cout, K3); forward: an output-sized
    # accumulator per sample of the chunk.
    same = Conv2d(4, 3, padding=1)
    k3, plane, p, wrow = 3 * 3, 9 * 9, 7 * 9, 3 * 4 * 9 * 4
    assert (2 * k3 * plane * 4, k3 * plane * 4, wrow) == (5832, 2916, 432)  # aligned: 5888, 2944, 448
    fwd = {o.algo: o.workspace_bytes for o in same.workspace_options("fwd", in_shapes, (2, 4, 7, 9), 4, CPU_MENU)}
    bwd = {o.algo: o.workspace_bytes for o in same.workspace_options("bwd", in_shapes, (2, 4, 7, 9), 4, CPU_MENU)}
    assert fwd == {"rows": 5888 + 448 + 2 * 4 * p * 4, "rows_chunked": 2944 + 448 + 4 * p * 4}
    # backward, one phase after the other in the same memory, so the larger of:
    # dW: the rows of x | a (kh, Cout, K3) accumulator | one (Cout, K3) product (N > 1)
    dw_rows, dw_chunked = 5888 + 448 + 4 * k3 * 4, 2944 + 448 + 4 * k3 * 4
    # dx: the forward of the flipped convolution of dy (Cin and Cout swapped: K3' = 4 * 3 taps of the padded
    # 9 x 9 plane): its rows (2 * 12 * 81 * 4 = 7776 -> 7808, or 3888 -> 3904) | its weight rows (432 -> 448) |
    # a (3, P) accumulator per sample of the chunk
    dx_rows, dx_chunked = 7808 + 448 + 2 * 3 * p * 4, 3904 + 448 + 3 * p * 4
    assert bwd == {"rows": max(dw_rows, dx_rows), "rows_chunked": max(dw_chunked, dx_chunked)} \
        == {"rows": 9768, "rows_chunked": 5108}
    # 1x1: gemm_1x1 needs no columns at all (backward only the dW product buffer when N > 1), and comes first
    one = Conv2d(8, 1, groups=2)
    opts = one.workspace_options("fwd", [(3, 4, 5, 5)], (3, 8, 5, 5), 4, CPU_MENU)
    assert [o.algo for o in opts] == ["gemm_1x1", "im2col", "im2col_chunked"]
    assert [o.workspace_bytes for o in opts] == [0, 3 * 4 * 25 * 4, 4 * 25 * 4]
    opts = one.workspace_options("bwd", [(3, 4, 5, 5)], (3, 8, 5, 5), 4, CPU_MENU)
    assert opts[0].algo == "gemm_1x1" and opts[0].workspace_bytes == 8 * 2 * 4
    opts = one.workspace_options("bwd", [(1, 4, 5, 5)], (1, 8, 5, 5), 4, CPU_MENU)
    assert {o.algo: o.workspace_bytes for o in opts} == {"gemm_1x1": 0, "im2col": 400, "im2col_chunked": 400}
    # sorted fastest-first by estimated cost
    assert [o.est_cost for o in opts] == sorted(o.est_cost for o in opts)
    # the backend answers the same question with the CUDA backend's signature
    be = CPUBackend()
    for phase in ("fwd", "bwd"):
        assert be.conv_workspace_options(phase, (2, 3, 7, 9), (4, 3, 5, 5), (2, 4, 4, 5), (2, 2), (2, 2), (1, 1),
                                         1, np.float32) == layer.workspace_options(phase, in_shapes, out_shape, 4,
                                                                                   CPU_MENU)


@pytest.mark.parametrize("kw", [dict(kernel_size=1, stride=2), dict(kernel_size=1, padding=1),
                                dict(kernel_size=1, dilation=2), dict(kernel_size=3, stride=3)])
def test_gemm_1x1_only_when_applicable(kw):
    layer = Conv2d(4, **kw)
    in_shapes = [(2, 4, 6, 6)]
    out_shape = layer.infer_shape(in_shapes)
    for phase in ("fwd", "bwd"):
        algos = [o.algo for o in layer.workspace_options(phase, in_shapes, out_shape, 4, CPU_MENU)]
        assert algos == ["im2col", "im2col_chunked"]


def test_row_shift_applies_to_stride_1_rows_only():
    assert Conv2d(4, 3).algorithms() == ["rows", "rows_chunked"]
    assert Conv2d(4, (3, 1), stride=(1, 2)).algorithms() == ["rows", "rows_chunked"]
    assert Conv2d(4, 3, stride=(2, 1)).algorithms() == ["rows", "rows_chunked"]   # ResNet's downsampling 3x3
    assert Conv2d(4, 3, stride=2, padding=1).algorithms() == ["rows", "rows_chunked"]
    assert Conv2d(4, 7, stride=2).algorithms() == ["im2col", "im2col_chunked"]   # a stem: K = Cin*kw too short
    assert Conv2d(4, 3, stride=3).algorithms() == ["im2col", "im2col_chunked"]
    assert Conv2d(4, (1, 3)).algorithms() == ["im2col", "im2col_chunked"]   # one kernel row: nothing to shift
    assert Conv2d(4, 3, groups=2).algorithms() == ["im2col", "im2col_chunked"]


def test_grouped_applies_to_small_planes_with_long_columns():
    """`im2col_grouped` is decided by the shapes: output planes of at most 14x14 with K = Cin*kh*kw >= 1024,
    one group, not a plain 1x1; then it is the layer's only algorithm (one summation order per layer)."""
    c3 = Conv2d(512, 3, padding=1)
    assert c3.algorithms((8, 512, 7, 7)) == ["im2col_grouped"]        # ResNet-50's last stage
    assert c3.algorithms((8, 128, 14, 14)) == ["im2col_grouped"]      # 196 pixels, K = 1152: both limits (to 512)
    narrow = Conv2d(256, 3, padding=1)  # a 14x14 stride-1 3x3 up to 256 channels runs Winograd (faster)
    assert narrow.algorithms((8, 128, 14, 14)) == WINOGRAD_PAIR and narrow.algorithms((8, 256, 14, 14)) == WINOGRAD_PAIR
    assert narrow.algorithms((8, 256, 7, 7)) == ["im2col_grouped"]    # 7x7 planes: grouped
    assert c3.algorithms((8, 128, 15, 14)) == WINOGRAD_PAIR  # 210 pixels: not grouped (a 3x3 at stride 1)
    assert c3.algorithms((8, 114, 14, 14)) == ["im2col_grouped"]      # K = 1026
    assert c3.algorithms((8, 113, 14, 14)) == WINOGRAD_PAIR  # K = 1017
    s2 = Conv2d(512, 3, stride=2, padding=1)
    assert s2.algorithms((8, 128, 29, 29)) == ["rows", "rows_chunked"]  # 225 output pixels, stride 2
    assert s2.algorithms((8, 113, 28, 28)) == ["rows", "rows_chunked"]  # K = 1017
    # a strided 1x1 on 1024 channels (ResNet-50's last projection): its 8 MB weight, one GEMM over the samples
    assert Conv2d(2048, 1, stride=2).algorithms((8, 1024, 14, 14)) == ["im2col_grouped"]
    assert Conv2d(1024, 1, stride=2).algorithms((8, 512, 28, 28)) == ["im2col", "im2col_chunked"]  # K = 512
    assert c3.algorithms() == ["rows", "rows_chunked"]                # without shapes: the configuration's
    assert Conv2d(512, 1).algorithms((8, 2048, 7, 7)) == ["im2col", "im2col_chunked", "gemm_1x1"]
    assert Conv2d(512, 3, padding=1, groups=2).algorithms((8, 512, 7, 7)) == ["im2col", "im2col_chunked"]
    # a stride-2 3x3 stays on the row-shift pair above 64 output pixels (ResNet-50's 28 -> 14), grouped below
    assert Conv2d(8, 3, stride=2, padding=1).algorithms((2, 256, 28, 28)) == ["rows", "rows_chunked"]
    assert Conv2d(8, 3, stride=2, padding=1).algorithms((2, 256, 16, 16)) == ["im2col_grouped"]  # 8x8
    assert Conv2d(8, 3, stride=2, padding=1).algorithms((2, 512, 14, 14)) == ["im2col_grouped"]
    with pytest.raises(ValueError, match=r"'rows' is not available .* input \(8, 512, 7, 7\); have "
                                         r"\['im2col_grouped'\]"):
        c3.forward(CPUBackend(), [np.zeros((8, 512, 7, 7), np.float32)], np.zeros((8, 512, 7, 7), np.float32),
                   {"weight": np.zeros((512, 512, 3, 3), np.float32), "bias": np.zeros(512, np.float32)},
                   LayerContext(algo="rows", workspace=np.zeros(1, np.uint8)))


@pytest.mark.bits
@pytest.mark.parametrize("cfg", WINOGRAD_CONFIGS, ids=_id)
def test_winograd_matches_torch_and_both_variants_agree_bitwise(cfg):
    """Both variants against PyTorch; the by-position one gives the whole-tile one's bits (the planner may pick
    either under a budget), and a second run the same bits again."""
    x, params = _data(cfg)
    dy = RNG.standard_normal(_layer(cfg).infer_shape([x.shape])).astype(np.float32)
    ty, tdx, tdw, tdb = _torch_ref(cfg, x, params, dy)
    assert _algos(cfg) == WINOGRAD_PAIR
    runs = {}
    for algo in WINOGRAD_PAIR:
        r = runs[algo] = _run(cfg, x, params, dy, algo)
        _close(r.out, ty)
        _close(r.dinputs[0], tdx)
        _close(r.grads["weight"], tdw)
        if tdb is not None:
            _close(r.grads["bias"], tdb)
    runs["again"] = _run(cfg, x, params, dy, "winograd")
    _assert_bit_identical(runs)


@pytest.mark.parametrize("cfg", [(2, 32, 4, 5, 33, 3, 1, 1, 1, 1, True), (3, 33, 3, 3, 32, 3, 1, 0, 1, 1, False)])
def test_winograd_gradcheck_float64(cfg):
    x, params = _data(cfg, np.float64, np.random.default_rng(2))
    assert _algos(cfg) == WINOGRAD_PAIR
    for algo in WINOGRAD_PAIR:
        directional_gradcheck(lambda: _layer(cfg), [x], params, algo_fwd=algo, algo_bwd=algo, rtol=1e-6,
                              atol=1e-9)


def test_winograd_applies_to_3x3_stride_1_with_32_channels(monkeypatch):
    """The Winograd pair: on by default; 3x3, stride 1, dilation 1, one group, padding 0..2, at least 32 channels
    in and out (below that the row-shift formulation is faster, measured), numba importable; then the layer's
    only algorithms. The CPU menu's `winograd=False` switches it off: its menu and its backend offer the row-shift
    pair instead."""
    from minidl.backend.cpu import winograd as cpu_winograd

    c = Conv2d(32, 3, padding=1)
    assert c.algorithms((8, 32, 16, 16)) == WINOGRAD_PAIR
    assert c.algorithms((1, 64, 8, 8)) == WINOGRAD_PAIR
    assert c.algorithms((8, 31, 16, 16)) == ["rows", "rows_chunked"]
    assert Conv2d(31, 3, padding=1).algorithms((8, 32, 16, 16)) == ["rows", "rows_chunked"]
    assert Conv2d(32, 3, padding=3).algorithms((8, 32, 16, 16)) == ["rows", "rows_chunked"]
    assert Conv2d(32, 3, stride=2, padding=1).algorithms((8, 32, 16, 16)) == ["rows", "rows_chunked"]
    assert Conv2d(32, 3, dilation=2, padding=2).algorithms((8, 32, 16, 16)) == ["rows", "rows_chunked"]
    assert Conv2d(32, 3, groups=2).algorithms((8, 32, 16, 16)) == ["im2col", "im2col_chunked"]
    assert Conv2d(512, 3, padding=1).algorithms((8, 256, 14, 14)) == ["im2col_grouped"]  # grouped first (512 out)
    assert Conv2d(256, 3, padding=1).algorithms((8, 256, 14, 14)) == WINOGRAD_PAIR  # 14x14, at most 256 channels
    assert Conv2d(32, 3, padding=1).algorithms((8, 32, 16, 16), winograd=False) == ["rows", "rows_chunked"]
    off = CPUMenu(winograd=False)
    assert [o.algo for o in c.workspace_options("fwd", [(8, 32, 16, 16)], (8, 32, 16, 16), 4, off)] == \
        ["rows", "rows_chunked"]
    x = np.zeros((8, 32, 16, 16), np.float32)
    params = {"weight": np.zeros((32, 32, 3, 3), np.float32), "bias": np.zeros(32, np.float32)}
    run_layer(Conv2d(32, 3, padding=1), [x], params, backend=CPUBackend(off), algo_fwd="rows")
    y, ws = np.empty_like(x), np.zeros(1 << 20, np.uint8)
    with pytest.raises(ValueError, match="'rows' does not apply"):   # the default menu's backend runs Winograd
        CPUBackend().conv2d_forward(x, params["weight"], None, y, (1, 1), (1, 1), (1, 1), 1, "rows", ws)
    monkeypatch.setattr(cpu_winograd, "available", lambda: False)
    c2 = Conv2d(32, 3, padding=1)
    assert c2.algorithms((8, 32, 16, 16)) == ["rows", "rows_chunked"]


def test_winograd_workspace_exact():
    """The documented layouts, each part 64-byte aligned. Whole tile: forward U (16, CiB, CoB) | V (16, Tg, CiB)
    | M (16, Tg, CoB) | the weight transposed (3, 3, Ci, Co) | input scratch ((2th+2)(2tw+2), 16) | output
    scratch (2th * 2tw, 16) | 256 values; backward the larger of dW's (V | dM | dU | a dU product with more
    than one group | dW transposed | the same scratch) and the flipped convolution's forward. By position: a
    sixteenth of U, V, M and of the dU product, no output scratch and no tile buffer."""
    def a(n):
        return -(-n // 64) * 64

    layer = Conv2d(40, 3, padding=1)
    # x (10, 33, 7, 9): Ho, Wo = 7, 9 -> th, tw = 4, 5; CiB = 48, CoB = 48; samples per group:
    # 16384 // ((48 + 48) * 20) = 8, so two groups; Tg = 8 * 20 = 160
    th, tw, cib, cob, tg = 4, 5, 48, 48, 160
    xs, ys = (2 * th + 2) * (2 * tw + 2) * 16, 2 * th * 2 * tw * 16
    wt, scratch = a(9 * 33 * 40 * 4), a(xs * 4) + a(ys * 4) + a(256 * 4)
    fwd = a(16 * cib * cob * 4) + a(16 * tg * cib * 4) + a(16 * tg * cob * 4) + wt + scratch
    dw = a(16 * tg * cib * 4) + a(16 * tg * cob * 4) + 2 * a(16 * cib * cob * 4) + wt + scratch
    # dx: dy (10, 40, 7, 9) -> dx (10, 33, 7, 9), padding 1: the same tiles, channels swapped
    dx = a(16 * cob * cib * 4) + a(16 * tg * cob * 4) + a(16 * tg * cib * 4) + a(9 * 40 * 33 * 4) + scratch
    fwd_p = a(cib * cob * 4) + a(tg * cib * 4) + a(tg * cob * 4) + wt + a(xs * 4)
    dw_p = a(tg * cib * 4) + a(tg * cob * 4) + a(16 * cib * cob * 4) + a(cib * cob * 4) + wt + a(xs * 4) \
        + a(ys * 4)
    dx_p = a(cob * cib * 4) + a(tg * cob * 4) + a(tg * cib * 4) + a(9 * 40 * 33 * 4) + a(xs * 4)
    got_f = layer.workspace_options("fwd", [(10, 33, 7, 9)], (10, 40, 7, 9), 4, CPU_MENU)
    got_b = layer.workspace_options("bwd", [(10, 33, 7, 9)], (10, 40, 7, 9), 4, CPU_MENU)
    assert [(o.algo, o.workspace_bytes) for o in got_f] == [("winograd", fwd), ("winograd_by_position", fwd_p)]
    assert [(o.algo, o.workspace_bytes) for o in got_b] == [("winograd", max(dw, dx)),
                                                            ("winograd_by_position", max(dw_p, dx_p))]
    assert (fwd_p, max(dw_p, dx_p)) == (125888, 278464)   # against (1191872, 1339328)
    assert (fwd, max(dw, dx)) == (1191872, 1339328)


def test_grouped_workspace_exact():
    """Samples per GEMM: enough for 512 columns (ceil(512 / P)), at most N. Forward: the group's columns
    (K, g*P) | the group's (Cout, g*P) output block. Backward: the same two (the block receives dy's group),
    then a weight-sized dW product buffer when there is more than one group."""
    layer = Conv2d(6, 3, padding=1)
    k, p, cout = 128 * 9, 14 * 14, 6
    g = -(-512 // p)
    assert g == 3
    fwd = layer.workspace_options("fwd", [(5, 128, 14, 14)], (5, 6, 14, 14), 4, CPU_MENU)
    bwd = layer.workspace_options("bwd", [(5, 128, 14, 14)], (5, 6, 14, 14), 4, CPU_MENU)
    cols = k * g * p * 4
    assert cols % 64 == 0 and cols == 2709504
    assert [(o.algo, o.workspace_bytes) for o in fwd] == [("im2col_grouped", cols + cout * g * p * 4)]
    blk_end = cols + cout * g * p * 4                                  # 2723616, aligned up to 2723648
    assert [(o.algo, o.workspace_bytes) for o in bwd] == [("im2col_grouped", 2723648 + cout * k * 4)]
    assert blk_end == 2723616
    # one group (N <= g): no product buffer
    one = layer.workspace_options("bwd", [(3, 128, 14, 14)], (3, 6, 14, 14), 4, CPU_MENU)
    assert one[0].workspace_bytes == cols + cout * g * p * 4
    # 7x7: ceil(512 / 49) = 11 samples per GEMM, capped at N = 8
    big = Conv2d(512, 3, padding=1).workspace_options("fwd", [(8, 512, 7, 7)], (8, 512, 7, 7), 4, CPU_MENU)
    assert big[0].workspace_bytes == 4608 * 8 * 49 * 4 + 512 * 8 * 49 * 4


def test_workspace_errors():
    cfg = (2, 3, 7, 9, 4, 3, (3, 1), 1, 1, 1, True)   # stride 3 down the rows: the im2col family
    x, params = _data(cfg)
    layer = _layer(cfg)
    out = np.empty(layer.infer_shape([x.shape]), np.float32)
    be = CPUBackend()
    with pytest.raises(ValueError, match="needs a workspace of 5832 bytes"):
        layer.forward(be, [x], out, params, LayerContext(algo="im2col"))
    with pytest.raises(ValueError, match="at least 5832 bytes"):
        layer.forward(be, [x], out, params, LayerContext(algo="im2col", workspace=np.zeros(100, np.uint8)))
    with pytest.raises(ValueError, match="no fwd algorithm chosen"):
        layer.forward(be, [x], out, params, LayerContext())
    with pytest.raises(ValueError, match="not available"):
        layer.forward(be, [x], out, params, LayerContext(algo="gemm_1x1"))
    # a 1x1 conv without workspace or algorithm runs gemm_1x1
    one = Conv2d(5, 1)
    w = RNG.standard_normal((5, 3, 1, 1)).astype(np.float32)
    y = np.empty((2, 5, 7, 9), np.float32)
    one.forward(be, [x], y, {"weight": w, "bias": np.zeros(5, np.float32)}, LayerContext())
    np.testing.assert_allclose(y, F.conv2d(torch.tensor(x), torch.tensor(w)).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,layer,words", [
    ((2, 3, 5, 5), dict(out_channels=4, kernel_size=7), ["5x5", "(7, 7)", "(0, 0)", "(2, 3, 5, 5)"]),
    ((2, 3, 5), dict(out_channels=4, kernel_size=3), ["4-D", "(2, 3, 5)"]),
    ((2, 3, 5, 5), dict(out_channels=4, kernel_size=3, groups=2), ["input channels 3", "groups=2"]),
    ((2, 4, 5, 5), dict(out_channels=3, kernel_size=3, groups=2), ["out_channels 3", "groups=2"]),
    # stride=0 is refused earlier, at construction (tests/test_errors.py)
    ((2, 3, 8, 8), dict(out_channels=4, kernel_size=3, dilation=4), ["dilation (4, 4)"]),
])
def test_shape_errors_name_the_layer(shape, layer, words):
    net = Network()
    x = net.input(shape)
    with pytest.raises(GraphError) as e:
        Conv2d(**layer, name="stem")(x)
    msg = str(e.value)
    assert "stem" in msg and "conv" in msg
    for w in words:
        assert w in msg, (w, msg)


def test_declarations():
    layer = Conv2d(8, (3, 5), stride=2, padding=(1, 2), groups=2, bias=True)
    in_shapes = [(4, 6, 11, 13)]
    out_shape = layer.infer_shape(in_shapes)
    assert out_shape == (4, 8, 6, 7)
    specs = layer.param_specs(in_shapes)
    assert specs["weight"].shape == (8, 3, 3, 5) and specs["weight"].init == "kaiming_uniform"
    assert specs["weight"].fan_in == 3 * 3 * 5
    assert specs["bias"].shape == (8,) and specs["bias"].init == "bias_uniform" and specs["bias"].fan_in == 45
    assert "bias" not in Conv2d(8, 3, bias=False).param_specs(in_shapes)
    f = 2 * 4 * 8 * 6 * 7 * 3 * 3 * 5 + 4 * 8 * 6 * 7
    assert layer.flops(in_shapes, out_shape) == f
    assert layer.backward_flops(in_shapes, out_shape) == 2 * f
    assert layer.config() == {"out_channels": 8, "kernel_size": (3, 5), "stride": (2, 2), "padding": (1, 2),
                              "dilation": (1, 1), "groups": 2, "bias": True}
    assert Conv2d.type_name == "conv" and Conv2d.needs_inputs == (0,) and Conv2d.checkpoint


@pytest.mark.parametrize("cfg", [(4, 32, 32, 32, 64, 3, 1, 1, 1, 1, True), (4, 32, 48, 48, 64, 3, 2, 1, 1, 2, True),
                                 (4, 64, 32, 32, 32, 1, 1, 0, 1, 1, True),
                                 (8, 256, 14, 14, 256, 3, 1, 1, 1, 1, True)])   # im2col_grouped
def test_no_large_temporaries(cfg):
    """The chunking rule: all scratch is the declared workspace. numpy's own iteration buffers (a fixed 8192
    elements per operand, whatever the array size) are all that may be allocated beside it."""
    import tracemalloc

    be = CPUBackend()
    x, params = _data(cfg)
    layer = _layer(cfg)
    out_shape = layer.infer_shape([x.shape])
    y, dy = np.empty(out_shape, np.float32), RNG.standard_normal(out_shape).astype(np.float32)
    dx, dw, db = np.empty_like(x), np.empty_like(params["weight"]), np.empty(out_shape[1], np.float32)
    bound = 256 * 1024
    assert min(x.nbytes, y.nbytes) >= 2 * bound
    for algo in _algos(cfg):
        sizes = {ph: next(o.workspace_bytes for o in layer.workspace_options(ph, [x.shape], out_shape, 4, CPU_MENU)
                          if o.algo == algo) for ph in ("fwd", "bwd")}
        wsf, wsb = np.zeros(sizes["fwd"], np.uint8), np.zeros(sizes["bwd"], np.uint8)
        # once untraced first: the first call imports and loads the compiled kernels (numba, ~24 MB of Python
        # objects), which is not scratch; run alone, this test used to trace that import
        layer.forward(be, [x], y, params, LayerContext(algo=algo, workspace=wsf))
        layer.backward(be, [x], None, dy, [dx], {"weight": dw, "bias": db}, params,
                       LayerContext(algo=algo, workspace=wsb))
        tracemalloc.start()
        try:
            layer.forward(be, [x], y, params, LayerContext(algo=algo, workspace=wsf))
            layer.backward(be, [x], None, dy, [dx], {"weight": dw, "bias": db}, params,
                           LayerContext(algo=algo, workspace=wsb))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < bound, (algo, peak)
