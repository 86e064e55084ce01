"""An accumulating convolution backward (`conv2d_backward(..., accumulate=True)`, a fork's later consumer) adds
the input gradient into the delta it is given with exactly the bits of delta + (the dx a plain call writes),
for every CPU algorithm, on its compiled and numpy paths, on one or two lanes, in exactly the workspace
`conv_workspace_bytes(..., accumulate=True)` declares; the weight and bias gradients are the plain call's."""
import numpy as np
import pytest

from minidl.backend.cpu import conv as cpu_conv
from minidl.backend.cpu import winograd as cpu_winograd
from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.cpu.conv import ALGOS, ConvGeometry, conv_algorithms, conv_output_hw, conv_workspace_bytes

# (n, cin, h, w, cout, kernel, stride, padding, groups): together they offer every algorithm
CASES = {
    "1x1": (3, 8, 9, 9, 6, 1, 1, 0, 1),            # gemm_1x1, im2col, im2col_chunked (one tap: no tile)
    "1x1/2": (3, 8, 9, 9, 6, 1, 2, 0, 1),          # im2col at stride 2: taps never overlap
    "3x3/2 grouped": (3, 4, 9, 7, 6, 3, 2, 1, 2),  # im2col, overlapping taps: through the tile
    "3x3": (5, 6, 10, 10, 4, 3, 1, 1, 1),          # rows, rows_chunked: the flipped forward
    "3x3/2": (5, 6, 10, 10, 4, 3, 2, 1, 1),        # rows, rows_chunked: the scatter path
    "3x3/2 odd": (5, 6, 11, 9, 4, 3, 2, 0, 1),     # ... no padding, odd sides
    "3x3 pad 3": (3, 6, 7, 8, 4, 3, 1, 3, 1),      # ... at stride 1 (the padding is past the kernel's reach)
    "winograd": (3, 32, 8, 8, 32, 3, 1, 1, 1),     # winograd, winograd_by_position
    "1x1/2 wide": (9, 1024, 7, 7, 64, 1, 2, 0, 1),  # im2col_grouped, taps apart
    "3x3 small plane": (9, 128, 7, 7, 64, 3, 1, 1, 1),  # im2col_grouped, taps overlapping
}


def _geometry(case):
    n, cin, h, w, cout, k, s, p, groups = CASES[case]
    ho, wo = conv_output_hw((h, w), (k, k), (s, s), (p, p), (1, 1))
    return ConvGeometry(n, cin, h, w, cout, k, k, ho, wo, groups, (s, s), (p, p), (1, 1))


def _menu(case):
    g = _geometry(case)
    return conv_algorithms((g.kh, g.kw), g.stride, g.padding, g.dilation, g.groups, g)


PARAMS = [(case, algo) for case in CASES for algo in _menu(case)]


def test_the_cases_cover_every_algorithm():
    assert {algo for _, algo in PARAMS} == set(ALGOS)


@pytest.fixture(params=["compiled", "numpy"])
def paths(request, monkeypatch):
    """The compiled kernels, or their numpy twins (the row-shift's, the im2col family's weight gradient and the
    Winograd GEMMs; Winograd's transforms have no twin: without numba it is not offered)."""
    if request.param == "numpy":
        monkeypatch.setattr(cpu_conv, "rows_jit", lambda: None)
        monkeypatch.setattr(cpu_conv, "gemm_kernels", lambda: None)
        monkeypatch.setattr(cpu_winograd, "gemm_jit", lambda: None)
    return request.param


@pytest.mark.bits
@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("case, algo", PARAMS, ids=[f"{c}-{a}" for c, a in PARAMS])
def test_accumulate_is_the_plain_gradient_added(case, algo, threads, paths, monkeypatch):
    monkeypatch.setenv("MINIDL_CPU_THREADS", threads)
    g = _geometry(case)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((g.n, g.cin, g.h, g.w)).astype(np.float32)
    wt = rng.standard_normal((g.cout, g.cin // g.groups, g.kh, g.kw)).astype(np.float32)
    dy = rng.standard_normal((g.n, g.cout, g.ho, g.wo)).astype(np.float32)
    delta = rng.standard_normal(x.shape).astype(np.float32)
    conf = (g.stride, g.padding, g.dilation, g.groups, algo)
    be = CPUBackend()
    dx, dw, db = np.empty_like(x), np.empty_like(wt), np.empty(g.cout, np.float32)
    be.conv2d_backward(x, wt, dy, dx, dw, db, *conf, np.zeros(conv_workspace_bytes(algo, "bwd", g, 4), np.uint8))
    need = conv_workspace_bytes(algo, "bwd", g, 4, accumulate=True)
    got, got_dw, got_db = delta.copy(), np.empty_like(wt), np.empty(g.cout, np.float32)
    be.conv2d_backward(x, wt, dy, got, got_dw, got_db, *conf, np.zeros(need, np.uint8), accumulate=True)
    assert np.array_equal(got, delta + dx)
    assert np.array_equal(got_dw, dw) and np.array_equal(got_db, db)
    if need:
        with pytest.raises(ValueError, match=f"accumulating into dx: algorithm '{algo}' needs a flat uint8 "
                                             f"workspace of at least {need} bytes"):
            be.conv2d_backward(x, wt, dy, got, None, None, *conf, np.zeros(need - 1, np.uint8), accumulate=True)


def test_only_the_algorithms_that_sum_before_adding_need_more_workspace():
    """The tile (one sample's dx; by-position Winograd's, one group's) is added where a sum would otherwise run
    in the delta: gemm_1x1's product, overlapping taps' col2im, the row-shift's kernel rows or column taps on
    its numpy path (where the weight gradient's layout is the larger, the tile fits beside dx's: `rows` at 3x3,
    by-position Winograd here). Whole-tile Winograd adds each output as it writes it; a 1x1 or taps apart add
    each dcol once."""
    grew = {}
    for case, algo in PARAMS:
        g = _geometry(case)
        plain, acc = (conv_workspace_bytes(algo, "bwd", g, 4, accumulate=a) for a in (False, True))
        assert acc >= plain
        grew[case, algo] = acc > plain
    assert {k for k, v in grew.items() if v} == {
        ("1x1", "gemm_1x1"), ("3x3/2 grouped", "im2col"), ("3x3/2 grouped", "im2col_chunked"),
        ("3x3", "rows_chunked"), ("3x3/2", "rows"), ("3x3/2", "rows_chunked"), ("3x3/2 odd", "rows"),
        ("3x3/2 odd", "rows_chunked"), ("3x3 pad 3", "rows"), ("3x3 pad 3", "rows_chunked"),
        ("3x3 small plane", "im2col_grouped")}
    g = _geometry("1x1")
    one_sample = g.cin * g.h * g.w * 4
    assert conv_workspace_bytes("gemm_1x1", "bwd", g, 4, accumulate=True) == one_sample
    with pytest.raises(ValueError, match="only the backward accumulates"):
        conv_workspace_bytes("gemm_1x1", "fwd", g, 4, accumulate=True)
