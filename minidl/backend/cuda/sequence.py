"""The CUDA backend's sequence-model kernels, the CPU's `cpu/seq.py` family with its signatures.

Hand-written kernels (`kernels/seq.cu`, `kernels/loss.cu`), cuBLAS products and cuDNN's SDPA. Rules: nothing sums
atomically; the kernels take float32 or the mode's half storage for activations and deltas (`_check_io`), float32
for weights, statistics and their gradients; half products run cublasGemmStridedBatchedEx on the half storage
(float32 accumulation, rounded once). Half attention of a layer that keeps its scores in no plan (`fused`: built
with keep_scores=False; a plan that drops kept scores rebuilds them with the kernels, the same bits) runs cuDNN's
SDPA: forward (training and inference) one graph that also writes the softmax statistics, backward that graph
again (o and the statistics in side buffers, o with y's bits) then the deterministic backward graph; a shape for
which cuDNN refuses either graph runs the kernels, forward and backward alike. The kernels (float32, kept scores,
refused shapes): attention's backward rebuilds an unkept P with forward's operations (the same bits); half
attention, one sample at a time, keeps scores and dS float32 in side buffers, rounds P to the half before use, as
the CPU's, and takes float32 copies of k and q for dq and dk. A mixin of `CUDABackend`; imports no cupy.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..precision import HALF_DTYPES
from . import cudnn_specs, halves, launches
from .ops import I64, on_compute
from .views import element_strides

if TYPE_CHECKING:  # pragma: no cover
    from .cudnn_graphs import BuiltGraph

#: This family's kernels beyond the `Backend` protocol's (`Capabilities.kernels`).
SEQUENCE_KERNELS = frozenset({
    "layernorm_forward", "layernorm_forward_apply", "layernorm_backward", "gelu_forward", "gelu_backward",
    "embedding_forward", "embedding_backward", "position_embedding_forward", "position_embedding_backward",
    "softmax_forward", "softmax_backward", "matmul_forward", "matmul_backward", "attention_forward",
    "attention_backward", "softmax_xent_ignore_forward", "softmax_xent_ignore_backward"})


class SequenceOps:
    # -- layer norm over the last axis (rows of C values)
    @on_compute
    def layernorm_forward(self, x, w, b, y, mean, rstd, eps: float) -> None:
        """y = (x - mean) * rstd * w + b per row; mean and rstd (R,) saved where given."""
        self._check_io("layernorm_forward", x=x, y=y)
        self._check("layernorm_forward", w=w, b=b, mean=mean, rstd=rstd)
        if mean is None:
            mean = self.side.get("ln_mean", (x.shape[0],), np.float32)
            rstd = self.side.get("ln_rstd", (x.shape[0],), np.float32)
        self._launch(launches.layernorm_forward(y, mean, rstd, x, w, b, eps, self.limits))

    @on_compute
    def layernorm_forward_apply(self, x, w, b, mean, rstd, y) -> None:
        """y from the saved statistics, the training forward's operations in order."""
        self._check_io("layernorm_forward_apply", x=x, y=y)
        self._check("layernorm_forward_apply", w=w, b=b, mean=mean, rstd=rstd)
        self._launch(launches.layernorm_forward_apply(y, x, w, b, mean, rstd, self.limits))

    @on_compute
    def layernorm_backward(self, x, w, dy, mean, rstd, dx, dw, db) -> None:
        """dx per row; dw, db column sums in float64, by chunks of rows then over the
        chunks, each in a fixed order (`launches.layernorm_chunks`)."""
        self._check_io("layernorm_backward", x=x, dy=dy, dx=dx)
        self._check("layernorm_backward", w=w, mean=mean, rstd=rstd, dw=dw, db=db)
        if dw is not None or db is not None:
            r, c = x.shape
            _, n = launches.layernorm_chunks(r)
            pw = self.side.get("ln_partial_w", (n, c), np.float64)
            pb = self.side.get("ln_partial_b", (n, c), np.float64)
            self._launch(launches.layernorm_backward_partials(pw, pb, x, dy, mean, rstd, self.limits))
            self._launch(launches.layernorm_backward_params(dw, db, pw, pb, r, self.limits))
        if dx is not None:
            self._launch(launches.layernorm_backward_dx(dx, x, w, dy, mean, rstd, self.limits))

    # -- GELU
    @on_compute
    def gelu_forward(self, x, y, approximate: str) -> None:
        self._check_io("gelu_forward", x=x, y=y)
        self._launch(launches.gelu_forward(y, x, approximate, self.limits))

    @on_compute
    def gelu_backward(self, x, dy, dx, approximate: str) -> None:
        self._check_io("gelu_backward", x=x, dy=dy, dx=dx)
        self._launch(launches.gelu_backward(dx, x, dy, approximate, self.limits))

    # -- embeddings
    @on_compute
    def embedding_forward(self, idx, w, y) -> None:
        self._check_io("embedding_forward", y=y)
        self._check("embedding_forward", w=w)
        self._check("embedding_forward", I64, idx=idx)
        self._launch(launches.embedding_forward(y, w, idx, self.limits))

    @on_compute
    def embedding_backward(self, idx, dy, dw) -> None:
        """dw[v] = the sum of dy[r] over rows with idx[r] == v, in row order."""
        self._check_io("embedding_backward", dy=dy)
        self._check("embedding_backward", dw=dw)
        self._check("embedding_backward", I64, idx=idx)
        dw.fill(0)  # the kernel adds into it (launches.ZERO_OUTPUT_FIRST)
        self._launch(launches.embedding_backward(dw, dy, idx, self.limits))

    @on_compute
    def position_embedding_forward(self, x, w, y) -> None:
        self._check_io("position_embedding_forward", x=x, y=y)
        self._check("position_embedding_forward", w=w)
        self._launch(launches.position_embedding_forward(y, x, w, self.limits))

    @on_compute
    def position_embedding_backward(self, dy, dx, dw) -> None:
        """dx = dy; dw[t] = the sum over the batch of dy[:, t], in batch order (numpy's), zero past T."""
        self._check_io("position_embedding_backward", dy=dy, dx=dx)
        self._check("position_embedding_backward", dw=dw)
        if dx is not None:
            self.cp.copyto(dx, dy)
        if dw is not None:
            dw[dy.shape[1]:] = 0
            self._launch(launches.position_embedding_backward(dw, dy, self.limits))

    # -- softmax over the last axis
    @on_compute
    def softmax_forward(self, x, y) -> None:
        self._check_io("softmax_forward", x=x, y=y)
        self._launch(launches.softmax_forward(y, x, 1.0, 0, self.limits))

    @on_compute
    def softmax_backward(self, y, dy, dx) -> None:
        """dx = y (dy - sum(dy y)) per row: reads the output only."""
        self._check_io("softmax_backward", y=y, dy=dy, dx=dx)
        self._launch(launches.softmax_backward(dx, y, dy, 1.0, self.limits))

    # -- batched matrix product (cuBLAS)
    def _product(self, a, b, out) -> None:
        """out = a @ b by cuBLAS; a strided `out` is written through a side buffer (cupy would
        allocate outside the arena, which a captured step refuses)."""
        if out.flags.c_contiguous:
            self.cp.matmul(a, b, out=out)
            return
        staged = self.side.get("matmul_out", out.shape, np.float32)
        self.cp.matmul(a, b, out=staged)
        self.cp.copyto(out, staged)

    def _staged(self, name: str, a):
        """`a` where C-contiguous, else its copy in side buffer `name`, so cupy copies nothing
        outside the arena."""
        if a.flags.c_contiguous:
            return a
        buf = self.side.get(name, a.shape, np.float32)
        self.cp.copyto(buf, a)
        return buf

    def _widened(self, name: str, a):
        """A float32 copy of half `a` (any strides) in side buffer `name`, exact."""
        if not a.flags.c_contiguous:
            bits = self.side.get(name + "_bits", a.shape, a.dtype)
            self.cp.copyto(bits, a)
            a = bits
        buf = self.side.get(name, a.shape, np.float32)
        self._launch(launches.widen_copy(buf, a, self.limits))
        return buf

    def _rounded(self, out, f32) -> None:
        """Half `out` (any strides) = the float32 side buffer `f32` rounded to nearest even."""
        if out.flags.c_contiguous:
            self._launch(launches.round_copy(out, f32, self.limits))
            return
        bits = self.side.get("round_out", out.shape, out.dtype)
        self._launch(launches.round_copy(bits, f32, self.limits))
        self.cp.copyto(out, bits)

    def _half_product(self, a32, b32, out, name: str) -> None:
        """Half `out` = float32 operands' product, rounded once."""
        buf = self.side.get(name, out.shape, np.float32)
        self.cp.matmul(a32, b32, out=buf)
        self._rounded(out, buf)

    def _half_matmul(self, a, b, c) -> None:
        """`c` (half, rounded once, or float32) = a @ b of half a, b by cublasGemmStridedBatchedEx, no copy: each
        operand a matrix stack or its transposed view, the leading axes broadcast."""
        if c.strides[-1] != c.itemsize:       # a transposed c: c^T = b^T a^T
            self._half_matmul(b.swapaxes(-1, -2), a.swapaxes(-1, -2), c.swapaxes(-1, -2))
            return
        m, n, k = c.shape[-2], c.shape[-1], a.shape[-1]
        a = self.cp.broadcast_to(a, (*c.shape[:-2], m, k))
        b = self.cp.broadcast_to(b, (*c.shape[:-2], k, n))
        (opa, lda), (opb, ldb), (_, ldc) = (_column_major("matmul", name, x)
                                            for name, x in (("a", a), ("b", b), ("c", c)))
        blas = self._blas()
        outer, count = c.shape[:-3], (c.shape[-3] if c.ndim > 2 else 1)
        stride = lambda x: element_strides(x)[-3] if x.ndim > 2 else 0   # noqa: E731
        for i in np.ndindex(*outer):          # row-major c = a b is column-major c^T = b^T a^T
            self._gemm_strided_ex(blas, opb, opa, n, m, k, b[i], ldb, stride(b), a[i], lda, stride(a), c[i], ldc,
                                  stride(c), count)

    @on_compute
    def matmul_forward(self, a, b, y) -> None:
        if self._views("matmul_forward", a=a, b=b, y=y) is None:
            self._product(a, b, y)
            return
        self._half_matmul(a, b, y)

    @on_compute
    def matmul_backward(self, a, b, dy, da, db) -> None:
        """da = dy b^T, db = a^T dy (db may be a transposed view)."""
        if self._views("matmul_backward", a=a, b=b, dy=dy, da=da, db=db) is None:
            if da is not None:
                self._product(dy, b.swapaxes(-1, -2), da)
            if db is not None:
                self._product(a.swapaxes(-1, -2), dy, db)
            return
        if da is not None:
            self._half_matmul(dy, b.swapaxes(-1, -2), da)
        if db is not None:
            self._half_matmul(a.swapaxes(-1, -2), dy, db)

    # -- self-attention (causal or bidirectional)
    def _probs(self, q, k, scale: float, causal: bool, p) -> None:
        """One sample's p (H, T, T) = softmax(q k^T * scale [+ causal mask]), masked entries exactly 0."""
        t = q.shape[-2]
        self._product(q, k.swapaxes(-1, -2), p)
        self._launch(launches.softmax_forward(p, p, scale, t if causal else 0, self.limits))

    def _half_probs(self, q, k, scale: float, causal: bool, p32, kept):
        """One sample's scores of half q, k in float32 (`p32`), their softmax rounded to the half into `kept` (the
        saved probabilities, or a scratch), which it returns: the values the CPU's half attention uses."""
        self._half_matmul(q, k.swapaxes(-1, -2), p32)
        self._launch(launches.softmax_forward(p32, p32, scale, q.shape[-2] if causal else 0, self.limits))
        if kept is None:
            kept = self.side.get("attn_probs_half", p32.shape, halves.storage_dtype(self._half_dtype()))
        self._launch(launches.round_copy(kept, p32, self.limits))
        return kept

    def _half_dtype(self):
        return HALF_DTYPES[self.filters.half]

    # -- cuDNN's SDPA: half attention whose scores are not kept
    def _sdpa_graphs(self, spec: cudnn_specs.SDPASpec) -> tuple[BuiltGraph, BuiltGraph] | None:
        """`spec`'s forward and backward graphs, or None where cuDNN refuses either (the reason in `fallbacks`):
        one answer per shape for forward, inference and backward, so a forward that ran SDPA is differentiated by
        SDPA and one that ran the kernels by the kernels."""
        fwd = self._graph(spec.key("sdpa_fwd", self.filters))
        bwd = None if fwd is None else self._graph(spec.key("sdpa_bwd", self.filters))
        return None if bwd is None else (fwd, bwd)

    def _sdpa_forward(self, q, k, v, y, scale: float, causal: bool) -> bool:
        """y by the SDPA forward graph (its statistics into a side buffer); False where cuDNN refuses the shape."""
        spec = cudnn_specs.SDPASpec.from_views(q, k, v, y, scale, causal)
        graphs = self._sdpa_graphs(spec)
        if graphs is None:
            return False
        stats = self.side.get("attn_stats", spec.stats_shape, np.float32)
        self._run_graph(graphs[0], {"q": q, "k": k, "v": v, "o": y, "stats": stats})
        return True

    def _sdpa_backward(self, q, k, v, dy, dq, dk, dv, scale: float, causal: bool) -> bool:
        """o and the statistics again by the forward graph (o in dy's layout, which is y's: the same key, plan
        and bits as forward's y), then dq, dk, dv by the backward graph; False where cuDNN refuses the shape."""
        spec = cudnn_specs.SDPASpec.from_views(q, k, v, dy, scale, causal)
        grads = {n: element_strides(a) for n, a in (("dq", dq), ("dk", dk), ("dv", dv))}
        if set(grads.values()) != {spec.qkv_stride}:
            raise ValueError(f"attention_backward: dq, dk and dv must have q's layout (element strides "
                             f"{spec.qkv_stride}), got {grads}")
        graphs = self._sdpa_graphs(spec)
        if graphs is None:
            return False
        stats = self.side.get("attn_stats", spec.stats_shape, np.float32)
        o = self._side_like("attn_o", dy)
        self._run_graph(graphs[0], {"q": q, "k": k, "v": v, "o": o, "stats": stats})
        self._run_graph(graphs[1], {"q": q, "k": k, "v": v, "o": o, "do": dy, "stats": stats, "dq": dq, "dk": dk,
                                    "dv": dv})
        return True

    def _side_like(self, name: str, a):
        """Side buffer `name` viewed with `a`'s shape, dtype and strides (positive)."""
        span = 1 + sum((n - 1) * s for n, s in zip(a.shape, element_strides(a)))
        flat = self.side.get(name, (span,), a.dtype)
        return self.cp.lib.stride_tricks.as_strided(flat, shape=a.shape, strides=a.strides)

    @on_compute
    def attention_forward(self, q, k, v, probs, y, scale: float, causal: bool = True, fused: bool = False) -> None:
        """Per (batch, head): y = softmax(q k^T * scale [causal]) v; probs saved, or None:
        scores in scratch. One sample per call either way, so cuBLAS sees the same shapes (same bits)."""
        if self._views("attention_forward", q=q, k=k, v=v, y=y, probs=probs) is not None:
            self._check_io("attention_forward", probs=probs)
            if fused and probs is None and self._sdpa_forward(q, k, v, y, scale, causal):
                return
            self._half_attention_forward(q, k, v, probs, y, scale, causal)
            return
        self._check("attention_forward", probs=probs)
        b, h, t, _ = q.shape
        scratch = self.side.get("attn_probs", (h, t, t), np.float32) if probs is None else None
        for bi in range(b):
            p = scratch if probs is None else probs[bi]
            self._probs(self._staged("attn_q", q[bi]), self._staged("attn_k", k[bi]), scale, causal, p)
            self._product(p, self._staged("attn_v", v[bi]), y[bi])

    def _half_attention_forward(self, q, k, v, probs, y, scale: float, causal: bool) -> None:
        b, h, t, _ = q.shape
        p32 = self.side.get("attn_probs", (h, t, t), np.float32)
        for bi in range(b):
            kept = self._half_probs(q[bi], k[bi], scale, causal, p32, None if probs is None else probs[bi])
            self._half_matmul(kept, v[bi], y[bi])

    @on_compute
    def attention_backward(self, q, k, v, probs, dy, dq, dk, dv, scale: float, causal: bool = True,
                           fused: bool = False) -> None:
        """dv = P^T dy, dP = dy v^T, dS = P (dP - rowsum(dP P)) * scale, dq = dS k,
        dk = dS^T q, from saved probs or rebuilt per sample."""
        if self._views("attention_backward", q=q, k=k, v=v, dy=dy, dq=dq, dk=dk, dv=dv, probs=probs) is not None:
            self._check_io("attention_backward", probs=probs)
            if fused and probs is None and self._sdpa_backward(q, k, v, dy, dq, dk, dv, scale, causal):
                return
            self._half_attention_backward(q, k, v, probs, dy, dq, dk, dv, scale, causal)
            return
        self._check("attention_backward", probs=probs)
        b, h, t, _ = q.shape
        scratch = self.side.get("attn_probs", (h, t, t), np.float32) if probs is None else None
        ds = self.side.get("attn_dscores", (h, t, t), np.float32)
        for bi in range(b):
            qs, ks = self._staged("attn_q", q[bi]), self._staged("attn_k", k[bi])
            dys = self._staged("attn_dy", dy[bi])
            if probs is None:
                p = scratch
                self._probs(qs, ks, scale, causal, p)
            else:
                p = probs[bi]
            self._product(p.swapaxes(-1, -2), dys, dv[bi])
            self._product(dys, self._staged("attn_v", v[bi]).swapaxes(-1, -2), ds)
            self._launch(launches.softmax_backward(ds, p, ds, scale, self.limits))
            self._product(ds, ks, dq[bi])
            self._product(ds.swapaxes(-1, -2), qs, dk[bi])

    def _half_attention_backward(self, q, k, v, probs, dy, dq, dk, dv, scale: float, causal: bool) -> None:
        """dq and dk multiply float32 dS by float32 copies of k and q: cuBLAS multiplies like types."""
        b, h, t, _ = q.shape
        p32 = self.side.get("attn_probs", (h, t, t), np.float32)
        ds = self.side.get("attn_dscores", (h, t, t), np.float32)
        for bi in range(b):
            # cuBLAS first: on a capturing stream it raises before anything is enqueued (`CaptureUnsupported`)
            p = self._half_probs(q[bi], k[bi], scale, causal, p32, None) if probs is None else probs[bi]
            self._half_matmul(p.swapaxes(-1, -2), dy[bi], dv[bi])
            self._half_matmul(dy[bi], v[bi].swapaxes(-1, -2), ds)
            self._launch(launches.widen_copy(p32, p, self.limits))
            self._launch(launches.softmax_backward(ds, p32, ds, scale, self.limits))
            self._half_product(ds, self._widened("attn_k", k[bi]), dq[bi], "attn_out")
            self._half_product(ds.swapaxes(-1, -2), self._widened("attn_q", q[bi]), dk[bi], "attn_out")

    # -- cross-entropy over every token, with an ignore index
    @on_compute
    def softmax_xent_ignore_forward(self, logits, labels, loss, ignore_index: int) -> None:
        """The mean loss over rows not `ignore_index` (NaN when all are, as
        PyTorch), on the device."""
        self._check_io("softmax_xent_ignore_forward", logits=logits)
        self._check("softmax_xent_ignore_forward", loss=loss)
        self._check("softmax_xent_ignore_forward", I64, labels=labels)
        rows = self.side.get("xent_rows", (logits.shape[0],), np.float32)
        self._launch(launches.softmax_xent_ignore_forward(rows, logits, labels, ignore_index, self.limits))
        self._launch(launches.softmax_xent_ignore_mean(loss, rows, labels, ignore_index, self.limits))

    @on_compute
    def softmax_xent_ignore_backward(self, logits, labels, dloss, dlogits, ignore_index: int) -> None:
        """(softmax - one-hot) * dloss / count on rows not ignored, zeros
        elsewhere; no host round trip."""
        self._check_io("softmax_xent_ignore_backward", logits=logits, dlogits=dlogits)
        self._check("softmax_xent_ignore_backward", dloss=dloss)
        self._check("softmax_xent_ignore_backward", I64, labels=labels)
        scale = self.side.get("xent_scale", (1,), np.float32)
        self._launch(launches.softmax_xent_ignore_scale(scale, dloss, labels, ignore_index, self.limits))
        self._launch(launches.softmax_xent_ignore_backward(dlogits, logits, labels, scale, ignore_index,
                                                         self.limits))

    # -- helpers
    def _views(self, op: str, **arrays) -> str | None:
        """`_check_io` of strided views (cuBLAS reads them): the half or None."""
        return self._check_io(op, contiguous=False, **arrays)


def _column_major(op: str, name: str, x) -> tuple[str, int]:
    """(cuBLAS op, leading dimension) of row-major matrix stack `x` read as column-major: 'N' with its rows'
    stride where its columns are contiguous (the column-major storage of x^T), 'T' where its rows are."""
    rows, cols = element_strides(x)[-2:]
    if cols == 1 and rows >= max(x.shape[-1], 1):
        return "N", max(rows, 1)
    if rows == 1 and cols >= max(x.shape[-2], 1):
        return "T", cols
    raise ValueError(f"{op}: {name} {x.shape} with strides {x.strides} has neither rows nor columns contiguous: "
                     f"cuBLAS reads it only through a copy")
