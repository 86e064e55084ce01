"""Half attention through cuDNN's SDPA graphs on the CUDA backend, where the plan does not keep the scores.

Host tests against the recording fake of the cuDNN frontend (tests/backend/test_cuda_host.py): the graphs' tensors
and attributes, the pointers bound at execute, one key for forward and backward's recompute, the fallback to the
kernels where cuDNN refuses a shape (forward and backward alike), float32 and kept scores never on SDPA.
gpu-marked (benchmarks/gpu_check.py's correctness part): SDPA against the CPU backend's half attention, y's bits
equal to the recomputed o, two runs bit-identical, a GPT-2 block trained with the scores dropped against kept.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from minidl.backend.cuda import cudnn_specs, halves
from minidl.backend.cuda.backend import CudnnGraphs, GraphUnsupported
from minidl.backend.cuda.plan_cache import PlanEnv, PlanStore
from tests.backend.test_cuda_half_host import FakeCublasLib, _PtrStream
from tests.backend.test_cuda_half_kernels import _StrictCupy
from tests.backend.test_cuda_host import FakeCudnn, _host_backend, _op_of, _table_by_op
from tests.backend.test_cuda_plan_cache import CachingCudnn

HALVES = [("bf16", np.dtype(np.uint16), "data_type.BFLOAT16"), ("fp16", np.dtype(np.float16), "data_type.HALF")]
F = "data_type.FLOAT"
B, T, H, D = 2, 5, 3, 8
C = H * D


def _heads(a, h=H):
    """(B, T, h*D) -> its (B, h, T, D) view, as SelfAttention._heads."""
    return a.reshape(a.shape[0], a.shape[1], h, -1).transpose(0, 2, 1, 3)


def _qkv(a, h=H):
    c = a.shape[2] // 3
    return [_heads(a[:, :, i * c:(i + 1) * c], h) for i in range(3)]


def _spec(dt=np.float16, causal=True):
    x, y = np.zeros((B, T, 3 * C), dt), np.zeros((B, T, C), dt)
    return cudnn_specs.SDPASpec.from_views(*_qkv(x), _heads(y), 1 / math.sqrt(D), causal)


def _backend(mode, fake):
    be = _host_backend(fake)
    be.cp = be.xp = _StrictCupy()                                      # no cupy arithmetic on half storage
    be.set_math(mode)
    be.compute, be._cublas_ex = _PtrStream(), (FakeCublasLib(), 77)   # the kernels' cuBLAS, where they run
    return be


def _calls(g, op):
    return [kw for name, kw in g.calls if name == op]


# -- the spec and the graphs

def test_the_spec_takes_the_layers_views_and_refuses_other_layouts():
    spec = _spec()
    assert (spec.b, spec.h, spec.t, spec.d, spec.causal, spec.dtype) == (B, H, T, D, True, "float16")
    assert spec.qkv_stride == (T * 3 * C, D, 3 * C, 1) and spec.o_stride == (T * C, D, C, 1)
    assert spec.stats_shape == (B, H, T, 1)
    assert _spec(halves.BF16).dtype == "uint16" and _spec(np.uint16) == _spec(halves.BF16)
    f = cudnn_specs.EngineFilters(half="fp16")
    assert spec.key("sdpa_fwd", f) != spec.key("sdpa_bwd", f) and spec.key("sdpa_fwd", f) == _spec().key("sdpa_fwd", f)
    assert len({_spec(causal=c).key("sdpa_fwd", f) for c in (True, False)}) == 2
    x = np.zeros((B, T, 3 * C), np.float16)
    q, k, v = _qkv(x)
    with pytest.raises(ValueError, match="views of one"):
        cudnn_specs.SDPASpec.from_views(q, np.ascontiguousarray(k), v, _heads(np.zeros((B, T, C), np.float16)),
                                        0.5, True)
    with pytest.raises(ValueError, match="share one"):
        cudnn_specs.SDPASpec.from_views(q, k, v, np.zeros((B, H, T, D + 1), np.float16), 0.5, True)
    with pytest.raises(ValueError, match="unknown attention op"):
        spec.key("sdpa", f)


def test_the_fake_takes_only_the_bindings_keywords():
    g = FakeCudnn().pygraph(handle=1)
    t = g.tensor(name="q", dim=[1, 1, 1, 8], stride=[8, 8, 8, 1])
    with pytest.raises(TypeError, match="unexpected"):
        g.sdpa(q=t, k=t, v=t, is_training=True)
    with pytest.raises(TypeError, match="unexpected"):
        g.sdpa(q=t, k=t, v=t, causal_mask=True)
    with pytest.raises(TypeError, match="missing"):
        g.sdpa_backward(q=t, k=t, v=t, o=t, dO=t)
    with pytest.raises(TypeError, match="unexpected"):
        g.sdpa_backward(q=t, k=t, v=t, o=t, dO=t, stats=t, deterministic=True)
    assert g.sdpa(q=t, k=t, v=t)[1] is None          # Stats only with generate_stats


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode,dt,cudnn_dt", HALVES)
def test_sdpa_graphs_bind_half_views_and_float32_statistics(mode, dt, cudnn_dt, causal):
    fake = FakeCudnn()
    graphs = CudnnGraphs(fake, handle=1)
    spec = _spec(halves.BF16 if mode == "bf16" else np.float16, causal)
    f = cudnn_specs.EngineFilters(half=mode)
    fwd, bwd = graphs.get(spec.key("sdpa_fwd", f)), graphs.get(spec.key("sdpa_bwd", f))
    gf, gb = fake.graphs
    for g in fake.graphs:
        assert g.kw == {"io_data_type": cudnn_dt, "intermediate_data_type": F, "compute_data_type": F, "handle": 1}
    qkv, o = [T * 3 * C, D, 3 * C, 1], [T * C, D, C, 1]
    stats = dict(dim=[B, H, T, 1], stride=[H * T, T, 1, 1])
    made = {kw["name"]: kw for g in fake.graphs for kw in _calls(g, "tensor")}
    assert {n: (kw["dim"], kw["stride"], kw["data_type"]) for n, kw in made.items()} == {
        "q": ([B, H, T, D], qkv, cudnn_dt), "k": ([B, H, T, D], qkv, cudnn_dt), "v": ([B, H, T, D], qkv, cudnn_dt),
        "o": ([B, H, T, D], o, cudnn_dt), "do": ([B, H, T, D], o, cudnn_dt),
        "stats": (stats["dim"], stats["stride"], F)}
    mask = {"diagonal_alignment": "diagonal_alignment.TOP_LEFT", "diagonal_band_right_bound": 0} if causal else {}
    (kw,) = _calls(gf, "sdpa")
    t = fwd.tensors
    assert kw == {"q": t["q"], "k": t["k"], "v": t["v"], "attn_scale": 1 / math.sqrt(D), "generate_stats": True,
                  "compute_data_type": F, "name": "sdpa_fwd", **mask}
    assert (t["o"].origin, t["o"].output, t["o"].dim, t["o"].stride, t["o"].data_type) == \
        ("sdpa::O", True, [B, H, T, D], o, cudnn_dt)
    assert (t["stats"].origin, t["stats"].output, t["stats"].dim, t["stats"].stride, t["stats"].data_type) == \
        ("sdpa::Stats", True, stats["dim"], stats["stride"], F)
    (kw,) = _calls(gb, "sdpa_backward")
    t = bwd.tensors
    assert kw == {"q": t["q"], "k": t["k"], "v": t["v"], "o": t["o"], "dO": t["do"], "stats": t["stats"],
                  "attn_scale": 1 / math.sqrt(D), "use_deterministic_algorithm": True, "compute_data_type": F,
                  "name": "sdpa_bwd", **mask}
    for name, port in (("dq", "dQ"), ("dk", "dK"), ("dv", "dV")):
        assert (t[name].origin, t[name].output, t[name].dim, t[name].stride, t[name].data_type) == \
            (f"sdpa_backward::{port}", True, [B, H, T, D], qkv, cudnn_dt)
    assert set(fwd.tensors) == {"q", "k", "v", "o", "stats"}
    assert set(bwd.tensors) == {"q", "k", "v", "o", "do", "stats", "dq", "dk", "dv"}


def test_an_sdpa_graph_is_refused_rather_than_relaxed_and_validates_refusals_are_unsupported():
    """Without the engine filters (NONDETERMINISTIC deselected) a convolution is built on whatever is left; attention
    is refused instead (its kernels sum in a fixed order). cuDNN's not-supported at validate is a refusal; any
    other error there is a malformed graph and propagates."""
    f = cudnn_specs.EngineFilters(half="fp16")
    fake = FakeCudnn(unsupported=lambda g: bool(g.deselected))
    with pytest.raises(GraphUnsupported, match="cannot run sdpa_bwd"):
        CudnnGraphs(fake, handle=1).get(_spec().key("sdpa_bwd", f))
    assert len(fake.graphs) == 1 and fake.graphs[0].deselected == ["numerical_note.DOWN_CONVERT_INPUTS",
                                                                   "numerical_note.NONDETERMINISTIC"]
    fake = FakeCudnn(refuse_at_validate=lambda g: True)
    with pytest.raises(GraphUnsupported, match="cudnnGraphNotSupportedError: head dim not supported"):
        CudnnGraphs(fake, handle=1).get(_spec().key("sdpa_fwd", f))
    fake = FakeCudnn()
    fake.refuse_at_validate = lambda g: (_ for _ in ()).throw(ValueError("The dim for Q is invalid"))
    with pytest.raises(ValueError, match="dim for Q"):
        CudnnGraphs(fake, handle=1).get(_spec().key("sdpa_fwd", f))


def test_sdpa_graphs_go_through_the_plan_cache(tmp_path):
    """A second process loads both graphs' one plan (the key's repr is the same in every process: no pointer)."""
    tables = {"sdpa": [(0, "f0", False), (4096, "f1", True)], "sdpa_backward": [(8192, "b0", True)]}
    f = cudnn_specs.EngineFilters(half="fp16")
    keys = [_spec().key(op, f) for op in cudnn_specs.SDPA_OPS]
    assert "0x" not in repr(keys) and [repr(k) for k in keys] == [repr(_spec().key(op, f)) for op in
                                                                   cudnn_specs.SDPA_OPS]
    store = PlanStore(tmp_path, PlanEnv("H100", "9.0", "91900", "1.32.0"))
    cold = [CudnnGraphs(CachingCudnn(tables), handle=1, store=store).get(k) for k in keys]
    fake = CachingCudnn(tables)
    graphs = CudnnGraphs(fake, handle=1, store=store)
    warm = [graphs.get(k) for k in keys]
    assert [w.plans for w in warm] == [c.plans for c in cold] == [[cudnn_specs.PlanInfo(1, "f1", 4096)],
                                                                  [cudnn_specs.PlanInfo(0, "b0", 8192)]]
    assert graphs.stats["loaded"] == 2 and fake.builds == []


# -- the backend's dispatch

def _layer_arrays(dt, seed=0):
    """The attention layer's tensors in storage `dt`: its input (B, T, 3C) and output (B, T, C), dy, the delta."""
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        x = rng.standard_normal((B, T, 3 * C)).astype(np.float32).astype(halves.host_dtype(dt)).view(dt)
        dy = rng.standard_normal((B, T, C)).astype(np.float32).astype(halves.host_dtype(dt)).view(dt)
    return x, np.zeros((B, T, C), dt), dy, np.zeros((B, T, 3 * C), dt)


SDPA_TABLES = {"sdpa": [(4096, "sdpa_f", True)], "sdpa_backward": [(8192, "sdpa_b", True)]}


@pytest.mark.parametrize("mode,dt,cudnn_dt", HALVES)
def test_unkept_half_attention_runs_sdpa_with_the_same_graph_for_forward_and_backwards_recompute(mode, dt,
                                                                                                 cudnn_dt):
    fake = FakeCudnn(plans=_table_by_op(SDPA_TABLES))
    be = _backend(mode, fake)
    x, y, dy, dx = _layer_arrays(dt)
    (q, k, v), (dq, dk, dv) = _qkv(x), _qkv(dx)
    scale = 1 / math.sqrt(D)
    be.attention_forward(q, k, v, None, _heads(y), scale, True, fused=True)
    (ex,) = fake.executions
    fwd = be.graphs.get(_spec(dt).key("sdpa_fwd", be.filters))
    t, stats = fwd.tensors, be.side.bufs["attn_stats"]
    item = dt.itemsize
    assert ex.graph is fwd.runners[0].graph and ex.index == 0
    assert ex.pack == {t["q"]: x.ctypes.data, t["k"]: x.ctypes.data + C * item, t["v"]: x.ctypes.data + 2 * C * item,
                       t["o"]: y.ctypes.data, t["stats"]: stats.ctypes.data}
    assert stats.shape == (B, H, T, 1) and stats.dtype == np.float32
    assert ex.workspace == be.side.bufs["graph_workspace"].ctypes.data and be.side.bufs["graph_workspace"].size == 4096
    assert not be.launches and not be.fallbacks
    be.attention_forward(q, k, v, None, _heads(y), scale, True, fused=True)   # inference, a recomputation: the same
    assert fake.executions[1].graph is ex.graph and fake.executions[1].pack == ex.pack
    fake.executions.clear()
    be.attention_backward(q, k, v, None, _heads(dy), dq, dk, dv, scale, True, fused=True)
    again, back = fake.executions
    bwd = be.graphs.get(_spec(dt).key("sdpa_bwd", be.filters))
    o = be.side.bufs["attn_o"]
    # o again by forward's graph and plan, in dy's layout (y's): the same key, so y's bits
    assert again.graph is ex.graph and again.index == ex.index
    assert again.pack == {**ex.pack, t["o"]: o.ctypes.data}
    assert o.dtype == dt and o.size == B * T * C
    tb = bwd.tensors
    assert back.graph is bwd.runners[0].graph
    assert back.pack == {tb["q"]: x.ctypes.data, tb["k"]: x.ctypes.data + C * item,
                         tb["v"]: x.ctypes.data + 2 * C * item, tb["o"]: o.ctypes.data, tb["do"]: dy.ctypes.data,
                         tb["stats"]: stats.ctypes.data, tb["dq"]: dx.ctypes.data,
                         tb["dk"]: dx.ctypes.data + C * item, tb["dv"]: dx.ctypes.data + 2 * C * item}
    assert back.workspace == be.side.bufs["graph_workspace"].ctypes.data
    assert be.side.bufs["graph_workspace"].size == 8192
    assert be.graphs.ops() == {"sdpa_fwd", "sdpa_bwd"} and len(fake.graphs) == 2 and not be.launches
    with pytest.raises(ValueError, match="dq, dk and dv must have q's layout"):
        be.attention_backward(q, k, v, None, _heads(dy), np.zeros((B, H, T, D), dt), dk, dv, scale, True,
                              fused=True)
    # kept scores, scores a plan drops (not fused: rebuilt with the kernels' bits), and float32 run the kernels: no
    # other graph, no other execution
    fake.executions.clear()
    probs = np.zeros((B, H, T, T), dt)
    be.attention_forward(q, k, v, probs, _heads(y), scale, True, fused=True)
    be.attention_backward(q, k, v, probs, _heads(dy), dq, dk, dv, scale, True, fused=True)
    be.attention_forward(q, k, v, None, _heads(y), scale, True)
    be.attention_backward(q, k, v, None, _heads(dy), dq, dk, dv, scale, True)
    f32 = _backend("fp32", fake)
    x, y, dy, dx = _layer_arrays(np.dtype(np.float32))
    (q, k, v), (dq, dk, dv) = _qkv(x), _qkv(dx)
    f32.attention_forward(q, k, v, None, _heads(y), scale, True, fused=True)
    f32.attention_backward(q, k, v, None, _heads(dy), dq, dk, dv, scale, True, fused=True)
    assert be.launches and f32.launches and len(fake.graphs) == 2 and not fake.executions


@pytest.mark.parametrize("refused", ["sdpa", "sdpa_backward"])
@pytest.mark.parametrize("mode,dt,cudnn_dt", HALVES)
def test_a_shape_cudnn_refuses_runs_the_kernels_forward_and_backward(mode, dt, cudnn_dt, refused):
    """cuDNN refusing the causal shape's forward or backward graph: the reason in `fallbacks`, the kernels for that
    shape in forward (before any backward asked) and in backward, decided once; the unmasked shape runs SDPA."""
    def causal(g):
        return any("diagonal_band_right_bound" in kw for _, kw in g.calls)
    fake = FakeCudnn(unsupported=lambda g: _op_of(g) == refused and causal(g))
    be = _backend(mode, fake)
    x, y, dy, dx = _layer_arrays(dt)
    (q, k, v), (dq, dk, dv) = _qkv(x), _qkv(dx)
    be.attention_forward(q, k, v, None, _heads(y), 0.5, True, fused=True)
    op = {"sdpa": "sdpa_fwd", "sdpa_backward": "sdpa_bwd"}[refused]
    assert list(be.fallbacks) == [op] and "no engine" in be.fallbacks[op]
    assert not fake.executions and halves.variant("round_copy", mode) in [r.name for r in be.launches]
    built = len(fake.graphs)
    be.launches.clear()
    be.attention_backward(q, k, v, None, _heads(dy), dq, dk, dv, 0.5, True, fused=True)
    be.attention_forward(q, k, v, None, _heads(y), 0.5, True, fused=True)
    assert not fake.executions and len(fake.graphs) == built
    assert "softmax_backward" in [r.name for r in be.launches]
    be.launches.clear()
    be.attention_forward(q, k, v, None, _heads(y), 0.5, False, fused=True)
    be.attention_backward(q, k, v, None, _heads(dy), dq, dk, dv, 0.5, False, fused=True)
    assert [_op_of(e.graph) for e in fake.executions] == ["sdpa", "sdpa", "sdpa_backward"] and not be.launches


# -- on a GPU: cuDNN's SDPA against the CPU backend's half attention

#: GPT-2's head size (D = 64) on two heads of 64 tokens; the GPT-2 block below has these shapes, so it runs the
#: graphs the conformance tests built.
GB, GT, GH, GD = 2, 64, 2, 64
GC = GH * GD
HOST = {"bf16": halves.BF16, "fp16": np.dtype(np.float16)}
#: max |SDPA - CPU| / max |CPU| per output: a flash kernel sums in its own order and blocks, and its backward takes
#: rowsum(dO o) where the CPU's takes rowsum(dP P); 4 units of the half's last place for y, 16 for the gradients.
GPU_TOL = {"y": {"bf16": 4 * 2.0**-8, "fp16": 4 * 2.0**-11}, "grad": {"bf16": 16 * 2.0**-8, "fp16": 16 * 2.0**-11}}


def _device(mode):
    from .cuda_device import cuda_backend

    return cuda_backend(mode)


def _host_half(mode, shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(HOST[mode])


def _cpu_attention(x, dy, causal):
    from minidl.backend.cpu.backend import CPUBackend

    cpu = CPUBackend()
    y, dx = np.zeros(dy.shape, x.dtype), np.zeros(x.shape, x.dtype)
    cpu.attention_forward(*_qkv(x, GH), None, _heads(y, GH), 1 / math.sqrt(GD), causal)
    cpu.attention_backward(*_qkv(x, GH), None, _heads(dy, GH), *_qkv(dx, GH), 1 / math.sqrt(GD), causal)
    return y, dx


def _sdpa_attention(be, x, dy, causal):
    """y, dx and the o backward recomputed, on the device in the layer's layout (views of (B, T, 3C), (B, T, C))."""
    def dev(a):
        d = be.cp.empty(a.shape, halves.storage_dtype(a.dtype))
        be.copy_in(d, a)
        return d
    xd, dyd = dev(x), dev(dy)
    yd, dxd = be.cp.zeros(dyd.shape, dyd.dtype), be.cp.zeros(xd.shape, xd.dtype)
    be.attention_forward(*_qkv(xd, GH), None, _heads(yd, GH), 1 / math.sqrt(GD), causal, fused=True)
    be.attention_backward(*_qkv(xd, GH), None, _heads(dyd, GH), *_qkv(dxd, GH), 1 / math.sqrt(GD), causal,
                          fused=True)
    o = be.to_host(be.cp.ascontiguousarray(be._side_like("attn_o", _heads(dyd, GH))))
    assert not set(cudnn_specs.SDPA_OPS) & set(be.fallbacks), be.fallbacks
    assert {"sdpa_fwd", "sdpa_bwd"} <= be.graphs.ops()
    return be.to_host(yd), be.to_host(dxd), o


def _rel(got, ref):
    g, r = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(g - r).max() / np.abs(r).max())


@pytest.mark.gpu
@pytest.mark.parametrize("mode,causal", [("bf16", True), ("bf16", False), ("fp16", True)])
def test_sdpa_matches_the_cpus_half_attention(mode, causal):
    x, dy = _host_half(mode, (GB, GT, 3 * GC), 0), _host_half(mode, (GB, GT, GC), 1)
    y_ref, dx_ref = _cpu_attention(x, dy, causal)
    y, dx, _ = _sdpa_attention(_device(mode), x, dy, causal)
    assert y.dtype == dx.dtype == HOST[mode]
    assert _rel(y, y_ref) <= GPU_TOL["y"][mode]
    for name, got, ref in zip("qkv", _qkv(dx, GH), _qkv(dx_ref, GH)):
        assert _rel(got, ref) <= GPU_TOL["grad"][mode], f"d{name}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_y_is_the_recomputed_o_and_two_runs_are_bit_identical(mode):
    x, dy = _host_half(mode, (GB, GT, 3 * GC), 2), _host_half(mode, (GB, GT, GC), 3)
    be = _device(mode)
    y, dx, o = _sdpa_attention(be, x, dy, True)
    bits = lambda a: np.ascontiguousarray(a).view(np.uint16)   # noqa: E731
    assert np.array_equal(bits(o), bits(_heads(y, GH)))
    y2, dx2, _ = _sdpa_attention(be, x, dy, True)
    assert np.array_equal(bits(y2), bits(y)) and np.array_equal(bits(dx2), bits(dx))


@pytest.mark.gpu
def test_a_gpt2_block_trains_with_its_scores_dropped_as_with_them_kept():
    """Two bf16 steps of a GPT-2 block (D = 64): keep_scores=False (SDPA) against kept (the kernels), per parameter
    the update within 5% (relative norm), the losses within 1%."""
    from minidl.models import build_model
    from minidl.optim import SGD
    from minidl.runtime.session import Session

    be = _device("bf16")
    vocab = 96
    tokens = np.random.default_rng(0).integers(0, vocab, (2, GB, GT + 1))

    def run(keep):
        net = build_model("gpt2", layers=1, heads=GH, width=GC, seq=GT, batch=GB, num_classes=vocab, dropout=0.0,
                          keep_scores=keep)
        sess = Session(net, SGD(lr=0.1, momentum=0.9), policy="none", seed=0, backend=be, math="bf16")
        start = {k: np.array(v, copy=True) for k, v in sess.executor.state_dict().items()}
        losses = [sess.executor.train_step(np.ascontiguousarray(t[:, :-1]), np.ascontiguousarray(t[:, 1:]))
                  for t in tokens]
        return losses, {k: np.asarray(v, np.float64) - start[k] for k, v in sess.executor.state_dict().items()}

    kept_losses, kept = run(True)
    dropped_losses, dropped = run(False)
    assert {"sdpa_fwd", "sdpa_bwd"} <= be.graphs.ops() and not set(cudnn_specs.SDPA_OPS) & set(be.fallbacks)
    np.testing.assert_allclose(dropped_losses, kept_losses, rtol=1e-2)
    for name, step in kept.items():
        if np.linalg.norm(step):
            assert np.linalg.norm(dropped[name] - step) <= 0.05 * np.linalg.norm(step), name
