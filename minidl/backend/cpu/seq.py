"""Sequence-model kernels of the CPU backend: layer norm, GELU, embeddings, last-axis softmax, batched matrix
products and self-attention. They run compiled (`cpu.seq_jit`) where numba loads; the numpy passes here are
the fallback and reference, on blocks of about `CHUNK` elements in a fixed order of sums: a recomputation gives
the same bits.
"""
from __future__ import annotations

import math

import numpy as np

from . import half, lanes
from .jit import lazy, workers_for

CHUNK = 1 << 16  # elements per block of rows (256 KiB of float32)
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_TANH_CUBIC = 0.044715  # the cubic term of GELU's tanh approximation

seq_kernels = lazy("seq_jit")  # None without numba


def _rows(rows: int, width: int):
    """Slices of about `CHUNK` elements, at least a row, covering `rows` rows of `width`."""
    step = max(1, CHUNK // max(1, width))
    for s in range(0, rows, step):
        yield slice(s, min(rows, s + step))


def _erf(a: np.ndarray) -> np.ndarray:
    """erf in float64 (numpy has none), for the fallback of exact GELU."""
    return np.vectorize(math.erf, otypes=[np.float64])(a)


#: The kernels of this family beyond the `Backend` protocol's (`Capabilities.kernels`).
SEQ_KERNELS = frozenset({"layernorm_forward", "layernorm_forward_apply", "layernorm_backward", "gelu_forward",
                         "gelu_backward", "embedding_forward", "embedding_backward", "position_embedding_forward",
                         "position_embedding_backward", "softmax_forward", "softmax_backward", "matmul_forward",
                         "matmul_backward", "attention_forward", "attention_backward"})


class SeqOps:
    """Layer norm, GELU, embedding, last-axis softmax and attention kernels."""

    def layernorm_forward(self, x: np.ndarray, w: np.ndarray | None, b: np.ndarray | None, y: np.ndarray,
                          mean: np.ndarray | None, rstd: np.ndarray | None, eps: float) -> None:
        """y = (x - mean) * rstd * w + b per row of x (R, C), mean and rstd (R,) saved when given; two passes."""
        jit = seq_kernels()
        if jit is not None and _flat(x, y, *(a for a in (w, b, mean, rstd) if a is not None)):
            if mean is None:  # evaluation
                mean, rstd = np.empty(x.shape[0], x.dtype), np.empty(x.shape[0], x.dtype)
            args = (x, _or(w, x[0]), _or(b, x[0]), w is not None, b is not None, y, mean, rstd, float(eps))
            workers = workers_for(x.size)
            if workers > 1:
                jit.layernorm_forward_parallel(*args, workers)
            else:
                jit.layernorm_forward(*args)
            return
        t = x.dtype.type
        for s in _rows(x.shape[0], x.shape[1]):
            xs = x[s]
            m = np.mean(xs, axis=1, dtype=x.dtype)
            d = xs - m[:, None]
            r = t(1) / np.sqrt(np.mean(d * d, axis=1, dtype=x.dtype) + t(eps))
            if mean is not None:
                mean[s], rstd[s] = m, r
            _ln_apply(xs, w, b, m, r, y[s])

    def layernorm_forward_apply(self, x: np.ndarray, w: np.ndarray | None, b: np.ndarray | None,
                                mean: np.ndarray, rstd: np.ndarray, y: np.ndarray) -> None:
        """y from the saved statistics by the training forward's operations."""
        jit = seq_kernels()
        if jit is not None and _flat(x, y, mean, rstd, *(a for a in (w, b) if a is not None)):
            args = (x, _or(w, x[0]), _or(b, x[0]), w is not None, b is not None, mean, rstd, y)
            workers = workers_for(x.size)
            if workers > 1:
                jit.layernorm_forward_apply_parallel(*args, workers)
            else:
                jit.layernorm_forward_apply(*args)
            return
        for s in _rows(x.shape[0], x.shape[1]):
            _ln_apply(x[s], w, b, mean[s], rstd[s], y[s])

    def layernorm_backward(self, x: np.ndarray, w: np.ndarray | None, dy: np.ndarray, mean: np.ndarray,
                           rstd: np.ndarray, dx: np.ndarray | None, dw: np.ndarray | None,
                           db: np.ndarray | None) -> None:
        """g = dy * w, xhat = (x - mean) * rstd: dx = rstd (g - mean(g) - xhat mean(g xhat)) per row;
        dw = sum of dy xhat, db = sum of dy, per block of rows, then over blocks in order."""
        jit = seq_kernels()
        if jit is not None and _flat(x, dy, mean, rstd, *(a for a in (w, dx, dw, db) if a is not None)):
            sw, sb = np.empty(x.shape[1]), np.empty(x.shape[1])
            args = (x, _or(w, x[0]), w is not None, dy, mean, rstd, _or(dx, x), dx is not None, sw, sb)
            workers = workers_for(x.size)
            if workers > 1:
                jit.layernorm_backward_parallel(*args, workers)
            else:
                jit.layernorm_backward(*args)
            if dw is not None:
                dw[...] = sw
            if db is not None:
                db[...] = sb
            return
        if dw is not None:
            dw.fill(0)
        if db is not None:
            db.fill(0)
        for s in _rows(x.shape[0], x.shape[1]):
            xhat = (x[s] - mean[s, None]) * rstd[s, None]
            dys = dy[s]
            if dw is not None:
                dw += np.sum(dys * xhat, axis=0, dtype=x.dtype)
            if db is not None:
                db += np.sum(dys, axis=0, dtype=x.dtype)
            if dx is None:
                continue
            g = dys * w if w is not None else dys.copy()
            c1 = np.mean(g, axis=1, dtype=x.dtype)
            c2 = np.mean(g * xhat, axis=1, dtype=x.dtype)
            g -= c1[:, None]
            xhat *= c2[:, None]
            g -= xhat
            np.multiply(g, rstd[s, None], out=dx[s])

    def gelu_forward(self, x: np.ndarray, y: np.ndarray, approximate: str) -> None:
        xf, yf = x.reshape(-1), y.reshape(-1)
        jit = seq_kernels()
        if jit is not None and _flat(x, y):
            name = "gelu_tanh_forward" if approximate == "tanh" else "gelu_exact_forward"
            workers = 1 if approximate == "tanh" else workers_for(xf.size)  # tanh: serial only
            if workers > 1:
                getattr(jit, name + "_parallel")(xf, yf, workers)
            else:
                getattr(jit, name)(xf, yf)
            return
        if approximate == "tanh":
            t = x.dtype.type
            for s in _rows(xf.size, 1):
                a, u = xf[s], yf[s]
                _tanh_inner(a, u)
                u += t(1)
                u *= a
                u *= t(0.5)
            return
        for s in _rows(xf.size, 1):
            a = xf[s].astype(np.float64)
            yf[s] = 0.5 * a * (1.0 + _erf(a / math.sqrt(2)))

    def gelu_backward(self, x: np.ndarray, dy: np.ndarray, dx: np.ndarray, approximate: str) -> None:
        xf, dyf, dxf = x.reshape(-1), dy.reshape(-1), dx.reshape(-1)
        jit = seq_kernels()
        if jit is not None and _flat(x, dy, dx):
            name = "gelu_tanh_backward" if approximate == "tanh" else "gelu_exact_backward"
            workers = 1 if approximate == "tanh" else workers_for(xf.size)  # tanh: serial only
            if workers > 1:
                getattr(jit, name + "_parallel")(xf, dyf, dxf, workers)
            else:
                getattr(jit, name)(xf, dyf, dxf)
            return
        if approximate == "tanh":
            t = x.dtype.type
            for s in _rows(xf.size, 1):
                a, th = xf[s], dxf[s]
                _tanh_inner(a, th)
                # slope = 0.5 (1 + th) + 0.5 a (1 - th^2) k (1 + 3 c a^2)
                q = a * a
                q *= t(3 * _TANH_CUBIC)
                q += t(1)
                q *= a
                q *= t(0.5 * _SQRT_2_OVER_PI)
                r = th * th
                np.subtract(t(1), r, out=r)
                q *= r
                th += t(1)
                th *= t(0.5)
                th += q
                th *= dyf[s]
            return
        for s in _rows(xf.size, 1):
            a = xf[s].astype(np.float64)
            slope = 0.5 * (1 + _erf(a / math.sqrt(2))) + a * np.exp(-0.5 * a * a) / math.sqrt(2 * math.pi)
            dxf[s] = dyf[s] * slope

    def embedding_forward(self, idx: np.ndarray, w: np.ndarray, y: np.ndarray) -> None:
        """y[r] = w[idx[r]]."""
        np.take(w, idx, axis=0, out=y)

    def embedding_backward(self, idx: np.ndarray, dy: np.ndarray, dw: np.ndarray) -> None:
        """dw[v] = the sum in row order of dy[r] over rows with idx[r] == v; zeros elsewhere."""
        jit = seq_kernels()
        if jit is not None and _flat(dy, dw) and isinstance(idx, np.ndarray) and idx.flags.c_contiguous:
            workers = workers_for(dw.size)
            if workers > 1:
                jit.embedding_backward_parallel(idx, dy, dw, workers)
            else:
                jit.embedding_backward(idx, dy, dw)
            return
        dw.fill(0)
        np.add.at(dw, idx, dy)

    def position_embedding_forward(self, x: np.ndarray, w: np.ndarray, y: np.ndarray) -> None:
        """y[b, t] = x[b, t] + w[t]."""
        np.add(x, w[:x.shape[1]], out=y)

    def position_embedding_backward(self, dy: np.ndarray, dx: np.ndarray | None, dw: np.ndarray | None) -> None:
        """dx = dy; dw[t] = the sum over the batch of dy[:, t], zero past T."""
        if dx is not None:
            np.copyto(dx, dy)
        if dw is not None:
            t = dy.shape[1]
            dw[t:] = 0
            np.sum(dy, axis=0, out=dw[:t])

    def softmax_forward(self, x: np.ndarray, y: np.ndarray) -> None:
        """y = exp(x - max) / sum(exp(x - max)) per row."""
        jit = seq_kernels()
        if jit is not None and _flat(x, y):
            workers = workers_for(x.size)
            if workers > 1:
                jit.softmax_rows_parallel(x, y, 1.0, False, workers)
            else:
                jit.softmax_rows(x, y, 1.0, False)
            return
        for s in _rows(x.shape[0], x.shape[1]):
            ys = y[s]
            np.subtract(x[s], x[s].max(axis=1, keepdims=True), out=ys)
            np.exp(ys, out=ys)
            ys /= ys.sum(axis=1, keepdims=True)

    def softmax_backward(self, y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:
        """dx = y (dy - sum(dy y)) per row."""
        jit = seq_kernels()
        if jit is not None and _flat(y, dy, dx):
            workers = workers_for(y.size)
            if workers > 1:
                jit.softmax_backward_rows_parallel(y, dy, dx, 1.0, workers)
            else:
                jit.softmax_backward_rows(y, dy, dx, 1.0)
            return
        for s in _rows(y.shape[0], y.shape[1]):
            dot = np.sum(dy[s] * y[s], axis=1, keepdims=True, dtype=y.dtype)
            np.subtract(dy[s], dot, out=dx[s])
            dx[s] *= y[s]

    def matmul_forward(self, a: np.ndarray, b: np.ndarray, y: np.ndarray) -> None:
        """y = a b over the batch axes."""
        np.matmul(a, b, out=y)

    def matmul_backward(self, a: np.ndarray, b: np.ndarray, dy: np.ndarray, da: np.ndarray | None,
                        db: np.ndarray | None) -> None:
        """da = dy b^T, db = a^T dy (db may be a transposed view)."""
        if da is not None:
            np.matmul(dy, b.swapaxes(-1, -2), out=da)
        if db is not None:
            np.matmul(a.swapaxes(-1, -2), dy, out=db)

    def attention_forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, probs: np.ndarray | None,
                          y: np.ndarray, scale: float, causal: bool = True, quantize=None, fused: bool = False) -> None:
        """Per (batch, head): probs = softmax(q k^T * scale, masked if `causal`), y = probs v; probs (B, H, T, T) saved
        (None: scratch), masked entries 0, rounded to the half dtype `quantize`. `fused` (the layer keeps no scores
        in any plan) changes nothing here: the CPU has one attention."""
        b, h, t, _ = q.shape
        mask = _causal_mask(t, q.dtype) if causal else None

        def samples(b0: int, b1: int) -> None:
            scratch = np.empty((h, t, t), q.dtype) if probs is None else None
            for bi in range(b0, b1):
                p = scratch if probs is None else probs[bi]
                _attention_probs(q[bi], k[bi], scale, mask, p, quantize)
                np.matmul(p, v[bi], out=y[bi])
        _samples_over_lanes(b, samples)

    def attention_backward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, probs: np.ndarray | None,
                           dy: np.ndarray, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray, scale: float,
                           causal: bool = True, quantize=None, fused: bool = False) -> None:
        """dv = P^T dy, dP = dy v^T, dS = P (dP - rowsum(dP P)) * scale, dq = dS k, dk = dS^T q; P saved, or (None)
        rebuilt by forward's operations (FlashAttention's backward): the same bits."""
        b, h, t, _ = q.shape
        mask = _causal_mask(t, q.dtype) if probs is None and causal else None

        def samples(b0: int, b1: int) -> None:
            scratch = np.empty((h, t, t), q.dtype) if probs is None else None
            for bi in range(b0, b1):
                if probs is None:
                    p = scratch
                    _attention_probs(q[bi], k[bi], scale, mask, p, quantize)
                else:
                    p = probs[bi]
                np.matmul(p.swapaxes(-1, -2), dy[bi], out=dv[bi])
                ds = np.matmul(dy[bi], v[bi].swapaxes(-1, -2))
                # numpy, not seq_jit's softmax backward: ~4% faster on GPT-2 small
                ds -= np.sum(ds * p, axis=-1, keepdims=True, dtype=ds.dtype)
                ds *= p
                ds *= q.dtype.type(scale)
                np.matmul(ds, k[bi], out=dq[bi])
                np.matmul(ds.swapaxes(-1, -2), q[bi], out=dk[bi])
        _samples_over_lanes(b, samples)


def _samples_over_lanes(b: int, samples) -> None:
    """samples(b0, b1) over contiguous shares of range(b), one per lane: samples are independent."""
    parts = max(1, min(lanes.count(), b))
    lanes.run([lambda b0=b0, b1=b1: samples(b0, b1) for b0, b1 in lanes.split(b, parts)])


def _causal_mask(t: int, dtype) -> np.ndarray:
    """(T, T): 0 where a query may attend, -inf above: added (~2 us a sample; -inf by index ~26)."""
    return np.where(np.triu(np.ones((t, t), bool), 1), -np.inf, 0).astype(dtype)


def _attention_probs(q: np.ndarray, k: np.ndarray, scale: float, mask: np.ndarray | None, p: np.ndarray,
                     quantize=None) -> None:
    """One sample's p (H, T, T) = softmax(q k^T * scale + mask), rounded to `quantize`; the compiled softmax takes
    any mask as the causal one."""
    np.matmul(q, k.swapaxes(-1, -2), out=p)
    jit = seq_kernels()
    if jit is not None and _flat(p):
        rows = p.reshape(-1, p.shape[-1])
        jit.softmax_rows(rows, rows, float(scale), mask is not None)
    else:
        p *= q.dtype.type(scale)
        if mask is not None:
            p += mask
        p -= p.max(axis=-1, keepdims=True)
        np.exp(p, out=p)
        p /= p.sum(axis=-1, keepdims=True)
    if quantize is not None:
        half.quantize(p, quantize)


def _tanh_inner(a: np.ndarray, out: np.ndarray) -> None:
    """out = tanh(sqrt(2/pi) (a + 0.044715 a^3)) in a's dtype."""
    t = a.dtype.type
    np.multiply(a, a, out=out)
    out *= t(_TANH_CUBIC)
    out += t(1)
    out *= a
    out *= t(_SQRT_2_OVER_PI)
    np.tanh(out, out=out)


def _ln_apply(x: np.ndarray, w, b, m: np.ndarray, r: np.ndarray, y: np.ndarray) -> None:
    """y = (x - m) * r, then * w, then + b: always in this order."""
    np.subtract(x, m[:, None], out=y)
    y *= r[:, None]
    if w is not None:
        y *= w
    if b is not None:
        y += b


def _or(a: np.ndarray | None, stand_in: np.ndarray) -> np.ndarray:
    """`a`, or a stand-in the kernel leaves alone (its flag says `a` is absent)."""
    return stand_in if a is None else a


def _flat(*arrays: np.ndarray) -> bool:
    """All C-contiguous numpy arrays of one dtype."""
    dt = arrays[0].dtype
    return all(isinstance(a, np.ndarray) and a.flags.c_contiguous and a.dtype == dt for a in arrays)
