"""The compiled ReLU (minidl/backend/cpu/eltwise_jit.py) gives the numpy kernels' values bit for bit, special
values included (NaN and inf propagate, -0.0 gives +0.0 as numpy's maximum); non-contiguous arrays take the
numpy path."""
from __future__ import annotations

import numpy as np
import pytest

from minidl.backend.cpu import backend as cpu
from minidl.backend.cpu.backend import CPUBackend

pytest.importorskip("numba")


def _data(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape).astype(dtype)
    flat = a.reshape(-1)
    flat[:6] = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45]
    return a


def _both(monkeypatch, fn):
    """fn() with the compiled kernels, then with the numpy ones."""
    assert cpu.eltwise_kernels() is not None
    got = fn()
    with monkeypatch.context() as m:
        m.setattr(cpu, "eltwise_kernels", lambda: None)
        ref = fn()
    return got, ref


@pytest.mark.parametrize("shape", [(2, 3, 5, 5), (1, 16, 32, 32), (7,)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_is_bit_identical_to_numpy(shape, dtype, monkeypatch):
    be = CPUBackend()
    x, dy = _data(shape, dtype, 0), _data(shape, dtype, 1)

    def run():
        y, dx = np.full_like(x, 7), np.full_like(x, 7)
        be.relu_forward(x, y)
        be.relu_backward(y, dy, dx)
        return y.tobytes() + dx.tobytes()
    got, ref = _both(monkeypatch, run)
    assert got == ref


def test_non_contiguous_arrays_take_the_numpy_path():
    x = _data((4, 6), np.float32, 2).T  # not C-contiguous: a flat reshape would be a copy
    y = np.empty((4, 6), np.float32).T
    assert not cpu._flat_ok(x, y) and cpu._flat_ok(np.empty(3), np.empty(3))
    CPUBackend().relu_forward(x, y)
    assert np.array_equal(y, np.maximum(x, 0), equal_nan=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("inputs", [2, 3])
def test_add_with_relu_out_is_the_add_then_the_relu(inputs, dtype, monkeypatch):
    """The compiled step's add+ReLU (`add_forward(..., relu_out=)`): y as without it, relu_out as
    `relu_forward(y)`, compiled (two inputs, one pass) or numpy, special values included; and the fused pass
    may write relu_out over an input (the plan places it there when that input dies at the add)."""
    xs = [_data((4, 5, 6, 7), dtype, seed) for seed in range(inputs)]
    be = CPUBackend()

    def fused():
        y, z = np.full_like(xs[0], 9.0), np.full_like(xs[0], 9.0)
        be.add_forward(xs, y, relu_out=z)
        return y, z

    got, ref = _both(monkeypatch, fused)
    y = np.full_like(xs[0], 9.0)
    be.add_forward(xs, y)
    z = np.full_like(y, 9.0)
    be.relu_forward(y, z)
    assert got[0].tobytes() == ref[0].tobytes() == y.tobytes() and got[1].tobytes() == ref[1].tobytes() == z.tobytes()
    if inputs == 2:
        a, b = xs[0].copy(), xs[1].copy()
        y2 = np.empty_like(a)
        be.add_forward([a, b], y2, relu_out=a)  # ReLU(y) written over the first input, as the plan may place it
        assert y2.tobytes() == y.tobytes() and a.tobytes() == z.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("live", [2, 1])
def test_add_relu_backward_is_the_relu_backward_then_the_copies(live, dtype, monkeypatch):
    """The compiled step's add+ReLU backward (`add_relu_backward`): each input gradient as `relu_backward(y, dy)`
    gives it, compiled (two gradients, one pass; a shape past one block) or numpy, special values
    included; an input gradient may lie exactly over y or dy (the plan places it there when they die here)."""
    shape = (3, 5, 33, 29)  # 14355 values: several of the kernel's blocks and a short last one
    y, dy = _data(shape, dtype, 0), _data(shape, dtype, 1)
    be = CPUBackend()
    ref_dx = np.full_like(y, 9.0)
    be.relu_backward(y, dy, ref_dx)

    def fused():
        dx, d1, d2 = (np.full_like(y, 9.0) for _ in range(3))
        be.add_relu_backward(y, dy, dx, [d1, d2] if live == 2 else [None, d2])
        return dx, d1, d2

    got, ref = _both(monkeypatch, fused)
    for out in (got, ref):
        assert out[2].tobytes() == ref_dx.tobytes()
        assert out[1].tobytes() == (ref_dx.tobytes() if live == 2 else np.full_like(y, 9.0).tobytes())
    y2, dy2, dx = y.copy(), dy.copy(), np.empty_like(y)
    be.add_relu_backward(y2, dy2, dx, [dy2, y2])  # written over what it reads, element by element
    assert dy2.tobytes() == y2.tobytes() == ref_dx.tobytes()


@pytest.mark.parametrize("workers", [2, 3, 7])
def test_split_over_workers_gives_the_same_bits(workers, monkeypatch):
    """Every compiled elementwise kernel cut into pieces (`_parallel`, block-aligned, the last piece short)
    gives the one-thread bits, accumulate included."""
    shape = (3, 7, 31, 33)  # 21483 values: pieces of several blocks and a short tail
    y, dy, b = (_data(shape, np.float32, seed) for seed in range(3))
    be = CPUBackend()

    def everything():
        out = [np.full_like(y, 9.0) for _ in range(7)]
        be.relu_forward(y, out[0])
        be.relu_backward(y, dy, out[1])
        be.add_forward([y, b], out[2], relu_out=out[3])
        be.add_relu_backward(y, dy, np.empty_like(y), [out[4], out[5]])
        np.copyto(out[6], y)
        be.accumulate(out[6], b)
        return b"".join(o.tobytes() for o in out)

    monkeypatch.setattr(cpu, "workers_for", lambda values: 1)
    one = everything()
    monkeypatch.setattr(cpu, "workers_for", lambda values: workers)
    assert everything() == one
    monkeypatch.setattr(cpu, "eltwise_kernels", lambda: None)
    assert everything() == one  # and numpy's


@pytest.mark.parametrize("workers", [1, 2])
def test_add_relu_without_keeping_the_sum(workers, monkeypatch):
    """`add_forward(..., relu_out=, keep_y=False)` (nothing reads the sum): relu_out as with the sum kept, the
    sum's buffer untouched on the compiled path; relu_out may be exactly an input."""
    monkeypatch.setattr(cpu, "workers_for", lambda values: workers)
    a, b = _data((3, 5, 33, 29), np.float32, 0), _data((3, 5, 33, 29), np.float32, 1)
    be = CPUBackend()
    y, ref = np.full_like(a, 9.0), np.full_like(a, 9.0)
    be.add_forward([a, b], y, relu_out=ref)
    y2, got = np.full_like(a, 9.0), np.full_like(a, 9.0)
    be.add_forward([a, b], y2, relu_out=got, keep_y=False)
    assert got.tobytes() == ref.tobytes() and y2.tobytes() == np.full_like(a, 9.0).tobytes()
    a2 = a.copy()
    be.add_forward([a2, b], y2, relu_out=a2, keep_y=False)
    assert a2.tobytes() == ref.tobytes()
