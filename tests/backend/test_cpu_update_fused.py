"""The fused optimizer update (minidl/backend/cpu/update*.py, `Optimizer.prepare`) against the per-parameter
update the interpreted executor runs: bit-identical parameters and state, for every option of SGD and Adam, in
float32 and float64, with fused groups, with parameters left out of them (not contiguous), and without numba."""
from __future__ import annotations

import numpy as np
import pytest

from minidl.backend.cpu import update as cpu_update
from minidl.backend.cpu.backend import CPUBackend
from minidl.optim import SGD, Adam

SHAPES = [(16, 3, 3, 3), (16,), (10, 64), (1,), (7, 5)]


class _Arena:
    """Views carved from one byte buffer at 512-byte-aligned offsets, in a shuffled order (as the pool does)."""

    def __init__(self, nbytes: int):
        self.raw = np.zeros(nbytes, np.uint8)
        self.pos = 0

    def take(self, shape, dtype) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        v = self.raw[self.pos:self.pos + n].view(dtype).reshape(shape)
        self.pos += -(-n // 512) * 512
        return v


def _items(opt, dtype, seed, layout="arena"):
    """(param, grad, state) items: all in one arena, one not C-contiguous ("strided"), or each in its own
    buffer ("separate", as a paged arena's views)."""
    rng = np.random.default_rng(seed)
    arena = _Arena(1 << 20)
    order = rng.permutation(len(SHAPES) * (2 + len(opt.slots)))  # where each tensor goes in the arena
    slots = {}
    for k in order:
        shape = SHAPES[k % len(SHAPES)]
        slots[int(k)] = arena.take(shape, dtype) if layout != "separate" else np.zeros(shape, dtype)
    items = []
    for k, shape in enumerate(SHAPES):
        p, g = slots[k], slots[len(SHAPES) + k]
        p[...] = rng.standard_normal(shape)
        g[...] = rng.standard_normal(shape)
        if layout == "strided" and k == len(SHAPES) - 1:  # a transposed view: updated on its own
            p = p.T
        state = {s: slots[(2 + i) * len(SHAPES) + k] for i, s in enumerate(opt.slots)}
        if layout == "strided" and k == len(SHAPES) - 1:
            g = np.ascontiguousarray(g.T)
            state = {s: np.zeros(p.shape, dtype) for s in opt.slots}
        items.append((p, g, state))
    return items


def _snapshot(items):
    return [(p.tobytes(), *(state[s].tobytes() for s in sorted(state))) for p, _, state in items]


def _new_grads(items, rng):
    for _, g, _ in items:
        g[...] = rng.standard_normal(g.shape)


OPTS = [SGD(lr=0.1), SGD(lr=0.1, momentum=0.9), SGD(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=1e-3),
        SGD(lr=0.05, momentum=0.8, nesterov=True, weight_decay=5e-4), Adam(lr=1e-3), Adam(lr=3e-3, weight_decay=0.01)]


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: repr(o.config()))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["arena", "strided", "separate"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_fused_update_is_bit_identical_to_per_parameter(opt, dtype, layout, workers, monkeypatch):
    """On one thread or split over workers (each takes its share of every parameter, some shares empty)."""
    monkeypatch.setattr(cpu_update, "workers_for", lambda values: workers)
    be = CPUBackend()
    fused, single = _items(opt, dtype, 0, layout), _items(opt, dtype, 0, layout)
    groups, rest = be.fuse_update(fused, opt.slots)
    left = {"arena": 0, "strided": 1, "separate": len(SHAPES)}[layout]
    assert sum(g.count for g in groups) == len(SHAPES) - left and len(rest) == left
    run = opt.prepare(be, fused)
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(1)
    for step in range(4):  # the first step (momentum buffer = gradient) and later ones
        run(step)
        for p, g, state in single:
            opt.update(be, p, g, state, step)
        assert _snapshot(fused) == _snapshot(single), f"step {step}"
        _new_grads(fused, rng_a)
        _new_grads(single, rng_b)


def test_learning_rate_changes_reach_the_prepared_update():
    be, opt = CPUBackend(), SGD(lr=0.1, momentum=0.9)
    fused, single = _items(opt, np.float32, 2), _items(opt, np.float32, 2)
    run = opt.prepare(be, fused)
    for step, lr in enumerate((0.1, 0.01, 0.5)):
        opt.lr = lr  # what a learning-rate schedule does between steps
        run(step)
        for p, g, state in single:
            opt.update(be, p, g, state, step)
    assert _snapshot(fused) == _snapshot(single)


def test_without_numba_nothing_is_fused_and_the_result_is_the_same(monkeypatch):
    monkeypatch.setattr(cpu_update, "jit_kernels", lambda: None)
    be, opt = CPUBackend(), Adam(lr=1e-3)
    fused, single = _items(opt, np.float32, 3), _items(opt, np.float32, 3)
    assert be.fuse_update(fused, opt.slots) == ([], fused)
    opt.prepare(be, fused)(0)
    for p, g, state in single:
        opt.update(be, p, g, state, 0)
    assert _snapshot(fused) == _snapshot(single)
