"""The CPU backend: numpy kernels, the reference implementation. Every kernel writes into arrays it is given
(views into the arena) and allocates only bounded scratch (`CHUNK`) outside the pool: the budget is real.
`CPUBackend` gathers each family's kernels so layers dispatch once, through `be.<op>`.
"""
from __future__ import annotations

import functools
import math
from contextlib import ExitStack, nullcontext

import numpy as np

from ...core.errors import OptionError
from ..base import FUSES_ADD_RELU, FUSES_ADD_RELU_BACKWARD, FUSES_BATCHNORM_RELU, Capabilities
from ..common import HostClock, dropout_keep_mask
from ..precision import is_half
from . import lanes
from .conv import ConvOps
from .half import HALF_KERNELS, Staging, StagingTrace, cast_into, half_io, narrow_into, widen_into
from .jit import lazy, workers_for
from .menu import CPU_MENU, CPUMenu
from .norm import NormOps
from .pooling import PoolOps
from .seq import SEQ_KERNELS, SeqOps
from .update import UpdateOps

CHUNK = 1 << 16  # elements per chunk of elementwise work: bounds stray temporaries to ~512 KiB


eltwise_kernels = lazy("eltwise_jit")  # None without numba
loss_kernels = lazy("loss_jit")


def _elementwise(name: str, *arrays: np.ndarray) -> None:
    """`cpu.eltwise_jit.<name>` on flat views, split over `workers_for` threads (elementwise: same bits)."""
    jit = eltwise_kernels()
    flat = [a.reshape(-1) for a in arrays]
    workers = workers_for(flat[-1].size)
    if workers > 1:
        getattr(jit, name + "_parallel")(*flat, workers)
    else:
        getattr(jit, name)(*flat)


def _flat_ok(*arrays: np.ndarray) -> bool:
    """All C-contiguous numpy arrays of one dtype."""
    dt = arrays[0].dtype
    return all(isinstance(a, np.ndarray) and a.flags.c_contiguous and a.dtype == dt for a in arrays)


def _chunks(n: int):
    for s in range(0, n, CHUNK):
        yield slice(s, min(n, s + CHUNK))


class CoreOps:
    """Elementwise, dense, loss and optimizer kernels."""

    profile = "cpu"  # the simulator profile its plans assume
    xp = np

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def copy_in(self, dst: np.ndarray, src) -> None:
        """dst = src; into a half dst, rounded once from float32 (the loaders' dtype)."""
        if is_half(dst.dtype):
            cast_into(dst, np.asarray(src, dtype=np.float32).reshape(dst.shape))
            return
        np.copyto(dst, np.asarray(src, dtype=dst.dtype).reshape(dst.shape))

    def fill(self, dst: np.ndarray, value: float) -> None:
        dst.fill(value)

    def fill_loss_scale(self, dst: np.ndarray, scale: float) -> None:
        dst.fill(scale)

    def unscale(self, g: np.ndarray, inv_scale: float) -> None:
        np.multiply(g, np.float32(inv_scale), out=g)

    def accumulate(self, dst: np.ndarray, src: np.ndarray) -> None:
        if eltwise_kernels() is not None and _flat_ok(dst, src) and workers_for(dst.size) > 1:
            _elementwise("add_into", dst, src)  # one thread: numpy is as fast
            return
        np.add(dst, src, out=dst)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """dst = src; between half and float32, widened exactly or rounded to nearest even."""
        if is_half(dst.dtype) or is_half(src.dtype):
            cast_into(dst, src)
        else:
            np.copyto(dst, src)

    def relu_forward(self, x: np.ndarray, y: np.ndarray) -> None:
        jit = eltwise_kernels()
        if jit is not None and _flat_ok(x, y):
            _elementwise("relu_forward", x, y)  # ~4x faster
            return
        np.maximum(x, 0, out=y)

    def relu_backward(self, y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:
        jit = eltwise_kernels()
        if jit is not None and _flat_ok(y, dy, dx):
            _elementwise("relu_backward", y, dy, dx)
            return
        # inf * 0 = NaN, as compiled: a value for the guard
        yf, dyf, dxf = y.reshape(-1), dy.reshape(-1), dx.reshape(-1)
        with np.errstate(invalid="ignore"):
            for s in _chunks(yf.size):
                np.multiply(dyf[s], yf[s] > 0, out=dxf[s])

    def add_forward(self, xs: list[np.ndarray], y: np.ndarray, relu_out: np.ndarray | None = None,
                    keep_y: bool = True) -> None:
        """y = the sum of xs, in order; with `relu_out`, also ReLU(y) (one pass for two flat inputs, y unwritten
        without `keep_y`)."""
        jit = eltwise_kernels() if relu_out is not None and len(xs) == 2 else None
        if jit is not None and _flat_ok(xs[0], xs[1], y, relu_out):
            if keep_y:
                _elementwise("add_relu", xs[0], xs[1], y, relu_out)
            else:
                _elementwise("add_relu_only", xs[0], xs[1], relu_out)
            return
        np.add(xs[0], xs[1], out=y)
        for x in xs[2:]:
            np.add(y, x, out=y)
        if relu_out is not None:
            self.relu_forward(y, relu_out)

    def add_relu_backward(self, y: np.ndarray, dy: np.ndarray, dx: np.ndarray,
                          dinputs: list[np.ndarray | None]) -> None:
        """A ReLU's backward and the add's before it in one call (two flat input gradients: one pass, dx unwritten)."""
        jit = eltwise_kernels()
        live = [d for d in dinputs if d is not None]
        if jit is not None and len(live) == 2 and _flat_ok(y, dy, *live):
            _elementwise("relu_backward_add", y, dy, live[0], live[1])
            return
        self.relu_backward(y, dy, dx)
        for d in live:
            self.copy(d, dx)

    def concat_forward(self, xs: list[np.ndarray], y: np.ndarray) -> None:
        c = 0
        for x in xs:
            y[:, c:c + x.shape[1]] = x
            c += x.shape[1]

    def concat_backward(self, dy: np.ndarray, dxs: list[np.ndarray | None], channels: list[int]) -> None:
        c = 0
        for dx, ch in zip(dxs, channels):
            if dx is not None:
                dx[...] = dy[:, c:c + ch]
            c += ch

    def linear_forward(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, y: np.ndarray) -> None:
        lanes.matmul(x.reshape(x.shape[0], -1), w.T, y)
        if b is not None:
            y += b

    def linear_backward(self, x: np.ndarray, w: np.ndarray, dy: np.ndarray, dx: np.ndarray | None,
                        dw: np.ndarray | None, db: np.ndarray | None) -> None:
        if dx is not None:
            lanes.matmul(dy, w, dx.reshape(dx.shape[0], -1))
        if dw is not None:
            lanes.matmul(dy.T, x.reshape(x.shape[0], -1), dw)
        if db is not None:
            np.sum(dy, axis=0, out=db)

    # dropout's mask is replayed from a counter-based RNG, never stored
    def dropout_forward(self, x: np.ndarray, y: np.ndarray, p: float, key: int) -> None:
        self._dropout(x, y, p, key)

    def dropout_backward(self, dy: np.ndarray, dx: np.ndarray, p: float, key: int) -> None:
        self._dropout(dy, dx, p, key)

    def _dropout(self, src: np.ndarray, dst: np.ndarray, p: float, key: int) -> None:
        """dst = src * keep / (1 - p); half arrays in float32 a chunk at a time."""
        half = is_half(src.dtype)
        scale = np.float32(1.0 / (1.0 - p)) if half else src.dtype.type(1.0 / (1.0 - p))
        sf, df = src.reshape(-1), dst.reshape(-1)
        for s in _chunks(sf.size):
            # keep[i] depends only on key + i
            keep = dropout_keep_mask((key + s.start) & 0xFFFFFFFFFFFFFFFF, s.stop - s.start, p)
            if not half:
                np.multiply(sf[s], keep * scale, out=df[s])
                continue
            f = self.staging.chunks(CHUNK)[:s.stop - s.start]
            widen_into(f, sf[s])
            np.multiply(f, keep * scale, out=f)
            narrow_into(df[s], f)

    def softmax_xent_forward(self, logits: np.ndarray, labels: np.ndarray, loss: np.ndarray) -> None:
        if self._xent_jit_forward(logits, labels, loss, None):
            return
        z = logits - logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=1))
        picked = z[np.arange(z.shape[0]), labels]
        loss[...] = np.mean(lse - picked, dtype=logits.dtype)

    def softmax_xent_backward(self, logits: np.ndarray, labels: np.ndarray, dloss: np.ndarray,
                              dlogits: np.ndarray) -> None:
        n = logits.shape[0]
        if self._xent_jit_backward(logits, labels, dloss, dlogits, None, n):
            return
        np.subtract(logits, logits.max(axis=1, keepdims=True), out=dlogits)
        np.exp(dlogits, out=dlogits)
        dlogits /= dlogits.sum(axis=1, keepdims=True)
        dlogits[np.arange(n), labels] -= 1
        dlogits *= dloss.reshape(()) / logits.dtype.type(n)

    def softmax_xent_ignore_forward(self, logits: np.ndarray, labels: np.ndarray, loss: np.ndarray,
                                    ignore_index: int) -> None:
        """The mean over rows whose label is not `ignore_index` (NaN if none, as PyTorch)."""
        if self._xent_jit_forward(logits, labels, loss, ignore_index):
            return
        valid = labels != ignore_index
        z = logits - logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=1))
        picked = z[np.arange(z.shape[0]), np.where(valid, labels, 0)]
        with np.errstate(invalid="ignore", divide="ignore"):
            loss[...] = np.sum((lse - picked)[valid], dtype=logits.dtype) / logits.dtype.type(valid.sum())

    def softmax_xent_ignore_backward(self, logits: np.ndarray, labels: np.ndarray, dloss: np.ndarray,
                                     dlogits: np.ndarray, ignore_index: int) -> None:
        """(softmax - one-hot) / (rows not ignored) on those rows, zeros on the others."""
        valid = labels != ignore_index
        if self._xent_jit_backward(logits, labels, dloss, dlogits, ignore_index, int(np.count_nonzero(valid))):
            return
        np.subtract(logits, logits.max(axis=1, keepdims=True), out=dlogits)
        np.exp(dlogits, out=dlogits)
        dlogits /= dlogits.sum(axis=1, keepdims=True)
        rows = np.flatnonzero(valid)
        dlogits[rows, labels[rows]] -= 1
        dlogits[~valid] = 0
        with np.errstate(invalid="ignore", divide="ignore"):
            dlogits *= dloss.reshape(()) / logits.dtype.type(rows.size)

    @staticmethod
    def _xent_jit_forward(logits, labels, loss, ignore_index) -> bool:
        """The compiled loss into `loss` if numba loads and the arrays are plain: whether it ran."""
        jit = loss_kernels()
        if jit is None or not (_flat_ok(logits) and isinstance(labels, np.ndarray) and labels.flags.c_contiguous):
            return False
        losses = np.empty(logits.shape[0])
        args = (logits, labels, 0 if ignore_index is None else int(ignore_index), ignore_index is not None, losses)
        workers = workers_for(logits.size)
        loss[...] = jit.xent_forward_parallel(*args, workers) if workers > 1 else jit.xent_forward(*args)
        return True

    @staticmethod
    def _xent_jit_backward(logits, labels, dloss, dlogits, ignore_index, count: int) -> bool:
        """The compiled gradient into `dlogits`, scaled by dloss / count: whether it ran."""
        jit = loss_kernels()
        if jit is None or not (_flat_ok(logits, dlogits) and isinstance(labels, np.ndarray)
                               and labels.flags.c_contiguous):
            return False
        scale = float(np.asarray(dloss).reshape(())) / count if count else math.nan
        args = (logits, labels, 0 if ignore_index is None else int(ignore_index), ignore_index is not None, scale,
                dlogits)
        workers = workers_for(logits.size)
        if workers > 1:
            jit.xent_backward_parallel(*args, workers)
        else:
            jit.xent_backward(*args)
        return True

    # optimizers: PyTorch's semantics, chunked
    def sgd_update(self, p: np.ndarray, g: np.ndarray, buf: np.ndarray | None, lr: float, momentum: float,
                   dampening: float, weight_decay: float, nesterov: bool, first_step: bool) -> None:
        pf, gf = p.reshape(-1), g.reshape(-1)
        bf = buf.reshape(-1) if buf is not None else None
        t = p.dtype.type
        for s in _chunks(pf.size):
            d = gf[s]
            if weight_decay:
                d = d + t(weight_decay) * pf[s]
            if bf is not None and momentum:
                if first_step:
                    bf[s] = d
                else:
                    bf[s] *= t(momentum)
                    bf[s] += t(1 - dampening) * d
                d = d + t(momentum) * bf[s] if nesterov else bf[s]
            pf[s] -= t(lr) * d

    def adam_update(self, p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, lr: float, beta1: float,
                    beta2: float, eps: float, weight_decay: float, step: int) -> None:
        pf, gf, mf, vf = p.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1)
        t = p.dtype.type
        bc1 = 1 - beta1 ** step
        bc2_sqrt = float(np.sqrt(1 - beta2 ** step))
        step_size = t(lr / bc1)
        for s in _chunks(pf.size):
            d = gf[s]
            if weight_decay:
                d = d + t(weight_decay) * pf[s]
            mf[s] += t(1 - beta1) * (d - mf[s])
            vf[s] *= t(beta2)
            vf[s] += t(1 - beta2) * d * d
            denom = np.sqrt(vf[s]) / t(bc2_sqrt) + t(eps)
            pf[s] -= step_size * (mf[s] / denom)


@half_io
class CPUBackend(CoreOps, ConvOps, PoolOps, NormOps, UpdateOps, SeqOps):
    """numpy backend, the reference; its kernels take bf16/fp16 arrays too (`half_io`: float32 on copies)."""

    capabilities = Capabilities(
        name="cpu", device="host", kernels=SEQ_KERNELS | {"softmax_xent_ignore_forward",
                                                          "softmax_xent_ignore_backward"},
        fuses=frozenset({FUSES_BATCHNORM_RELU, FUSES_ADD_RELU, FUSES_ADD_RELU_BACKWARD}), fused_update=True,
        paged_arena=True, half_kernels=HALF_KERNELS, half_staging=True)

    @functools.cached_property
    def staging(self) -> Staging:
        """Where the half kernels keep their float32 copies (`cpu.half`)."""
        return Staging()

    def staging_trace(self) -> StagingTrace:
        """A dry run of these kernels counting their staging."""
        return StagingTrace(self)

    menu: CPUMenu = CPU_MENU

    def __init__(self, menu: CPUMenu = CPU_MENU):
        self.menu = menu

    def compute_scope(self):
        """Kernels run on the calling thread."""
        return nullcontext()

    def synchronize(self) -> None:
        """Every kernel has finished when it returns."""

    def arena_backing(self):
        """None: the pool's own numpy arena."""
        return None

    def call_clock(self) -> HostClock:
        """A call's own time is its kernels' time."""
        return HostClock()

    def startup_caches(self) -> dict:
        """None of its own: numba caches its kernels (`core.jit_cache`)."""
        return {}

    def measure_link(self, nbytes: int | None = None, repeats: int = 3):
        """Refused: no host link."""
        raise OptionError("backend 'cpu' cannot measure a host link (CUDA only): use a datasheet --device profile")

    def step_scope(self):
        """The context a whole step runs in: the menu's lanes and the BLAS at one thread (`cpu.lanes`)."""
        scope = ExitStack()
        scope.enter_context(lanes.using(self.menu.threads))
        scope.enter_context(lanes.blas_pinned())
        return scope

    def paged_backing(self):
        """The paged pool's memory: a memfd of chunks mapped into a reserved range (`cpu.paged`)."""
        from .paged import MemfdBacking

        return MemfdBacking()
