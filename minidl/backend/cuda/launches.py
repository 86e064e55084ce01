"""Kernel launches, device-free: `LAUNCHERS[name](...)` builds each `kernels/*.cu` entry point's argument tuple
(`kernel_specs.coerce_scalars`) and its grid and block (`kernel_specs.launch_config`) from the arrays' shapes,
so every number a launch is handed is checked by host tests (tests/backend/test_cuda_host.py).
Rule: a launcher picks the kernel's form from its storage arrays' dtype (float32, bf16 bits, fp16: `halves`), all
one; `pack_launch` checks every array against its C type.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..common import dropout_scale, dropout_threshold24
from . import halves
from . import kernel_specs as ks


@dataclass(slots=True, frozen=True)
class DeviceLimits:
    """What `launch_config` needs to know about the device."""

    max_threads_per_block: int = 1024
    sm_count: int = 132


@dataclass(slots=True, frozen=True)
class KernelLaunch:
    """Everything `RawKernel(grid, block, args, stream=...)` needs."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple


#: Pointer parameters that may be NULL (None), of every form: SGD's momentum buffer without momentum; layer norm's w,
#: b, dw, db.
NULLABLE_POINTERS = frozenset({("sgd_update", "momentum_buf"), ("sgd_update_dev", "momentum_buf"),
                               ("layernorm_forward", "w"), ("layernorm_forward", "b"),
                               ("layernorm_forward_apply", "w"), ("layernorm_forward_apply", "b"),
                               ("layernorm_backward_dx", "w"), ("layernorm_backward_params", "dw"),
                               ("layernorm_backward_params", "db")})

#: Kernels whose first (output) argument the host must zero before the launch (they add into it).
ZERO_OUTPUT_FIRST = frozenset({"maxpool2d_backward", "embedding_backward", "embedding_backward_bf16",
                               "embedding_backward_f16"})

#: The layer kernels (`Layer.kernels()`) whose CUDA ops read and write half storage only through half forms of
#: kernels/*.cu (products on their float32 copies) or copies of its bits (`Capabilities.half_kernels`;
#: tests/backend/test_cuda_half_kernels.py runs each).
HALF_KERNELS: frozenset[str] = frozenset({
    "relu_forward", "relu_backward", "gelu_forward", "gelu_backward", "softmax_forward", "softmax_backward",
    "dropout_forward", "dropout_backward", "add_forward", "accumulate", "copy", "concat_forward", "concat_backward",
    "lrn_forward", "lrn_backward", "maxpool2d_forward", "maxpool2d_backward", "avgpool2d_forward",
    "avgpool2d_backward", "global_avgpool_forward", "global_avgpool_backward", "layernorm_forward",
    "layernorm_forward_apply", "layernorm_backward", "embedding_forward", "embedding_backward",
    "position_embedding_forward", "position_embedding_backward", "softmax_xent_forward", "softmax_xent_backward",
    "softmax_xent_ignore_forward", "softmax_xent_ignore_backward", "attention_forward", "attention_backward"})


#: The dtype of the array behind each C pointer type (bf16 and f16: 16-bit storage, `halves`).
POINTER_DTYPES = {"float": np.dtype(np.float32), "double": np.dtype(np.float64), "bf16": halves.BF16_BITS,
                  "f16": halves.F16, "long long": np.dtype(np.int64), "unsigned long long": np.dtype(np.uint64),
                  "int": np.dtype(np.int32), "unsigned int": np.dtype(np.uint32), "unsigned char": np.dtype(np.uint8)}


def pointer_dtype(ctype: str) -> np.dtype:
    """The array dtype a pointer parameter of C type `ctype` ("const bf16*") reads or writes."""
    return POINTER_DTYPES[ctype.rstrip("*").replace("const ", "").strip()]


def _dtypes(arrays) -> list[str]:
    return [str(np.dtype(a.dtype)) for a in arrays if a is not None]


def form(name: str, *arrays) -> str:
    """The entry point of kernel `name` for the storage of `arrays` (None skipped): all float32, or all one half."""
    kinds = {halves.half_of(a) for a in arrays if a is not None}
    if len(kinds) > 1:
        raise TypeError(f"{name}: the arrays mix storages {_dtypes(arrays)}; they must all be float32 or all one "
                        f"half's")
    entry = halves.variant(name, kinds.pop() if kinds else None)
    if entry not in ks.KERNELS:
        raise TypeError(f"{name}: no kernel {entry} in kernels/*.cu for arrays of {_dtypes(arrays)}")
    return entry


def pack_launch(name: str, args: Sequence, work, limits: DeviceLimits = DeviceLimits()) -> KernelLaunch:
    """Coerce `args` to kernel `name`'s C types and compute its launch for `work`. Pointers must be arrays
    (or None where `NULLABLE_POINTERS` allows) of their C type: the driver would dereference a Python number,
    and a kernel reads whatever bytes it is given."""
    spec = ks.KERNELS[name]
    coerced = ks.coerce_scalars(name, args)
    for a, v in zip(spec.args, coerced):
        if not a.is_pointer:
            continue
        if v is None:
            if (spec.base, a.name) not in NULLABLE_POINTERS:
                raise TypeError(f"{name}: pointer argument {a.name!r} ({a.ctype}) is None")
        elif not hasattr(v, "shape") or isinstance(v, np.generic):
            raise TypeError(f"{name}: pointer argument {a.name!r} ({a.ctype}) must be an array, got "
                            f"{type(v).__name__}")
        elif np.dtype(v.dtype) != pointer_dtype(a.ctype):
            raise TypeError(f"{name}: pointer argument {a.name!r} ({a.ctype}) must be a "
                            f"{pointer_dtype(a.ctype)} array, got {v.dtype}")
    grid, block = ks.launch_config(name, work, limits.max_threads_per_block, limits.sm_count)
    return KernelLaunch(name, grid, block, coerced)


def _size(a) -> int:
    return math.prod(a.shape)


def _same_size(name: str, *arrays) -> int:
    n = _size(arrays[0])
    for a in arrays[1:]:
        if _size(a) != n:
            raise ValueError(f"{name}: arrays of sizes {[_size(x) for x in arrays]} must all have {n} elements")
    return n


def _pair(v) -> tuple[int, int]:
    t = tuple(int(a) for a in v)
    if len(t) != 2:
        raise ValueError(f"expected a pair, got {v!r}")
    return t  # type: ignore[return-value]


# -- elementwise.cu
def relu_forward(y, x, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("relu_forward", y, x)
    return pack_launch(form("relu_forward", y, x), (y, x, n), n, limits)


def relu_backward(dx, y, dy, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("relu_backward", dx, y, dy)
    return pack_launch(form("relu_backward", dx, y, dy), (dx, y, dy, n), n, limits)


def add_forward(out, a, b, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("add_forward", out, a, b)
    return pack_launch(form("add_forward", out, a, b), (out, a, b, n), n, limits)


#: The inputs one `add_many` launch sums (its slots in kernels/elementwise.cu).
ADD_ARITY = 8


def add_many(out, *xs, limits=DeviceLimits()) -> KernelLaunch:
    """out = the sum of 2 to `ADD_ARITY` arrays `xs`, in float32 left to right, stored once."""
    if not 2 <= len(xs) <= ADD_ARITY:
        raise ValueError(f"add_many: sums 2 to {ADD_ARITY} arrays, got {len(xs)}")
    n = _same_size("add_many", out, *xs)
    slots = (*xs, *(xs[0],) * (ADD_ARITY - len(xs)))     # unread: any array of the storage
    return pack_launch(form("add_many", out, *xs), (out, *slots, len(xs), n), n, limits)


def round_copy(out, x, limits=DeviceLimits()) -> KernelLaunch:
    """out (half) = the float32 `x` rounded to nearest even: a weight's half copy refreshed from its master."""
    n = _same_size("round_copy", out, x)
    return pack_launch(form("round_copy", out), (out, x, n), n, limits)


def widen_copy(out, x, limits=DeviceLimits()) -> KernelLaunch:
    """out (float32) = the half `x`'s values, exactly."""
    n = _same_size("widen_copy", out, x)
    return pack_launch(form("widen_copy", x), (out, x, n), n, limits)


def accumulate(dst, src, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("accumulate", dst, src)
    return pack_launch(form("accumulate", dst, src), (dst, src, n), n, limits)


def scale_copy(out, x, scale: float, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("scale_copy", out, x)
    return pack_launch("scale_copy", (out, x, n, scale), n, limits)


def _dropout(name, out, x, p: float, key: int, limits) -> KernelLaunch:
    n = _same_size(name, out, x)
    return pack_launch(form(name, out, x), (out, x, n, int(key) & 0xFFFFFFFFFFFFFFFF, dropout_threshold24(p),
                                            dropout_scale(p)), n, limits)


def dropout_forward(out, x, p: float, key: int, limits=DeviceLimits()) -> KernelLaunch:
    return _dropout("dropout_forward", out, x, p, key, limits)


def dropout_backward(dx, dy, p: float, key: int, limits=DeviceLimits()) -> KernelLaunch:
    return _dropout("dropout_backward", dx, dy, p, key, limits)


def _dropout_dev(name, out, x, p: float, key, limits) -> KernelLaunch:
    n = _same_size(name, out, x)
    if int(math.prod(key.shape)) != 1 or np.dtype(key.dtype) != np.uint64:
        raise ValueError(f"{name}: the key must be one uint64 in device memory, got {key.shape} {key.dtype}")
    return pack_launch(form(name, out, x), (out, x, n, key, dropout_threshold24(p), dropout_scale(p)), n, limits)


def dropout_forward_dev(out, x, p: float, key, limits=DeviceLimits()) -> KernelLaunch:
    """dropout_forward with `key` a one-element uint64 device array."""
    return _dropout_dev("dropout_forward_dev", out, x, p, key, limits)


def dropout_backward_dev(dx, dy, p: float, key, limits=DeviceLimits()) -> KernelLaunch:
    """dropout_backward with `key` a one-element uint64 device array."""
    return _dropout_dev("dropout_backward_dev", dx, dy, p, key, limits)


def _concat_dims(name, part, whole, c0: int) -> tuple[int, int, int, int]:
    ps, ws = tuple(part.shape), tuple(whole.shape)
    if len(ps) < 2 or len(ps) != len(ws) or ps[0] != ws[0] or ps[2:] != ws[2:]:
        raise ValueError(f"{name}: part {ps} and concatenation {ws} differ outside axis 1")
    if not 0 <= c0 <= ws[1] - ps[1]:
        raise ValueError(f"{name}: channels [{c0}, {c0 + ps[1]}) do not fit in {ws[1]}")
    return ps[0], ps[1], math.prod(ps[2:]), ws[1]


def concat_copy_forward(out, x, c0: int, limits=DeviceLimits()) -> KernelLaunch:
    n, ci, inner, ct = _concat_dims("concat_copy_forward", x, out, c0)
    return pack_launch(form("concat_copy_forward", out, x), (out, x, n, ci, inner, ct, c0), _size(x), limits)


def concat_copy_backward(dx, dout, c0: int, limits=DeviceLimits()) -> KernelLaunch:
    n, ci, inner, ct = _concat_dims("concat_copy_backward", dx, dout, c0)
    return pack_launch(form("concat_copy_backward", dx, dout), (dx, dout, n, ci, inner, ct, c0), _size(dx), limits)


def _ncl(name, x) -> tuple[int, int, int]:
    s = tuple(x.shape)
    if len(s) < 2:
        raise ValueError(f"{name}: expected (N, C, ...), got {s}")
    return s[0], s[1], math.prod(s[2:])


def lrn_forward(y, x, size: int, alpha: float, beta: float, k: float, limits=DeviceLimits()) -> KernelLaunch:
    _same_size("lrn_forward", y, x)
    n, c, inner = _ncl("lrn_forward", x)
    return pack_launch(form("lrn_forward", y, x), (y, x, n, c, inner, size, alpha, beta, k), _size(x), limits)


def lrn_backward(dx, x, y, dy, size: int, alpha: float, beta: float, k: float,
                 limits=DeviceLimits()) -> KernelLaunch:
    _same_size("lrn_backward", dx, x, y, dy)
    n, c, inner = _ncl("lrn_backward", x)
    return pack_launch(form("lrn_backward", dx, x, y, dy), (dx, x, y, dy, n, c, inner, size, alpha, beta, k),
                       _size(x), limits)


# -- loss.cu
def _logits_dims(name, logits, labels) -> tuple[int, int]:
    s = tuple(logits.shape)
    if len(s) != 2 or tuple(labels.shape) != (s[0],):
        raise ValueError(f"{name}: logits must be (N, K) and labels (N,), got {s} and {tuple(labels.shape)}")
    return s


def softmax_xent_forward(loss_rows, logits, labels, limits=DeviceLimits()) -> KernelLaunch:
    """Per-row losses into `loss_rows` (at least N floats of scratch)."""
    n, k = _logits_dims("softmax_xent_forward", logits, labels)
    if _size(loss_rows) < n:
        raise ValueError(f"softmax_xent_forward: the row-loss buffer holds {_size(loss_rows)} < {n} values")
    return pack_launch(form("softmax_xent_forward", logits), (loss_rows, logits, labels, n, k), (n, k), limits)


def softmax_xent_mean(out, loss_rows, n: int, limits=DeviceLimits()) -> KernelLaunch:
    if _size(out) != 1 or _size(loss_rows) < n:
        raise ValueError(f"softmax_xent_mean: out must hold 1 value and the rows {n}")
    return pack_launch("softmax_xent_mean", (out, loss_rows, n), n, limits)


def softmax_xent_backward(dlogits, logits, labels, scale: float, limits=DeviceLimits(), dloss=None) -> KernelLaunch:
    """dlogits = (softmax - onehot) * scale; a half form also times `dloss` (the loss's float32 gradient, one
    value on the device) before it rounds, where the float32 form's caller multiplies afterwards (dloss None)."""
    n, k = _logits_dims("softmax_xent_backward", logits, labels)
    _same_size("softmax_xent_backward", dlogits, logits)
    name = form("softmax_xent_backward", dlogits, logits)
    if (name == "softmax_xent_backward") != (dloss is None):
        raise ValueError(f"{name}: the half forms take dloss, the float32 form does not (its caller multiplies)")
    if dloss is not None and _size(dloss) != 1:
        raise ValueError(f"{name}: dloss must hold 1 value, got {_size(dloss)}")
    extra = () if dloss is None else (dloss,)
    return pack_launch(name, (dlogits, logits, labels, n, k, scale, *extra), (n, k), limits)


def softmax_xent_ignore_forward(loss_rows, logits, labels, ignore_index: int,
                                limits=DeviceLimits()) -> KernelLaunch:
    """Per-row losses into `loss_rows` (N floats of scratch), 0 for ignored rows."""
    n, k = _logits_dims("softmax_xent_ignore_forward", logits, labels)
    if _size(loss_rows) < n:
        raise ValueError(f"softmax_xent_ignore_forward: the row-loss buffer holds {_size(loss_rows)} < {n} values")
    return pack_launch(form("softmax_xent_ignore_forward", logits), (loss_rows, logits, labels, n, k, ignore_index),
                       (n, k), limits)


def softmax_xent_ignore_mean(out, loss_rows, labels, ignore_index: int, limits=DeviceLimits()) -> KernelLaunch:
    n = _size(labels)
    if _size(out) != 1 or _size(loss_rows) < n:
        raise ValueError(f"softmax_xent_ignore_mean: out must hold 1 value and the rows {n}")
    return pack_launch("softmax_xent_ignore_mean", (out, loss_rows, labels, n, ignore_index), n, limits)


def softmax_xent_ignore_scale(scale, dloss, labels, ignore_index: int, limits=DeviceLimits()) -> KernelLaunch:
    n = _size(labels)
    if _size(scale) != 1 or _size(dloss) != 1:
        raise ValueError("softmax_xent_ignore_scale: scale and dloss must hold 1 value each")
    return pack_launch("softmax_xent_ignore_scale", (scale, dloss, labels, n, ignore_index), n, limits)


def softmax_xent_ignore_backward(dlogits, logits, labels, scale, ignore_index: int,
                                 limits=DeviceLimits()) -> KernelLaunch:
    n, k = _logits_dims("softmax_xent_ignore_backward", logits, labels)
    _same_size("softmax_xent_ignore_backward", dlogits, logits)
    if _size(scale) != 1:
        raise ValueError("softmax_xent_ignore_backward: scale must hold 1 value (softmax_xent_ignore_scale's)")
    return pack_launch(form("softmax_xent_ignore_backward", dlogits, logits),
                       (dlogits, logits, labels, scale, n, k, ignore_index), (n, k), limits)


# -- optim.cu
def sgd_update(p, g, buf, lr, momentum, dampening, weight_decay, nesterov, first_step,
               limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("sgd_update", p, g)
    if momentum:
        if buf is None:
            raise ValueError("sgd_update: momentum != 0 needs a momentum buffer")
        _same_size("sgd_update", p, buf)
    else:
        buf = None  # never touched by the kernel
    return pack_launch("sgd_update", (p, g, buf, n, lr, momentum, dampening, weight_decay, int(bool(nesterov)),
                                      int(bool(first_step))), n, limits)


def _device_doubles(name, a, count: int) -> None:
    if int(math.prod(a.shape)) != count or np.dtype(a.dtype) != np.float64:
        raise ValueError(f"{name}: expects {count} float64 value(s) in device memory, got {a.shape} {a.dtype}")


def _device_flag(name, a) -> None:
    if int(math.prod(a.shape)) != 1 or np.dtype(a.dtype) != np.int32:
        raise ValueError(f"{name}: the divergence flag must be one int32 in device memory, got {a.shape} {a.dtype}")


def nonfinite_flag(flag, x, code: int, limits=DeviceLimits()) -> KernelLaunch:
    """Set `flag` (one int32 on the device) to `code` if `x` holds a NaN or an infinity and it is still 0."""
    _device_flag("nonfinite_flag", flag)
    if int(code) == 0:
        raise ValueError("nonfinite_flag: code 0 means 'finite'; give a non-zero code")
    n = _size(x)
    return pack_launch("nonfinite_flag", (flag, x, n, int(code)), n, limits)


def sgd_update_dev(p, g, buf, lr, momentum, dampening, weight_decay, nesterov, first_step, diverged,
                   limits=DeviceLimits()) -> KernelLaunch:
    """sgd_update with `lr` on the device, skipped while the int32 `diverged` flag is set."""
    n = _same_size("sgd_update_dev", p, g)
    _device_doubles("sgd_update_dev", lr, 1)
    _device_flag("sgd_update_dev", diverged)
    if momentum:
        if buf is None:
            raise ValueError("sgd_update_dev: momentum != 0 needs a momentum buffer")
        _same_size("sgd_update_dev", p, buf)
    else:
        buf = None
    return pack_launch("sgd_update_dev", (p, g, buf, n, lr, momentum, dampening, weight_decay,
                                          int(bool(nesterov)), int(bool(first_step)), diverged), n, limits)


def adam_update_dev(p, g, m, v, scalars, beta1, beta2, eps, weight_decay, diverged,
                    limits=DeviceLimits()) -> KernelLaunch:
    """adam_update with [lr, step] on the device, skipped while `diverged` is set."""
    n = _same_size("adam_update_dev", p, g, m, v)
    _device_doubles("adam_update_dev", scalars, 2)
    _device_flag("adam_update_dev", diverged)
    return pack_launch("adam_update_dev", (p, g, m, v, n, scalars, beta1, beta2, eps, weight_decay, diverged), n,
                       limits)


def adam_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("adam_update", p, g, m, v)
    if int(step) < 1:
        raise ValueError(f"adam_update: step is 1-based, got {step}")
    return pack_launch("adam_update", (p, g, m, v, n, lr, beta1, beta2, eps, weight_decay, int(step)), n, limits)


# -- pool.cu
def _pool_dims(name, x_shape, y_shape) -> tuple[int, ...]:
    xs, ys = tuple(x_shape), tuple(y_shape)
    if len(xs) != 4 or len(ys) != 4 or xs[:2] != ys[:2]:
        raise ValueError(f"{name}: input {xs} and output {ys} must be NCHW with the same N and C")
    return xs + ys[2:]


def maxpool2d_forward(y, x, kernel, stride, padding, dilation, limits=DeviceLimits()) -> KernelLaunch:
    dims = _pool_dims("maxpool2d_forward", x.shape, y.shape)
    return pack_launch(form("maxpool2d_forward", y, x), (y, x, *dims, *_pair(kernel), *_pair(stride),
                                                         *_pair(padding), *_pair(dilation)), _size(y), limits)


def maxpool2d_backward(dx, dy, x, kernel, stride, padding, dilation, limits=DeviceLimits()) -> KernelLaunch:
    """float32: the host must zero `dx` first (ZERO_OUTPUT_FIRST), the kernel adds into it atomically, a thread
    per output; the half forms gather, a thread per input element, and overwrite dx."""
    if tuple(dx.shape) != tuple(x.shape):
        raise ValueError(f"maxpool2d_backward: dx {tuple(dx.shape)} must match x {tuple(x.shape)}")
    dims = _pool_dims("maxpool2d_backward", x.shape, dy.shape)
    name = form("maxpool2d_backward", dx, dy, x)
    return pack_launch(name, (dx, dy, x, *dims, *_pair(kernel), *_pair(stride), *_pair(padding), *_pair(dilation)),
                       _size(dy) if name in ZERO_OUTPUT_FIRST else _size(dx), limits)


def avgpool2d_forward(y, x, kernel, stride, padding, count_include_pad: bool, divisor_override: int = 0,
                      limits=DeviceLimits()) -> KernelLaunch:
    dims = _pool_dims("avgpool2d_forward", x.shape, y.shape)
    return pack_launch(form("avgpool2d_forward", y, x), (y, x, *dims, *_pair(kernel), *_pair(stride),
                                                         *_pair(padding), int(bool(count_include_pad)),
                                                         int(divisor_override)), _size(y), limits)


def avgpool2d_backward(dx, dy, kernel, stride, padding, count_include_pad: bool, divisor_override: int = 0,
                       limits=DeviceLimits()) -> KernelLaunch:
    dims = _pool_dims("avgpool2d_backward", dx.shape, dy.shape)
    return pack_launch(form("avgpool2d_backward", dx, dy), (dx, dy, *dims, *_pair(kernel), *_pair(stride),
                                                           *_pair(padding), int(bool(count_include_pad)),
                                                           int(divisor_override)), _size(dx), limits)


def _gap_dims(name, x_shape, y_shape) -> tuple[int, int]:
    xs, ys = tuple(x_shape), tuple(y_shape)
    if len(xs) != 4 or ys != xs[:2]:
        raise ValueError(f"{name}: input must be (N, C, H, W) and output (N, C), got {xs} and {ys}")
    return xs[0] * xs[1], xs[2] * xs[3]


def global_avgpool_forward(y, x, limits=DeviceLimits()) -> KernelLaunch:
    nc, hw = _gap_dims("global_avgpool_forward", x.shape, y.shape)
    return pack_launch(form("global_avgpool_forward", y, x), (y, x, nc, hw), (nc, hw), limits)


def global_avgpool_backward(dx, dy, limits=DeviceLimits()) -> KernelLaunch:
    nc, hw = _gap_dims("global_avgpool_backward", dx.shape, dy.shape)
    return pack_launch(form("global_avgpool_backward", dx, dy), (dx, dy, nc, hw), _size(dx), limits)


# -- compress.cu (the SZ codec; layout as in minidl/codec/sz.py)
SZ_BLOCK = 256          # codes per block (one thread block of 256 threads)
SZ_PLANE_WORDS = 8      # 32-bit words per bit-plane of a block (SZ_BLOCK / 32)
SZ_MAX_PLANES = 64      # fixed plane slots per block before compaction


def _sz_blocks(name: str, n: int, nblocks: int) -> None:
    if nblocks != -(-n // SZ_BLOCK):
        raise ValueError(f"{name}: {n} codes need {-(-n // SZ_BLOCK)} blocks of {SZ_BLOCK}, got {nblocks}")


def sz_quantize(bins, outlier, x, eb, limits=DeviceLimits()) -> KernelLaunch:
    """float32 only: a half mode's activations are never compressed (`memory.decisions.compress` takes float32
    and float64 tensors), as on the CPU."""
    if np.dtype(x.dtype) != np.float32:
        raise TypeError(f"sz_quantize: the SZ codec encodes float32, got {x.dtype} (a half tensor is not a "
                        f"compression candidate in any math mode)")
    n = _same_size("sz_quantize", bins, outlier, x)
    return pack_launch("sz_quantize", (bins, outlier, x, n, eb), n, limits)


def sz_encode_blocks(planes, widths, anchors, bins, limits=DeviceLimits()) -> KernelLaunch:
    n, nblocks = _size(bins), _same_size("sz_encode_blocks", widths, anchors)
    _sz_blocks("sz_encode_blocks", n, nblocks)
    if _size(planes) != nblocks * SZ_MAX_PLANES * SZ_PLANE_WORDS:
        raise ValueError(f"sz_encode_blocks: planes has {_size(planes)} words, expected "
                         f"{nblocks * SZ_MAX_PLANES * SZ_PLANE_WORDS} for {nblocks} blocks")
    return pack_launch("sz_encode_blocks", (planes, widths, anchors, bins, n, nblocks), (nblocks, SZ_BLOCK), limits)


def sz_gather_planes(body, planes, widths, starts, limits=DeviceLimits()) -> KernelLaunch:
    nblocks = _same_size("sz_gather_planes", widths, starts)
    work = nblocks * SZ_MAX_PLANES * SZ_PLANE_WORDS
    if _size(planes) != work:
        raise ValueError(f"sz_gather_planes: planes has {_size(planes)} words, expected {work}")
    return pack_launch("sz_gather_planes", (body, planes, widths, starts, nblocks), work, limits)


def sz_decode_blocks(y, body, widths, starts, anchors, eb, limits=DeviceLimits()) -> KernelLaunch:
    n, nblocks = _size(y), _same_size("sz_decode_blocks", widths, starts, anchors)
    _sz_blocks("sz_decode_blocks", n, nblocks)
    return pack_launch("sz_decode_blocks", (y, body, widths, starts, anchors, n, nblocks, eb), (nblocks, SZ_BLOCK),
                       limits)


def sz_scatter_outliers(y, idx, vals, limits=DeviceLimits()) -> KernelLaunch:
    n_out = _same_size("sz_scatter_outliers", idx, vals)
    return pack_launch("sz_scatter_outliers", (y, idx, vals, n_out), n_out, limits)


# -- seq.cu
def _rows_cols(name, x) -> tuple[int, int]:
    """(R, C) of a tensor read as rows of its last axis."""
    if len(x.shape) < 1:
        raise ValueError(f"{name}: a tensor of at least one axis is needed, got shape {tuple(x.shape)}")
    c = int(x.shape[-1])
    return (_size(x) // c if c else 0), c


def _vectors(name, c: int, **vectors) -> None:
    for label, v in vectors.items():
        if v is not None and _size(v) != c:
            raise ValueError(f"{name}: {label} holds {_size(v)} values, the rows have {c}")


def _row_stats(name, r: int, **stats) -> None:
    for label, v in stats.items():
        if _size(v) != r:
            raise ValueError(f"{name}: {label} holds {_size(v)} values for {r} rows")


def layernorm_forward(y, mean, rstd, x, w, b, eps: float, limits=DeviceLimits()) -> KernelLaunch:
    r, c = _rows_cols("layernorm_forward", x)
    _same_size("layernorm_forward", y, x)
    _vectors("layernorm_forward", c, w=w, b=b)
    _row_stats("layernorm_forward", r, mean=mean, rstd=rstd)
    return pack_launch(form("layernorm_forward", y, x), (y, mean, rstd, x, w, b, r, c, eps), (r, c), limits)


def layernorm_forward_apply(y, x, w, b, mean, rstd, limits=DeviceLimits()) -> KernelLaunch:
    r, c = _rows_cols("layernorm_forward_apply", x)
    _same_size("layernorm_forward_apply", y, x)
    _vectors("layernorm_forward_apply", c, w=w, b=b)
    _row_stats("layernorm_forward_apply", r, mean=mean, rstd=rstd)
    return pack_launch(form("layernorm_forward_apply", y, x), (y, x, w, b, mean, rstd, r, c), r * c, limits)


def layernorm_backward_dx(dx, x, w, dy, mean, rstd, limits=DeviceLimits()) -> KernelLaunch:
    r, c = _rows_cols("layernorm_backward_dx", x)
    _same_size("layernorm_backward_dx", dx, x, dy)
    _vectors("layernorm_backward_dx", c, w=w)
    _row_stats("layernorm_backward_dx", r, mean=mean, rstd=rstd)
    return pack_launch(form("layernorm_backward_dx", dx, x, dy), (dx, x, w, dy, mean, rstd, r, c), (r, c), limits)


#: Layer norm's dw, db: chunks of rows at most (float64 partials: LN_CHUNKS x C x 16 bytes), LN_MIN_CHUNK rows each.
LN_CHUNKS = 64
LN_MIN_CHUNK = 32


def layernorm_chunks(rows: int) -> tuple[int, int]:
    """(rows per chunk, chunks) of layer norm's weight and bias sums over `rows` rows."""
    chunk = max(LN_MIN_CHUNK, -(-rows // LN_CHUNKS))
    return chunk, max(1, -(-rows // chunk))


def layernorm_backward_partials(pw, pb, x, dy, mean, rstd, limits=DeviceLimits()) -> KernelLaunch:
    r, c = _rows_cols("layernorm_backward_partials", x)
    _same_size("layernorm_backward_partials", x, dy)
    _row_stats("layernorm_backward_partials", r, mean=mean, rstd=rstd)
    chunk, n = layernorm_chunks(r)
    for label, buf in (("pw", pw), ("pb", pb)):
        if _size(buf) < n * c or np.dtype(buf.dtype) != np.float64:
            raise ValueError(f"layernorm_backward_partials: {label} must hold {n} x {c} float64 partial sums, "
                             f"got {_size(buf)} {buf.dtype}")
    return pack_launch(form("layernorm_backward_partials", x, dy), (pw, pb, x, dy, mean, rstd, r, c, chunk), n * c,
                       limits)


def layernorm_backward_params(dw, db, pw, pb, rows: int, limits=DeviceLimits()) -> KernelLaunch:
    """dw, db from the partial sums `layernorm_backward_partials` left for `rows` rows."""
    c = _size(dw if dw is not None else db)
    _vectors("layernorm_backward_params", c, dw=dw, db=db)
    _, n = layernorm_chunks(rows)
    return pack_launch("layernorm_backward_params", (dw, db, pw, pb, n, c), c, limits)


def _exact(approximate: str) -> int:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return int(approximate == "none")


def gelu_forward(y, x, approximate: str, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("gelu_forward", y, x)
    return pack_launch(form("gelu_forward", y, x), (y, x, n, _exact(approximate)), n, limits)


def gelu_backward(dx, x, dy, approximate: str, limits=DeviceLimits()) -> KernelLaunch:
    n = _same_size("gelu_backward", dx, x, dy)
    return pack_launch(form("gelu_backward", dx, x, dy), (dx, x, dy, n, _exact(approximate)), n, limits)


def softmax_forward(y, x, scale: float = 1.0, causal_t: int = 0, limits=DeviceLimits()) -> KernelLaunch:
    """Rows of x's last axis; `causal_t` > 0: (T, T) score matrices, row r attending to keys 0..r mod T."""
    r, c = _rows_cols("softmax_forward", x)
    _same_size("softmax_forward", y, x)
    if causal_t and c != causal_t:
        raise ValueError(f"softmax_forward: a causal mask over {causal_t} keys needs rows of {causal_t}, got {c}")
    return pack_launch(form("softmax_forward", y, x), (y, x, r, c, scale, causal_t), (r, c), limits)


def softmax_backward(dx, y, dy, scale: float = 1.0, limits=DeviceLimits()) -> KernelLaunch:
    r, c = _rows_cols("softmax_backward", y)
    _same_size("softmax_backward", dx, y, dy)
    return pack_launch(form("softmax_backward", dx, y, dy), (dx, y, dy, r, c, scale), (r, c), limits)


def _table(name, idx, w, rows) -> tuple[int, int, int]:
    if len(w.shape) != 2:
        raise ValueError(f"{name}: the table must be (V, C), got shape {tuple(w.shape)}")
    v, c = (int(d) for d in w.shape)
    r = _size(idx)
    if _size(rows) != r * c:
        raise ValueError(f"{name}: {r} indices of rows of {c} values need {r * c} values, got {_size(rows)}")
    return r, c, v


def embedding_forward(y, w, idx, limits=DeviceLimits()) -> KernelLaunch:
    r, c, v = _table("embedding_forward", idx, w, y)
    return pack_launch(form("embedding_forward", y), (y, w, idx, r, c, v), r * c, limits)


#: embedding_backward's threads (vocabulary ranges x columns): enough to fill a GPU, one a column would not.
EMBEDDING_THREADS = 1 << 16


def embedding_groups(c: int, v: int) -> int:
    """How many vocabulary ranges embedding_backward splits a (V, C) table's gradient into."""
    return max(1, min(v, -(-EMBEDDING_THREADS // max(1, c))))


def embedding_backward(dw, dy, idx, limits=DeviceLimits()) -> KernelLaunch:
    """dw must be zeroed first (`ZERO_OUTPUT_FIRST`): the kernel adds into it."""
    r, c, v = _table("embedding_backward", idx, dw, dy)
    groups = embedding_groups(c, v)
    return pack_launch(form("embedding_backward", dy), (dw, dy, idx, r, c, v, groups), groups * c, limits)


def _positions(name, x, w) -> tuple[int, int]:
    """(B, T*C) of x (B, T, C) reading the first T rows of a (P, C) position table."""
    xs, ws = tuple(x.shape), tuple(w.shape)
    if len(xs) != 3 or len(ws) != 2 or ws[1] != xs[2] or ws[0] < xs[1]:
        raise ValueError(f"{name}: x must be (B, T, C) and the table (P >= T, C), got {xs} and {ws}")
    return xs[0], xs[1] * xs[2]


def position_embedding_forward(y, x, w, limits=DeviceLimits()) -> KernelLaunch:
    b, tc = _positions("position_embedding_forward", x, w)
    _same_size("position_embedding_forward", y, x)
    return pack_launch(form("position_embedding_forward", y, x), (y, x, w, b, tc), b * tc, limits)


def position_embedding_backward(dw, dy, limits=DeviceLimits()) -> KernelLaunch:
    """dw's first T rows = the batch sums of dy; the host zeroes the rows past T."""
    b, tc = _positions("position_embedding_backward", dy, dw)
    return pack_launch(form("position_embedding_backward", dy), (dw, dy, b, tc), tc, limits)


#: kernel name -> the function that packs its launch, for every kernel of kernels/*.cu by its `base` name (a
#: launcher picks the form: `form`).
LAUNCHERS: dict[str, Callable[..., KernelLaunch]] = {
    f.__name__: f for f in (
        relu_forward, relu_backward, add_forward, add_many, accumulate, scale_copy, dropout_forward, dropout_backward,
        dropout_forward_dev, dropout_backward_dev, sgd_update_dev, adam_update_dev, nonfinite_flag,
        concat_copy_forward, concat_copy_backward, lrn_forward, lrn_backward, softmax_xent_forward,
        softmax_xent_mean, softmax_xent_backward, sgd_update, adam_update, maxpool2d_forward, maxpool2d_backward,
        avgpool2d_forward, avgpool2d_backward, global_avgpool_forward, global_avgpool_backward,
        sz_quantize, sz_encode_blocks, sz_gather_planes, sz_decode_blocks, sz_scatter_outliers,
        softmax_xent_ignore_forward, softmax_xent_ignore_mean, softmax_xent_ignore_scale,
        softmax_xent_ignore_backward, layernorm_forward, layernorm_forward_apply, layernorm_backward_dx,
        layernorm_backward_partials, layernorm_backward_params, gelu_forward, gelu_backward, softmax_forward,
        softmax_backward, embedding_forward, embedding_backward, position_embedding_forward,
        position_embedding_backward, round_copy, widen_copy)
}
