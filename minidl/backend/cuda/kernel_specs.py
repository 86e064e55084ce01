"""Description of minidl's hand-written CUDA kernels (``kernels/*.cu``), numpy only (host-testable).

``KERNELS``: for every ``extern "C" __global__`` entry point, its file, its arguments (name and C type, in
order) and its launch kind; the backend converts Python scalars to the exact C types (cupy passes a ``float``
as ``double``, an ``int`` as ``long long``: ``coerce_scalars``). ``launch_config`` picks grid and block.
Kernel conventions (``kernels/elementwise.cu``): float32 data, int64 labels, outputs first, ``long long``
sizes, grid-stride loops (any grid is correct). A kernel with half forms has entry points ``<name>_bf16`` and
``<name>_f16`` beside it: its activation-like arguments in bf16 / fp16 storage (C types ``bf16*``, ``f16*``:
16-bit values), everything else as in ``<name>``.
Rules of the compiled texts (``module_source``): a file's half entry points are written once, in its ``#ifdef HALF``
block; a file is compiled as its float32 text or as one half's text (float32 forms and that half's), and a kernel
loads from its own half's text, a float32 kernel from the run's (``module_half``). cupy caches a compiled module
on disk by its text, so each math mode's modules are cached apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Sequence, Tuple, Union

import numpy as np

__all__ = [
    "KERNEL_DIR",
    "Arg",
    "KernelSpec",
    "KERNELS",
    "kernel_files",
    "kernels_in_file",
    "source_path",
    "module_source",
    "module_half",
    "file_halves",
    "scalar_type",
    "coerce_scalars",
    "launch_config",
    "HALF_SUFFIX",
    "THREADS_PER_BLOCK",
    "BLOCKS_PER_SM",
]


def _find_kernel_dir() -> Path:
    """``<repo>/kernels`` in a checkout; ``minidl/kernels`` once installed (pyproject's mapping)."""
    here = Path(__file__).resolve()
    candidates = (here.parents[3] / "kernels", here.parents[2] / "kernels")
    for d in candidates:
        if any(d.glob("*.cu")):
            return d
    return candidates[0]


#: Directory holding the ``.cu`` sources.
KERNEL_DIR = _find_kernel_dir()

#: Threads per block of the grid-stride kernels.
THREADS_PER_BLOCK = 256
#: Grid-stride kernels launch at most ``sm_count * BLOCKS_PER_SM`` blocks.
BLOCKS_PER_SM = 32
#: Hardware limit on gridDim.x.
_MAX_GRID_X = 2**31 - 1

# Launch kinds (KernelSpec.launch):
#   "elementwise":  1-D grid-stride over n work items, 256 threads.
#   "row":          one block per row of an (N, K) matrix (loss kernels).
#   "single_block": one block reducing n items (the batch mean).
#   "warp_row":     one warp per row of an (R, L) matrix, 256 threads.
LAUNCH_KINDS = ("elementwise", "row", "single_block", "warp_row")


@dataclass(frozen=True)
class Arg:
    """One kernel parameter: its name and C type (``float*``, ``long long``...)."""

    name: str
    ctype: str

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")


@dataclass(frozen=True)
class KernelSpec:
    """An ``extern "C" __global__`` kernel of ``kernels/<file>``; ``work``: what ``launch_config`` gets."""

    name: str
    file: str
    args: Tuple[Arg, ...]
    launch: str
    work: str
    doc: str = ""
    torch_op: str = ""
    half: str = ""       # "bf16" / "fp16": a half form's storage ("" for float32)

    @property
    def base(self) -> str:
        """The kernel's name without its half suffix (``relu_forward`` for ``relu_forward_bf16``)."""
        return self.name[: -len(HALF_SUFFIX[self.half])] if self.half else self.name

    @property
    def nargs(self) -> int:
        return len(self.args)

    @property
    def arg_names(self) -> Tuple[str, ...]:
        return tuple(a.name for a in self.args)

    @property
    def ctypes(self) -> Tuple[str, ...]:
        return tuple(a.ctype for a in self.args)


def _args(sig: str) -> Tuple[Arg, ...]:
    """Parse ``"float* out, const float* x, long long n"`` into Args."""
    out = []
    for part in sig.split(","):
        part = " ".join(part.split())
        # the name is the last identifier; the C type everything before it
        star = part.rfind("*")
        space = part.rfind(" ")
        cut = max(star, space)
        ctype, name = part[: cut + 1].strip(), part[cut + 1 :].strip()
        ctype = ctype.replace(" *", "*")
        out.append(Arg(name, ctype))
    return tuple(out)


#: Entry-point suffix of each half storage (kernels/*.cu: "Half storage").
HALF_SUFFIX = {"bf16": "_bf16", "fp16": "_f16"}
_HALF_CTYPE = {"bf16": "bf16", "fp16": "f16"}


def _with_halves(spec: KernelSpec, *storage: str, extra: str = "", work: str = "",
                 doc: str = "") -> Tuple[KernelSpec, ...]:
    """`spec` and its half forms: the `storage` arguments' ``float`` replaced by each half's C type, `extra`
    arguments (C signature text) appended to the half forms only; `work`, `doc` where the half forms differ."""
    missing = set(storage) - set(spec.arg_names)
    assert not missing and all("float" in a.ctype for a in spec.args if a.name in storage), (spec.name, missing)
    out = [spec]
    for half, suffix in HALF_SUFFIX.items():
        args = tuple(Arg(a.name, a.ctype.replace("float", _HALF_CTYPE[half]) if a.name in storage else a.ctype)
                     for a in spec.args) + (_args(extra) if extra else ())
        out.append(KernelSpec(spec.name + suffix, spec.file, args, spec.launch, work or spec.work,
                              doc=f"{spec.name} on {half} storage" + (f"; {doc}" if doc else ""),
                              torch_op=spec.torch_op, half=half))
    return tuple(out)


_POOL_DIMS = "long long N, long long C, long long H, long long W, long long OH, long long OW"

_SPECS: Sequence[KernelSpec] = (
    # -- loss.cu
    *_with_halves(KernelSpec(
        "softmax_xent_forward", "loss.cu",
        _args("float* loss, const float* logits, const long long* labels, "
              "long long N, long long K"),
        launch="row", work="(N, K)",
        doc="per-sample loss[r] = logsumexp(x[r]) - x[r, labels[r]]; NaN for a "
            "label outside [0, K)",
        torch_op="F.cross_entropy(reduction='none')"), "logits"),
    KernelSpec(
        "softmax_xent_mean", "loss.cu",
        _args("float* out, const float* loss, long long N"),
        launch="single_block", work="N",
        doc="out[0] = mean(loss[:N]) (NaN if N == 0)",
        torch_op="Tensor.mean"),
    *_with_halves(KernelSpec(
        "softmax_xent_backward", "loss.cu",
        _args("float* dlogits, const float* logits, const long long* labels, "
              "long long N, long long K, float scale"),
        launch="row", work="(N, K)",
        doc="dlogits = (softmax(logits) - onehot(labels)) * scale, scale = "
            "dloss / N for the mean; NaN rows for invalid labels",
        torch_op="F.cross_entropy backward"), "dlogits", "logits", extra="const float* dloss",
        doc="times dloss[0] (the loss's float32 gradient) before the one rounding"),
    *_with_halves(KernelSpec(
        "softmax_xent_ignore_forward", "loss.cu",
        _args("float* loss, const float* logits, const long long* labels, "
              "long long N, long long K, long long ignore_index"),
        launch="row", work="(N, K)",
        doc="per-row loss as softmax_xent_forward, 0 for a row whose label is "
            "ignore_index",
        torch_op="F.cross_entropy(ignore_index=..., reduction='none')"), "logits"),
    KernelSpec(
        "softmax_xent_ignore_mean", "loss.cu",
        _args("float* out, const float* loss, const long long* labels, "
              "long long N, long long ignore_index"),
        launch="single_block", work="N",
        doc="out[0] = sum(loss[:N]) / (rows not ignored); NaN when all are",
        torch_op="F.cross_entropy(ignore_index=...)"),
    KernelSpec(
        "softmax_xent_ignore_scale", "loss.cu",
        _args("float* scale, const float* dloss, const long long* labels, "
              "long long N, long long ignore_index"),
        launch="single_block", work="N",
        doc="scale[0] = dloss[0] / (rows not ignored), on the device",
        torch_op="F.cross_entropy(ignore_index=...) backward"),
    *_with_halves(KernelSpec(
        "softmax_xent_ignore_backward", "loss.cu",
        _args("float* dlogits, const float* logits, const long long* labels, "
              "const float* scale, long long N, long long K, long long ignore_index"),
        launch="row", work="(N, K)",
        doc="(softmax - onehot) * scale[0] per row, zeros for ignored rows",
        torch_op="F.cross_entropy(ignore_index=...) backward"), "dlogits", "logits"),
    # -- optim.cu
    KernelSpec(
        "sgd_update", "optim.cu",
        _args("float* param, const float* grad, float* momentum_buf, long long n, "
              "double lr, double momentum, double dampening, double weight_decay, "
              "int nesterov, int first_step"),
        launch="elementwise", work="param.size",
        doc="in-place SGD step; momentum_buf unused (may be NULL) if momentum == 0; "
            "first_step != 0 initialises it to the gradient",
        torch_op="torch.optim.SGD.step"),
    KernelSpec(
        "adam_update", "optim.cu",
        _args("float* param, const float* grad, float* m, float* v, long long n, "
              "double lr, double beta1, double beta2, double eps, "
              "double weight_decay, int step"),
        launch="elementwise", work="param.size",
        doc="in-place Adam step (L2 weight decay, no amsgrad); step is 1-based",
        torch_op="torch.optim.Adam.step"),
    KernelSpec(
        "sgd_update_dev", "optim.cu",
        _args("float* param, const float* grad, float* momentum_buf, long long n, "
              "const double* lr, double momentum, double dampening, double weight_decay, "
              "int nesterov, int first_step, const int* diverged"),
        launch="elementwise", work="param.size",
        doc="sgd_update with lr read from device memory (lr[0]), skipped if diverged[0]: a CUDA graph's replay",
        torch_op="torch.optim.SGD.step"),
    KernelSpec(
        "adam_update_dev", "optim.cu",
        _args("float* param, const float* grad, float* m, float* v, long long n, "
              "const double* scalars, double beta1, double beta2, double eps, double weight_decay, "
              "const int* diverged"),
        launch="elementwise", work="param.size",
        doc="adam_update with {lr, step} read from device memory, skipped if diverged[0]: a CUDA graph's replay",
        torch_op="torch.optim.Adam.step"),
    # -- pool.cu
    *_with_halves(KernelSpec(
        "maxpool2d_forward", "pool.cu",
        _args("float* y, const float* x, " + _POOL_DIMS + ", int kh, int kw, "
              "int sh, int sw, int ph, int pw, int dh, int dw"),
        launch="elementwise", work="y.size",
        doc="NCHW max pooling, padding = -inf, dilation supported",
        torch_op="F.max_pool2d"), "y", "x"),
    *_with_halves(KernelSpec(
        "maxpool2d_backward", "pool.cu",
        _args("float* dx, const float* dy, const float* x, " + _POOL_DIMS +
              ", int kh, int kw, int sh, int sw, int ph, int pw, int dh, int dw"),
        launch="elementwise", work="dy.size",
        doc="recomputes the argmax (first max, row-major) from x and atomicAdds "
            "dy into dx; THE HOST MUST ZERO dx FIRST",
        torch_op="F.max_pool2d backward"), "dx", "dy", "x", work="dx.size",
        doc="gather form: one thread per input element sums dy over the windows it is the argmax of, in "
            "row-major output order; overwrites dx"),
    *_with_halves(KernelSpec(
        "avgpool2d_forward", "pool.cu",
        _args("float* y, const float* x, " + _POOL_DIMS + ", int kh, int kw, "
              "int sh, int sw, int ph, int pw, int count_include_pad, "
              "int divisor_override"),
        launch="elementwise", work="y.size",
        doc="NCHW average pooling; divisor_override = 0 means None",
        torch_op="F.avg_pool2d"), "y", "x"),
    *_with_halves(KernelSpec(
        "avgpool2d_backward", "pool.cu",
        _args("float* dx, const float* dy, " + _POOL_DIMS + ", int kh, int kw, "
              "int sh, int sw, int ph, int pw, int count_include_pad, "
              "int divisor_override"),
        launch="elementwise", work="dx.size",
        doc="gather form: one thread per input element, overwrites dx",
        torch_op="F.avg_pool2d backward"), "dx", "dy"),
    *_with_halves(KernelSpec(
        "global_avgpool_forward", "pool.cu",
        _args("float* y, const float* x, long long NC, long long HW"),
        launch="warp_row", work="(N*C, H*W)",
        doc="y[r] = mean(x[r, :]) over H*W; one warp per row, blockDim.x must "
            "be a multiple of 32",
        torch_op="F.adaptive_avg_pool2d(x, 1)"), "y", "x"),
    *_with_halves(KernelSpec(
        "global_avgpool_backward", "pool.cu",
        _args("float* dx, const float* dy, long long NC, long long HW"),
        launch="elementwise", work="dx.size",
        doc="dx[r, j] = dy[r] / HW",
        torch_op="F.adaptive_avg_pool2d(x, 1) backward"), "dx", "dy"),
    # -- compress.cu
    KernelSpec(
        "sz_quantize", "compress.cu",
        _args("long long* bins, unsigned char* outlier, const float* x, long long n, double eb"),
        launch="elementwise", work="n",
        doc="SZ codec stage 1 (minidl/codec/sz.py quantize): sign-keeping bin index per element, step 2*eb; "
            "outlier = 1 (and bin 0) where the bound cannot be met in float32 or x is NaN/Inf or -0.0"),
    KernelSpec(
        "sz_encode_blocks", "compress.cu",
        _args("unsigned int* planes, unsigned char* widths, long long* anchors, const long long* bins, "
              "long long n, long long nblocks"),
        launch="row", work="(nblocks, 256)",
        doc="SZ stages 2-3 per 256-code block: Lorenzo difference, zigzag, width, bit-planes by __ballot_sync "
            "into a fixed 64-plane slot per block; blockDim.x must be 256"),
    KernelSpec(
        "sz_gather_planes", "compress.cu",
        _args("unsigned int* body, const unsigned int* planes, const unsigned char* widths, "
              "const long long* starts, long long nblocks"),
        launch="elementwise", work="nblocks * 64 * 8",
        doc="compact the fixed plane slots into the stream body; starts = exclusive prefix sum of widths"),
    KernelSpec(
        "sz_decode_blocks", "compress.cu",
        _args("float* y, const unsigned int* body, const unsigned char* widths, const long long* starts, "
              "const long long* anchors, long long n, long long nblocks, double eb"),
        launch="row", work="(nblocks, 256)",
        doc="inverse of sz_encode_blocks + dequantize: codes from planes, block prefix sum from the anchor; "
            "blockDim.x must be 256"),
    KernelSpec(
        "sz_scatter_outliers", "compress.cu",
        _args("float* y, const long long* idx, const float* vals, long long n_out"),
        launch="elementwise", work="n_out",
        doc="write the outliers' exact values back after sz_decode_blocks"),
    # -- elementwise.cu
    *_with_halves(KernelSpec(
        "add_forward", "elementwise.cu",
        _args("float* out, const float* a, const float* b, long long n"),
        launch="elementwise", work="n",
        doc="out = a + b (out may alias a or b)", torch_op="torch.add"), "out", "a", "b"),
    *_with_halves(KernelSpec(
        "add_many", "elementwise.cu",
        _args("float* out, " + "".join(f"const float* x{j}, " for j in range(8)) + "int k, long long n"),
        launch="elementwise", work="n",
        doc="out = x0 + ... + x(k-1) in float32, stored once (slots from k on unread; out may alias an input)",
        torch_op="torch.add"), "out", *(f"x{j}" for j in range(8))),
    *_with_halves(KernelSpec(
        "accumulate", "elementwise.cu",
        _args("float* dst, const float* src, long long n"),
        launch="elementwise", work="n",
        doc="dst += src", torch_op="Tensor.add_"), "dst", "src"),
    *(KernelSpec(
        "round_copy" + suffix, "elementwise.cu", _args(f"{_HALF_CTYPE[half]}* out, const float* x, long long n"),
        launch="elementwise", work="n", half=half,
        doc=f"out = x rounded to {half}: a weight's half copy refreshed from its float32 master",
        torch_op="Tensor.copy_") for half, suffix in HALF_SUFFIX.items()),
    *(KernelSpec(
        "widen_copy" + suffix, "elementwise.cu", _args(f"float* out, const {_HALF_CTYPE[half]}* x, long long n"),
        launch="elementwise", work="n", half=half,
        doc=f"out = the {half} values of x in float32, exactly (an add of more than two half inputs)",
        torch_op="Tensor.float") for half, suffix in HALF_SUFFIX.items()),
    KernelSpec(
        "scale_copy", "elementwise.cu",
        _args("float* out, const float* x, long long n, float scale"),
        launch="elementwise", work="n",
        doc="out = x * scale (out may alias x)", torch_op="torch.mul"),
    *_with_halves(KernelSpec(
        "relu_forward", "elementwise.cu",
        _args("float* y, const float* x, long long n"),
        launch="elementwise", work="n",
        doc="y = max(x, 0), NaN propagates", torch_op="torch.relu"), "y", "x"),
    *_with_halves(KernelSpec(
        "relu_backward", "elementwise.cu",
        _args("float* dx, const float* y, const float* dy, long long n"),
        launch="elementwise", work="n",
        doc="dx = y > 0 ? dy : 0 (y is the forward OUTPUT)",
        torch_op="threshold_backward"), "dx", "y", "dy"),
    *_with_halves(KernelSpec(
        "dropout_forward", "elementwise.cu",
        _args("float* out, const float* x, long long n, unsigned long long key, "
              "unsigned int threshold24, float scale"),
        launch="elementwise", work="n",
        doc="out = keep ? x * scale : 0, keep = (splitmix64(key + i) >> 40) >= "
            "threshold24 (see dropout_keep_mask)",
        torch_op="F.dropout(training=True)"), "out", "x"),
    *_with_halves(KernelSpec(
        "dropout_backward", "elementwise.cu",
        _args("float* dx, const float* dy, long long n, unsigned long long key, "
              "unsigned int threshold24, float scale"),
        launch="elementwise", work="n",
        doc="dx = keep ? dy * scale : 0 with the forward's key (mask replayed)",
        torch_op="F.dropout backward"), "dx", "dy"),
    KernelSpec(
        "nonfinite_flag", "elementwise.cu",
        _args("int* flag, const float* x, long long n, int code"),
        launch="elementwise", work="n",
        doc="flag[0] = code (atomicCAS from 0) if any x[i] is not finite: the divergence guard in a CUDA graph",
        torch_op="torch.isfinite(x).all()"),
    *_with_halves(KernelSpec(
        "dropout_forward_dev", "elementwise.cu",
        _args("float* out, const float* x, long long n, const unsigned long long* key, "
              "unsigned int threshold24, float scale"),
        launch="elementwise", work="n",
        doc="dropout_forward with the key read from device memory (key[0]): a CUDA graph's replay",
        torch_op="F.dropout(training=True)"), "out", "x"),
    *_with_halves(KernelSpec(
        "dropout_backward_dev", "elementwise.cu",
        _args("float* dx, const float* dy, long long n, const unsigned long long* key, "
              "unsigned int threshold24, float scale"),
        launch="elementwise", work="n",
        doc="dropout_backward with the key read from device memory (key[0]): a CUDA graph's replay",
        torch_op="F.dropout backward"), "dx", "dy"),
    *_with_halves(KernelSpec(
        "concat_copy_forward", "elementwise.cu",
        _args("float* out, const float* x, long long N, long long Ci, "
              "long long inner, long long Ctotal, long long c0"),
        launch="elementwise", work="x.size",
        doc="out[:, c0:c0+Ci] = x for x (N, Ci, *S), out (N, Ctotal, *S), "
            "inner = prod(S)",
        torch_op="torch.cat(dim=1)"), "out", "x"),
    *_with_halves(KernelSpec(
        "concat_copy_backward", "elementwise.cu",
        _args("float* dx, const float* dout, long long N, long long Ci, "
              "long long inner, long long Ctotal, long long c0"),
        launch="elementwise", work="dx.size",
        doc="dx = dout[:, c0:c0+Ci] (overwrites dx)",
        torch_op="torch.cat(dim=1) backward"), "dx", "dout"),
    *_with_halves(KernelSpec(
        "lrn_forward", "elementwise.cu",
        _args("float* y, const float* x, long long N, long long C, long long inner, "
              "int size, float alpha, float beta, float k"),
        launch="elementwise", work="x.size",
        doc="y = x / (k + alpha/size * sum_{window} x^2)^beta across channels",
        torch_op="nn.LocalResponseNorm"), "y", "x"),
    *_with_halves(KernelSpec(
        "lrn_backward", "elementwise.cu",
        _args("float* dx, const float* x, const float* y, const float* dy, "
              "long long N, long long C, long long inner, int size, float alpha, "
              "float beta, float k"),
        launch="elementwise", work="x.size",
        doc="gradient of lrn_forward given x, its output y and dy",
        torch_op="nn.LocalResponseNorm backward"), "dx", "x", "y", "dy"),
    # -- seq.cu
    *_with_halves(KernelSpec(
        "layernorm_forward", "seq.cu",
        _args("float* y, float* mean, float* rstd, const float* x, const float* w, "
              "const float* b, long long R, long long C, float eps"),
        launch="row", work="(R, C)",
        doc="layer norm of R rows of C values; mean, rstd saved; w, b may be NULL",
        torch_op="F.layer_norm"), "y", "x"),
    *_with_halves(KernelSpec(
        "layernorm_forward_apply", "seq.cu",
        _args("float* y, const float* x, const float* w, const float* b, "
              "const float* mean, const float* rstd, long long R, long long C"),
        launch="elementwise", work="R * C",
        doc="layer norm's output from saved statistics (a recomputed forward)",
        torch_op="F.layer_norm"), "y", "x"),
    *_with_halves(KernelSpec(
        "layernorm_backward_dx", "seq.cu",
        _args("float* dx, const float* x, const float* w, const float* dy, "
              "const float* mean, const float* rstd, long long R, long long C"),
        launch="row", work="(R, C)",
        doc="dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w",
        torch_op="F.layer_norm backward"), "dx", "x", "dy"),
    *_with_halves(KernelSpec(
        "layernorm_backward_partials", "seq.cu",
        _args("double* pw, double* pb, const float* x, const float* dy, "
              "const float* mean, const float* rstd, long long R, long long C, long long chunk"),
        launch="elementwise", work="ceil(R / chunk) * C",
        doc="per chunk of rows and column: sums of dy xhat and of dy (double), rows in order",
        torch_op="F.layer_norm backward"), "x", "dy"),
    KernelSpec(
        "layernorm_backward_params", "seq.cu",
        _args("float* dw, float* db, const double* pw, const double* pb, "
              "long long nchunks, long long C"),
        launch="elementwise", work="C",
        doc="dw, db = the chunks' partial sums, in chunk order; either may be NULL",
        torch_op="F.layer_norm backward"),
    *_with_halves(KernelSpec(
        "gelu_forward", "seq.cu",
        _args("float* y, const float* x, long long n, int exact"),
        launch="elementwise", work="n",
        doc="GELU, exact (erf) or the tanh approximation",
        torch_op="F.gelu"), "y", "x"),
    *_with_halves(KernelSpec(
        "gelu_backward", "seq.cu",
        _args("float* dx, const float* x, const float* dy, long long n, int exact"),
        launch="elementwise", work="n",
        doc="dx = dy * GELU'(x)",
        torch_op="F.gelu backward"), "dx", "x", "dy"),
    *_with_halves(KernelSpec(
        "softmax_forward", "seq.cu",
        _args("float* y, const float* x, long long R, long long C, float scale, "
              "long long causal_t"),
        launch="row", work="(R, C)",
        doc="softmax(x * scale) per row; causal_t > 0: keys after query "
            "(row mod causal_t) get 0; y may alias x",
        torch_op="F.softmax(x * scale, -1)"), "y", "x"),
    *_with_halves(KernelSpec(
        "softmax_backward", "seq.cu",
        _args("float* dx, const float* y, const float* dy, long long R, long long C, "
              "float scale"),
        launch="row", work="(R, C)",
        doc="dx = scale y (dy - sum(dy y)) per row; dx may alias dy",
        torch_op="F.softmax backward"), "dx", "y", "dy"),
    *_with_halves(KernelSpec(
        "embedding_forward", "seq.cu",
        _args("float* y, const float* w, const long long* idx, long long R, "
              "long long C, long long V"),
        launch="elementwise", work="R * C",
        doc="y[r] = w[idx[r]]; NaN rows for indices outside [0, V)",
        torch_op="F.embedding"), "y"),
    *_with_halves(KernelSpec(
        "embedding_backward", "seq.cu",
        _args("float* dw, const float* dy, const long long* idx, long long R, "
              "long long C, long long V, long long groups"),
        launch="elementwise", work="groups * C",
        doc="dw[idx[r]] += dy[r] in row order, each value of dw owned by one thread "
            "(a vocabulary range and a column); THE HOST MUST ZERO dw FIRST",
        torch_op="F.embedding backward"), "dy"),
    *_with_halves(KernelSpec(
        "position_embedding_forward", "seq.cu",
        _args("float* y, const float* x, const float* w, long long B, long long TC"),
        launch="elementwise", work="B * TC",
        doc="y[b, j] = x[b, j] + w[j] over the T*C values of the table's first T rows (w: float32 master)",
        torch_op="x + w[:T]"), "y", "x"),
    *_with_halves(KernelSpec(
        "position_embedding_backward", "seq.cu",
        _args("float* dw, const float* dy, long long B, long long TC"),
        launch="elementwise", work="TC",
        doc="dw[j] = sum of dy[b, j] over b in order, float32 (the host zeroes the rows past T)",
        torch_op="(x + w[:T]) backward"), "dy"),
)

#: name -> KernelSpec, for every kernel in kernels/*.cu.
KERNELS: Dict[str, KernelSpec] = {s.name: s for s in _SPECS}
assert len(KERNELS) == len(_SPECS), "duplicate kernel name"
assert all(s.launch in LAUNCH_KINDS for s in _SPECS)


def kernel_files() -> Tuple[str, ...]:
    """The ``.cu`` file names that hold registered kernels (sorted)."""
    return tuple(sorted({s.file for s in _SPECS}))


def kernels_in_file(file: str) -> Tuple[KernelSpec, ...]:
    """Specs of the kernels defined in ``file`` (e.g. ``"pool.cu"``)."""
    return tuple(s for s in _SPECS if s.file == file)


COMMON = "common.cuh"               # the grid-stride loop, NaN-aware max, block reduction: put before every file
HALF_STORAGE = "half_storage.cuh"   # bf16/f16 storage types, load and store: put before a file with half forms


def file_halves(file: str) -> Tuple[Union[str, None], ...]:
    """The halves ``file`` is compiled for: None (its float32 text), and "bf16", "fp16" where it has half forms."""
    return (None, *HALF_SUFFIX) if any(s.half for s in kernels_in_file(file)) else (None,)


def module_source(file: str, half: Union[str, None] = None) -> str:
    """The text a ``.cu`` file is compiled from (by cupy.RawModule, NVRTC or nvcc) for a run in `half` (None:
    float32): the shared device code, then the half storage where the file has half forms (NVRTC takes no
    #include, so the text is joined here), then with a half its ``HALF(name)`` (the entry point's name) and
    ``half_t`` (its storage)."""
    if half not in file_halves(file):
        raise ValueError(f"{file} has no {half} text: it is compiled for "
                         f"{', '.join(h or 'fp32' for h in file_halves(file))}")
    text = (KERNEL_DIR / file).read_text()
    if half is not None:
        text = f"#define HALF(name) name##{HALF_SUFFIX[half]}\ntypedef {_HALF_CTYPE[half]} half_t;\n" + text
    if len(file_halves(file)) > 1:
        text = (KERNEL_DIR / HALF_STORAGE).read_text() + text
    return (KERNEL_DIR / COMMON).read_text() + text


def module_half(name: str, half: Union[str, None]) -> Union[str, None]:
    """The half of the text kernel `name` loads from in a run in `half` (None: float32): a half form's own, a
    float32 kernel's the run's where its file has half forms (one module per file and mode), else None."""
    spec = KERNELS[name]
    return spec.half or (half if half in file_halves(spec.file) else None)


def source_path(file_or_kernel: str) -> Path:
    """Path of a ``.cu`` file, given its file name or one of its kernels' names."""
    if file_or_kernel in KERNELS:
        file_or_kernel = KERNELS[file_or_kernel].file
    return KERNEL_DIR / file_or_kernel


_SCALAR_TYPES = {
    "float": np.float32,
    "double": np.float64,
    "int": np.int32,
    "unsigned int": np.uint32,
    "unsigned char": np.uint8,
    "long long": np.int64,
    "unsigned long long": np.uint64,
}


def scalar_type(ctype: str):
    """numpy scalar type matching a non-pointer C parameter type."""
    try:
        return _SCALAR_TYPES[ctype]
    except KeyError:
        raise ValueError(f"no numpy scalar type for C type {ctype!r}") from None


def coerce_scalars(kernel_name: str, args: Sequence) -> tuple:
    """The scalar arguments of ``args`` converted to the kernel's C types; pointers untouched."""
    spec = KERNELS[kernel_name]
    if len(args) != spec.nargs:
        raise TypeError(f"{kernel_name} takes {spec.nargs} arguments "
                        f"({', '.join(spec.arg_names)}), got {len(args)}")
    out = []
    for a, v in zip(spec.args, args):
        if a.is_pointer:
            out.append(v)
        elif a.ctype == "unsigned long long":
            out.append(np.uint64(int(v) % 2**64))
        else:
            out.append(scalar_type(a.ctype)(v))
    return tuple(out)


def _prod(shape: Iterable[int]) -> int:
    p = 1
    for d in shape:
        p *= int(d)
    return p


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    x = max(int(x), 1)
    return 1 << (x - 1).bit_length()


def launch_config(kernel_name: str,
                  n_or_shape: Union[int, Sequence[int]],
                  device_max_threads: int = 1024,
                  sm_count: int = 132) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
    """``(grid, block)`` 3-tuples for ``kernel_name`` over ``n_or_shape`` (its ``work``): "elementwise"
    256 threads, at most sm_count * 32 blocks; "row" a block per row, threads the power of two >= min(K, 1024);
    "single_block" one block; "warp_row" a warp per row. n == 0 still gives a valid launch."""
    spec = KERNELS[kernel_name]
    max_threads = _pow2_floor(min(int(device_max_threads), 1024))
    max_blocks = max(1, int(sm_count) * BLOCKS_PER_SM)

    if spec.launch == "row":
        if isinstance(n_or_shape, (int, np.integer)):
            raise TypeError(f"{kernel_name} needs the (N, K) shape of the logits")
        n_rows, k = (int(d) for d in n_or_shape)
        threads = min(_pow2_ceil(min(k, 1024)), max_threads)
        blocks = max(1, min(n_rows, _MAX_GRID_X))
        return (blocks, 1, 1), (threads, 1, 1)

    if spec.launch == "warp_row":
        if isinstance(n_or_shape, (int, np.integer)):
            rows = int(n_or_shape)
        else:
            rows = int(n_or_shape[0])
        threads = min(THREADS_PER_BLOCK, max_threads)
        threads = max(32, threads - threads % 32)
        warps_per_block = threads // 32
        blocks = max(1, min(-(-rows // warps_per_block), max_blocks))
        return (blocks, 1, 1), (threads, 1, 1)

    n = int(n_or_shape) if isinstance(n_or_shape, (int, np.integer)) else _prod(n_or_shape)
    if n < 0:
        raise ValueError(f"negative work size {n}")

    if spec.launch == "single_block":
        threads = min(THREADS_PER_BLOCK, max_threads, _pow2_ceil(n))
        return (1, 1, 1), (threads, 1, 1)

    threads = min(THREADS_PER_BLOCK, max_threads)
    blocks = max(1, min(-(-n // threads), max_blocks))
    return (blocks, 1, 1), (threads, 1, 1)
