"""The CUDA backend's sequence-model kernels: layer norm, GELU, embeddings, softmax over the last axis, batched
matrix products, self-attention and cross-entropy with an ignore index (the CPU backend's `cpu/seq.py` family,
with the same signatures).

Layer norm, GELU, softmax, the embedding gather and its gradient, and the ignore-index loss run the hand-written
kernels of `kernels/seq.cu` and `kernels/loss.cu` (launches packed by `launches`); the products go through cuBLAS
(`cupy.matmul`, strided batched GEMM). Attention is built from those: per sample, P = softmax(q k^T * scale
[+ causal mask]) into the saved `probs` or a scratch of one sample's scores, then y = P v; backward rebuilds P the
same way where it was not kept (FlashAttention's trade), so a saved and a rebuilt P have the same bits and every
policy the same gradients. Nothing here sums atomically: a step gives the same bits from run to run.

Not the cuDNN frontend's SDPA graph (FlashAttention in one call): its support matrix has fp16, bf16 and fp8
tensors, not the float32 this backend computes in; and it hands back the output and softmax statistics, never P,
so the kept and the recomputed attention would be different computations (different bits under different
policies), where the planner's choice must not change a step's result.

A mixin of `CUDABackend` (backend.py), which holds the streams, the kernels and the helpers these methods call
(`compute`, `cp`, `side`, `limits`, `_check`, `_launch`). Imports no cupy: host tests run it on numpy arrays.
"""
from __future__ import annotations

import numpy as np

from . import launches
from .ops import F32, I64, on_compute

#: The kernels of this family beyond the `Backend` protocol's (`Capabilities.kernels`; `Layer.backend_ops`): the
#: CPU backend's sequence family and the loss with an ignore index.
SEQUENCE_KERNELS = frozenset({
    "layernorm_forward", "layernorm_forward_apply", "layernorm_backward", "gelu_forward", "gelu_backward",
    "embedding_forward", "embedding_backward", "position_embedding_forward", "position_embedding_backward",
    "softmax_forward", "softmax_backward", "matmul_forward", "matmul_backward", "attention_forward",
    "attention_backward", "softmax_xent_ignore_forward", "softmax_xent_ignore_backward"})


class SequenceOps:
    """Layer norm, GELU, embedding, last-axis softmax, batched products, attention and the ignore-index loss."""

    # -- layer norm over the last axis (rows of C values) ---------------------------------------------------
    @on_compute
    def layernorm_forward(self, x, w, b, y, mean, rstd, eps: float) -> None:
        """y = (x - mean) * rstd * w + b per row; mean and rstd (R,) saved where given (evaluation passes None:
        they go to scratch)."""
        self._check("layernorm_forward", x=x, w=w, b=b, y=y, mean=mean, rstd=rstd)
        if mean is None:
            mean = self.side.get("ln_mean", (x.shape[0],), np.float32)
            rstd = self.side.get("ln_rstd", (x.shape[0],), np.float32)
        self._launch(launches.layernorm_forward(y, mean, rstd, x, w, b, eps, self.limits))

    @on_compute
    def layernorm_forward_apply(self, x, w, b, mean, rstd, y) -> None:
        """y from the saved statistics (a recomputed layer norm): the training forward's operations, in its
        order, on the same values."""
        self._check("layernorm_forward_apply", x=x, w=w, b=b, mean=mean, rstd=rstd, y=y)
        self._launch(launches.layernorm_forward_apply(y, x, w, b, mean, rstd, self.limits))

    @on_compute
    def layernorm_backward(self, x, w, dy, mean, rstd, dx, dw, db) -> None:
        """dx per row (one block each); dw, db as column sums in float64, by chunks of rows then over the
        chunks, each in a fixed order (`launches.layernorm_chunks`; the partial sums in side buffers)."""
        self._check("layernorm_backward", x=x, w=w, dy=dy, mean=mean, rstd=rstd, dx=dx, dw=dw, db=db)
        if dw is not None or db is not None:
            r, c = x.shape
            _, n = launches.layernorm_chunks(r)
            pw = self.side.get("ln_partial_w", (n, c), np.float64)
            pb = self.side.get("ln_partial_b", (n, c), np.float64)
            self._launch(launches.layernorm_backward_partials(pw, pb, x, dy, mean, rstd, self.limits))
            self._launch(launches.layernorm_backward_params(dw, db, pw, pb, r, self.limits))
        if dx is not None:
            self._launch(launches.layernorm_backward_dx(dx, x, w, dy, mean, rstd, self.limits))

    # -- GELU ---------------------------------------------------------------------------------------------------
    @on_compute
    def gelu_forward(self, x, y, approximate: str) -> None:
        self._check("gelu_forward", x=x, y=y)
        self._launch(launches.gelu_forward(y, x, approximate, self.limits))

    @on_compute
    def gelu_backward(self, x, dy, dx, approximate: str) -> None:
        self._check("gelu_backward", x=x, dy=dy, dx=dx)
        self._launch(launches.gelu_backward(dx, x, dy, approximate, self.limits))

    # -- embeddings -------------------------------------------------------------------------------------------------
    @on_compute
    def embedding_forward(self, idx, w, y) -> None:
        """y[r] = w[idx[r]] for the flat int64 indices idx (R,) and rows y (R, C)."""
        self._check("embedding_forward", w=w, y=y)
        self._check("embedding_forward", I64, idx=idx)
        self._launch(launches.embedding_forward(y, w, idx, self.limits))

    @on_compute
    def embedding_backward(self, idx, dy, dw) -> None:
        """dw[v] = the sum of dy[r] over the rows with idx[r] == v, in row order; zeros elsewhere."""
        self._check("embedding_backward", dy=dy, dw=dw)
        self._check("embedding_backward", I64, idx=idx)
        dw.fill(0)  # the kernel adds into it (launches.ZERO_OUTPUT_FIRST)
        self._launch(launches.embedding_backward(dw, dy, idx, self.limits))

    @on_compute
    def position_embedding_forward(self, x, w, y) -> None:
        """y[b, t] = x[b, t] + w[t] for x (B, T, C) and the first T rows of w."""
        self._check("position_embedding_forward", x=x, w=w, y=y)
        self.cp.add(x, w[:x.shape[1]], out=y)

    @on_compute
    def position_embedding_backward(self, dy, dx, dw) -> None:
        """dx = dy; dw[t] = the sum over the batch of dy[:, t] (rows past T get zeros)."""
        self._check("position_embedding_backward", dy=dy, dx=dx, dw=dw)
        if dx is not None:
            self.cp.copyto(dx, dy)
        if dw is not None:
            t = dy.shape[1]
            dw[t:] = 0
            self.cp.sum(dy, axis=0, out=dw[:t])

    # -- softmax over the last axis ------------------------------------------------------------------------------
    @on_compute
    def softmax_forward(self, x, y) -> None:
        self._check("softmax_forward", x=x, y=y)
        self._launch(launches.softmax_forward(y, x, 1.0, 0, self.limits))

    @on_compute
    def softmax_backward(self, y, dy, dx) -> None:
        """dx = y (dy - sum(dy y)) per row: reads the output only."""
        self._check("softmax_backward", y=y, dy=dy, dx=dx)
        self._launch(launches.softmax_backward(dx, y, dy, 1.0, self.limits))

    # -- batched matrix product (cuBLAS) ---------------------------------------------------------------------------
    def _product(self, a, b, out) -> None:
        """out = a @ b over the batch axes through cuBLAS. A strided `out` (a transposed gradient, a head's
        columns) is written through a side buffer: cupy would otherwise allocate the product outside the arena,
        which a captured step refuses."""
        if out.flags.c_contiguous:
            self.cp.matmul(a, b, out=out)
            return
        staged = self.side.get("matmul_out", out.shape, np.float32)
        self.cp.matmul(a, b, out=staged)
        self.cp.copyto(out, staged)

    def _staged(self, name: str, a):
        """`a` itself where C-contiguous, else a copy in side buffer `name`: attention's q, k, v and dy are
        (H, T, D) views of one sample's (T, 3C) or (T, C) rows, copied (one sample's worth) so that cuBLAS reads
        plain matrices and cupy makes no copy of its own outside the arena."""
        if a.flags.c_contiguous:
            return a
        buf = self.side.get(name, a.shape, np.float32)
        self.cp.copyto(buf, a)
        return buf

    @on_compute
    def matmul_forward(self, a, b, y) -> None:
        """y = a b over the batch axes (b may be a transposed view)."""
        self._views("matmul_forward", a=a, b=b, y=y)
        self._product(a, b, y)

    @on_compute
    def matmul_backward(self, a, b, dy, da, db) -> None:
        """da = dy b^T, db = a^T dy (db may be a transposed view: it is written through)."""
        self._views("matmul_backward", a=a, b=b, dy=dy, da=da, db=db)
        if da is not None:
            self._product(dy, b.swapaxes(-1, -2), da)
        if db is not None:
            self._product(a.swapaxes(-1, -2), dy, db)

    # -- self-attention (causal or bidirectional) -------------------------------------------------------------------
    def _probs(self, q, k, scale: float, causal: bool, p) -> None:
        """One sample's attention probabilities, p (H, T, T) = softmax(q k^T * scale [+ causal mask]): the
        scores by cuBLAS into p, then the masked, scaled softmax in place (masked entries exactly 0)."""
        t = q.shape[-2]
        self._product(q, k.swapaxes(-1, -2), p)
        self._launch(launches.softmax_forward(p, p, scale, t if causal else 0, self.limits))

    @on_compute
    def attention_forward(self, q, k, v, probs, y, scale: float, causal: bool = True) -> None:
        """Per (batch, head): probs = softmax(q k^T * scale, masked to keys at or before the query when
        `causal`), y = probs v. q, k, v, y are (B, H, T, D) views; probs (B, H, T, T) saved for backward, or
        None: one sample's scores at a time in scratch. One sample per call in both cases, so the products have
        the same shapes (hence cuBLAS the same bits) whether P is kept or not."""
        self._views("attention_forward", q=q, k=k, v=v, y=y)
        self._check("attention_forward", probs=probs)
        b, h, t, _ = q.shape
        scratch = self.side.get("attn_probs", (h, t, t), np.float32) if probs is None else None
        for bi in range(b):
            p = scratch if probs is None else probs[bi]
            self._probs(self._staged("attn_q", q[bi]), self._staged("attn_k", k[bi]), scale, causal, p)
            self._product(p, self._staged("attn_v", v[bi]), y[bi])

    @on_compute
    def attention_backward(self, q, k, v, probs, dy, dq, dk, dv, scale: float, causal: bool = True) -> None:
        """From the probs forward saved, or (probs None) from the probs rebuilt per sample with forward's
        operations: dv = P^T dy, dP = dy v^T, dS = P (dP - rowsum(dP P)) * scale, dq = dS k, dk = dS^T q."""
        self._views("attention_backward", q=q, k=k, v=v, dy=dy, dq=dq, dk=dk, dv=dv)
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

    # -- cross-entropy over every token, with an ignore index ---------------------------------------------------------
    @on_compute
    def softmax_xent_ignore_forward(self, logits, labels, loss, ignore_index: int) -> None:
        """The mean over the rows whose label is not `ignore_index` (NaN when every row is ignored, as PyTorch):
        per-row losses into scratch, then their sum over the count, both on the device."""
        self._check("softmax_xent_ignore_forward", logits=logits, loss=loss)
        self._check("softmax_xent_ignore_forward", I64, labels=labels)
        rows = self.side.get("xent_rows", (logits.shape[0],), np.float32)
        self._launch(launches.softmax_xent_ignore_forward(rows, logits, labels, ignore_index, self.limits))
        self._launch(launches.softmax_xent_ignore_mean(loss, rows, labels, ignore_index, self.limits))

    @on_compute
    def softmax_xent_ignore_backward(self, logits, labels, dloss, dlogits, ignore_index: int) -> None:
        """(softmax - one-hot) * dloss / (rows not ignored) on the rows not ignored, zeros on the others; the
        factor is computed on the device (no host round trip to read dloss or count the rows)."""
        self._check("softmax_xent_ignore_backward", logits=logits, dloss=dloss, dlogits=dlogits)
        self._check("softmax_xent_ignore_backward", I64, labels=labels)
        scale = self.side.get("xent_scale", (1,), np.float32)
        self._launch(launches.softmax_xent_ignore_scale(scale, dloss, labels, ignore_index, self.limits))
        self._launch(launches.softmax_xent_ignore_backward(dlogits, logits, labels, scale, ignore_index,
                                                         self.limits))

    # -- helpers ------------------------------------------------------------------------------------------------
    def _views(self, op: str, **arrays) -> None:
        """Arrays given (not None) must be float32 device arrays; unlike `_check`, strided views are accepted
        (cuBLAS reads and writes them through their strides)."""
        for name, a in arrays.items():
            if a is None:
                continue
            if not isinstance(a, self.cp.ndarray):
                raise TypeError(f"{op}: {name} must be a cupy array on the device, got {type(a).__name__}")
            if a.dtype != F32:
                raise TypeError(f"{op}: {name} must be {F32}, got {a.dtype} (the CUDA backend is float32 with "
                                f"int64 indices)")
