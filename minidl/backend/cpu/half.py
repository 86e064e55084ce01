"""Half-precision storage on the CPU: kernels take bf16/fp16 arrays, compute with the float32 kernels, round on store.

Rules (the contract is `minidl.backend.precision`):
* One conversion point per call (`half_io`): half arrays read into float32 copies (exact), written copies
  rounded back to nearest even; float32 arrays pass through.
* `STAGED` kernels take copies from the backend's `Staging` (workspace a plan counts), but for those whose compiled
  form reads and writes half bits itself (`norm.COMPILED_HALF`, with numba); `ELEMENTWISE` ones run `CHUNK` values
  at a time over the lanes; `NATIVE` ones take half values as they are.
* A written array is the very array another argument names or disjoint from it: copies are shared by identity.
* A half array reaching a `FLOAT32_ONLY` kernel is an error naming the kernel and argument.
"""
from __future__ import annotations

import functools
import inspect
import math

import numpy as np

from ...core.errors import OptionError
from ..precision import HALF_DTYPES, is_half
from . import lanes, norm
from .jit import PARALLEL_MIN, lazy, workers_for

half_kernels = lazy("half_jit")

R, W, RW = "r", "w", "rw"   # a kernel reads an argument, writes it, or both
ALIGN = 64                  # bytes: each staged copy starts on a cache line (and an AVX-512 vector)
CHUNK = PARALLEL_MIN // 2   # values per elementwise chunk: 128 KiB of float32 a copy, in L2, one thread
_BF16 = HALF_DTYPES["bf16"]

#: Kernels run on float32 copies of all their half arrays at once (`Staging`), by argument name.
STAGED: dict[str, dict[str, str]] = {
    "linear_forward": {"x": R, "w": R, "b": R, "y": W},
    "linear_backward": {"x": R, "w": R, "dy": R, "dx": W},
    "conv2d_forward": {"x": R, "w": R, "b": R, "y": W},
    "conv2d_backward": {"x": R, "w": R, "dy": R, "dx": W},
    "maxpool2d_forward": {"x": R, "y": W},
    "maxpool2d_backward": {"x": R, "dy": R, "dx": W},
    "avgpool2d_forward": {"x": R, "y": W},
    "avgpool2d_backward": {"dy": R, "dx": W},
    "global_avgpool_forward": {"x": R, "y": W},
    "global_avgpool_backward": {"dy": R, "dx": W},
    "lrn_forward": {"x": R, "y": W},
    "lrn_backward": {"x": R, "y": R, "dy": R, "dx": W},
    "batchnorm_forward_train": {"x": R, "y": W, "relu_out": W},
    "batchnorm_forward_apply": {"x": R, "y": W},
    "batchnorm_forward_eval": {"x": R, "y": W},
    "batchnorm_backward": {"x": R, "dy": RW, "dx": W, "relu": R},  # the fused ReLU's backward may write dy
    "batchnorm_backward_eval": {"x": R, "dy": R, "dx": W},
    "softmax_xent_forward": {"logits": R},
    "softmax_xent_backward": {"logits": R, "dlogits": W},
    "softmax_xent_ignore_forward": {"logits": R},
    "softmax_xent_ignore_backward": {"logits": R, "dlogits": W},
    "layernorm_forward": {"x": R, "y": W},
    "layernorm_forward_apply": {"x": R, "y": W},
    "layernorm_backward": {"x": R, "dy": R, "dx": W},
    "embedding_forward": {"y": W},
    "embedding_backward": {"dy": R},
    "position_embedding_forward": {"x": R, "y": W},
    "position_embedding_backward": {"dy": R, "dx": W},
    "softmax_forward": {"x": R, "y": W},
    "softmax_backward": {"y": R, "dy": R, "dx": W},
    "matmul_forward": {"a": R, "b": R, "y": W},
    "matmul_backward": {"a": R, "b": R, "dy": R, "da": W, "db": W},
    "attention_forward": {"q": R, "k": R, "v": R, "probs": W, "y": W},
    "attention_backward": {"q": R, "k": R, "v": R, "probs": R, "dy": R, "dq": W, "dk": W, "dv": W},
}
#: Staged kernels that read the array they write when the call accumulates (`accumulate=True`: a fork's later
#: convolution adds its input delta into the delta held): its copy starts from the stored values.
ACCUMULATING: dict[str, str] = {"conv2d_backward": "dx"}
#: Kernels that round their own intermediate (attention's probabilities) to the dtype given as `quantize=`.
QUANTIZING = frozenset({"attention_forward", "attention_backward"})
#: Elementwise kernels: all array arguments of one size, read or written value by value.
ELEMENTWISE: dict[str, dict[str, str]] = {
    "relu_forward": {"x": R, "y": W},
    "relu_backward": {"y": R, "dy": R, "dx": W},
    "add_forward": {"xs": R, "y": W, "relu_out": W},
    "add_relu_backward": {"y": R, "dy": R, "dx": W, "dinputs": W},
    "accumulate": {"dst": RW, "src": R},
    "gelu_forward": {"x": R, "y": W},
    "gelu_backward": {"x": R, "dy": R, "dx": W},
}
#: Kernels that take half arrays as they are (dropout converts in its own chunk loop).
NATIVE = frozenset({"copy", "copy_in", "fill", "to_host", "concat_forward", "concat_backward", "dropout_forward",
                    "dropout_backward"})
#: Kernels of float32 roles only (parameters, gradients, optimizer state).
FLOAT32_ONLY: dict[str, tuple[str, ...]] = {
    "sgd_update": ("p", "g", "buf"),
    "adam_update": ("p", "g", "m", "v"),
}
#: Every kernel that takes half arrays (`Capabilities.half_kernels`).
HALF_KERNELS = frozenset(STAGED) | frozenset(ELEMENTWISE) | NATIVE


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16)


def _as4(a: np.ndarray) -> np.ndarray:
    return a.reshape((1,) * (4 - a.ndim) + a.shape)


def widen_into(f: np.ndarray, h: np.ndarray) -> None:
    """f (float32) = the half h's values, on the calling thread: an OpenMP region per conversion cost more than it
    saved (ResNet-20 b32 bf16, 2 threads: 1.63x fp32's time on two workers, 0.93x on one)."""
    jit = half_kernels()
    bf = h.dtype == _BF16
    if jit is not None and h.flags.c_contiguous and f.flags.c_contiguous:
        jit.widen(_bits(h).reshape(-1), f.reshape(-1), bf)
    elif jit is not None and h.ndim <= 4:
        jit.widen_nd(_as4(_bits(h)), _as4(f), bf)
    else:
        np.copyto(f, h, casting="unsafe")


def narrow_into(h: np.ndarray, f: np.ndarray) -> None:
    """h (half) = f (float32) rounded to nearest even, on the calling thread."""
    jit = half_kernels()
    bf = h.dtype == _BF16
    if jit is not None and h.flags.c_contiguous and f.flags.c_contiguous:
        jit.narrow(f.reshape(-1), _bits(h).reshape(-1), bf)
    elif jit is not None and h.ndim <= 4:
        jit.narrow_nd(_as4(f), _as4(_bits(h)), bf)
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # fp16 overflows to inf
            np.copyto(h, f, casting="unsafe")


def quantize(f: np.ndarray, dtype) -> None:
    """f (float32, C-contiguous) rounded in place to the half `dtype`."""
    jit = half_kernels()
    if jit is None:
        with np.errstate(over="ignore", invalid="ignore"):
            f[...] = f.astype(dtype)
        return
    jit.quantize(f.reshape(-1), np.dtype(dtype) == _BF16)


def cast_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst = src: half values widened exactly, float32 ones rounded to nearest even."""
    if dst.dtype == src.dtype:
        np.copyto(dst, src)
    elif is_half(dst.dtype) and src.dtype == np.float32:
        narrow_into(dst, src)
    elif is_half(src.dtype) and dst.dtype == np.float32:
        widen_into(dst, src)
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(dst, src, casting="unsafe")


def staged_nbytes(shape) -> int:
    """The bytes of one staged float32 copy of `shape`, aligned to `ALIGN`."""
    return -(-4 * math.prod(shape) // ALIGN) * ALIGN


def staging_bytes(shapes) -> int:
    """One aligned float32 copy per distinct half array of a staged call."""
    return sum(staged_nbytes(s) for s in shapes)


class Staging:
    """The staged kernels' float32 copies: in the buffer the executor binds (planned workspace), else one grown here."""

    def __init__(self):
        self._bound: np.ndarray | None = None
        self._own = np.empty(0, np.uint8)
        self._chunks = np.empty(0, np.float32)
        self.high_water = 0

    def bind(self, buf: np.ndarray | None) -> None:
        """Take copies from `buf` (flat uint8); None: grow a buffer of its own."""
        if buf is not None and (buf.dtype != np.uint8 or buf.ndim != 1):
            raise ValueError(f"half staging must be a flat uint8 buffer, got {buf.dtype} {buf.shape}")
        self._bound = buf

    def buffer(self, kernel: str, nbytes: int) -> np.ndarray:
        self.high_water = max(self.high_water, nbytes)
        if self._bound is not None:
            if self._bound.nbytes < nbytes:
                raise ValueError(f"{kernel}: its half operands need {nbytes} bytes of float32 staging, the bound "
                                 f"staging has {self._bound.nbytes}")
            return self._bound
        if self._own.nbytes < nbytes:
            self._own = np.empty(nbytes, np.uint8)
        return self._own

    def chunks(self, values: int) -> np.ndarray:
        """A float32 scratch of `values` for the elementwise kernels' chunks."""
        if self._chunks.size < values:
            self._chunks = np.empty(values, np.float32)
        return self._chunks


def _carve(buf: np.ndarray, offset: int, shape) -> np.ndarray:
    return buf[offset:offset + 4 * math.prod(shape)].view(np.float32).reshape(shape)


def _key(a: np.ndarray):
    return a.__array_interface__["data"][0], a.shape, a.strides, a.dtype


def _has_half(value) -> bool:
    if isinstance(value, np.ndarray):
        return value.dtype in _HALF_SET
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, np.ndarray) and v.dtype in _HALF_SET for v in value)
    return False


_HALF_SET = frozenset(np.dtype(d) for d in HALF_DTYPES.values())


class _Args:
    """A call's arguments by name, and their replacement."""

    def __init__(self, positions: dict[str, int], args: tuple, kwargs: dict):
        self.positions, self.args, self.kwargs = positions, list(args), dict(kwargs)

    def get(self, name):
        i = self.positions[name]
        return self.args[i] if i < len(self.args) else self.kwargs.get(name)

    def set(self, name, value) -> None:
        i = self.positions[name]
        if i < len(self.args):
            self.args[i] = value
        else:
            self.kwargs[name] = value


def _map(value, fn):
    if isinstance(value, list):
        return [fn(v) for v in value]
    if isinstance(value, tuple):
        return tuple(fn(v) for v in value)
    return fn(value)


def _operands(spec: dict[str, str], call: _Args, halves: bool = True) -> dict:
    """The call's distinct (half, by default) arrays by identity: key -> (array, access)."""
    out: dict = {}
    for name, access in spec.items():
        value = call.get(name)
        for a in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(a, np.ndarray) and (not halves or a.dtype in _HALF_SET):
                k = _key(a)
                prev = out.get(k)
                out[k] = (a, access if prev is None or prev[1] == access else RW)
    return out


def _chunkable(spec: dict[str, str], call: _Args) -> dict | None:
    """The call's arrays if all are C-contiguous and of one size, else None."""
    arrays = _operands(spec, call, halves=False)
    if all(a.flags.c_contiguous for a, _ in arrays.values()) and len({a.size for a, _ in arrays.values()}) == 1:
        return arrays
    return None


def _compiled(kernel: str) -> bool:
    """Whether `kernel` runs compiled on half bits, staging nothing."""
    return kernel in norm.COMPILED_HALF and norm.jit_kernels() is not None


def call_staging(kernel: str, call: _Args) -> int:
    """The staging bytes a call of `kernel` takes (none when run elementwise in chunks or compiled on half bits)."""
    spec = STAGED.get(kernel) or ELEMENTWISE[kernel]
    if (kernel in ELEMENTWISE and _chunkable(spec, call) is not None) or _compiled(kernel):
        return 0
    return staging_bytes(a.shape for a, _ in _operands(spec, call).values())


def _stage(be, kernel: str, fn, spec: dict[str, str], call: _Args):
    """Run `fn` on float32 copies of the call's half arrays from the staging; round the written ones."""
    if _compiled(kernel):
        return fn(be, *call.args, **call.kwargs)
    acc = ACCUMULATING.get(kernel)
    arrays = _operands({**spec, acc: RW} if acc and call.get("accumulate") else spec, call)
    buf = be.staging.buffer(kernel, staging_bytes(a.shape for a, _ in arrays.values()))
    copies, offset = {}, 0
    for k, (a, access) in arrays.items():
        f = copies[k] = _carve(buf, offset, a.shape)
        offset += staged_nbytes(a.shape)
        if access != W:
            widen_into(f, a)
    swap = lambda v: copies[_key(v)] if isinstance(v, np.ndarray) and v.dtype in _HALF_SET else v
    for name in spec:
        call.set(name, _map(call.get(name), swap))
    if kernel in QUANTIZING:
        call.kwargs["quantize"] = next(a.dtype for a, _ in arrays.values())
    fn(be, *call.args, **call.kwargs)
    for k, (a, access) in arrays.items():
        if access != R:
            narrow_into(a, copies[k])


def _elementwise(be, kernel: str, fn, spec: dict[str, str], call: _Args):
    """Run `fn` a chunk at a time on float32 copies of the call's half arrays, the chunks over the lanes; staged
    unless `_chunkable`."""
    arrays = _chunkable(spec, call)
    if arrays is None:
        return _stage(be, kernel, fn, spec, call)
    if _one_pass(kernel, call, arrays):
        return None
    n = next(iter(arrays.values()))[0].size
    halves = [(k, a.reshape(-1), access) for k, (a, access) in arrays.items() if a.dtype in _HALF_SET]
    chunks = -(-n // CHUNK)
    shares = lanes.split(chunks, max(1, min(lanes.count(), chunks)))
    scratch = be.staging.chunks(len(shares) * len(halves) * CHUNK)

    def run(lane: int, c0: int, c1: int) -> None:
        for c in range(c0, c1):
            s, e = c * CHUNK, min(n, (c + 1) * CHUNK)
            views = {}
            for j, (k, a, access) in enumerate(halves):
                at = (lane * len(halves) + j) * CHUNK
                f = views[k] = scratch[at:at + e - s]
                if access != W:
                    widen_into(f, a[s:e])
            part = lambda v, views=views, s=s, e=e: (
                (views[_key(v)] if v.dtype in _HALF_SET else v.reshape(-1)[s:e]) if isinstance(v, np.ndarray) else v)
            mine = _Args(call.positions, call.args, call.kwargs)
            for name in spec:
                mine.set(name, _map(call.get(name), part))
            fn(be, *mine.args, **mine.kwargs)
            for k, a, access in halves:
                if access != R:
                    narrow_into(a[s:e], views[k])

    lanes.run([lambda lane=lane, c0=c0, c1=c1: run(lane, c0, c1) for lane, (c0, c1) in enumerate(shares)])


def _one_pass(kernel: str, call: _Args, arrays: dict) -> bool:
    """Run `kernel` as one `half_jit` pass over half bits, where it has one: whether it ran."""
    jit = half_kernels()
    dtypes = {a.dtype for a, _ in arrays.values()}
    if jit is None or len(dtypes) != 1 or not dtypes <= _HALF_SET:
        return False
    b = lambda a: a.reshape(-1).view(np.uint16)
    if kernel == "relu_forward":
        name, args = "relu_forward", (b(call.get("x")), b(call.get("y")))
    elif kernel == "relu_backward":
        name, args = "relu_backward", (b(call.get("y")), b(call.get("dy")), b(call.get("dx")))
    elif kernel == "accumulate":
        name, args = "add_into", (b(call.get("dst")), b(call.get("src")))
    elif kernel == "add_forward" and len(call.get("xs")) == 2:
        (x0, x1), y, r, keep = call.get("xs"), call.get("y"), call.get("relu_out"), call.get("keep_y")
        name = "add_relu"
        args = (b(x0), b(x1), b(y), b(y if r is None else r), keep is not False or r is None, r is not None)
    elif kernel == "add_relu_backward" and sum(d is not None for d in call.get("dinputs")) == 2:
        d1, d2 = (d for d in call.get("dinputs") if d is not None)
        name, args = "relu_backward_add", (b(call.get("y")), b(call.get("dy")), b(d1), b(d2))
    else:
        return False
    bf = dtypes.pop() == _BF16
    workers = workers_for(args[0].size)
    if workers > 1:
        getattr(jit, name + "_parallel")(*args, bf, workers)
    else:
        getattr(jit, name)(*args, bf)
    return True


def _refuse(kernel: str, names: tuple[str, ...], call: _Args):
    for name in names:
        if _has_half(call.get(name)):
            raise OptionError(f"backend 'cpu': {kernel} computes on float32 only (its {name!r} is "
                              f"{call.get(name).dtype}): parameters, gradients and optimizer state stay float32 "
                              f"in a half-precision mode (minidl.backend.precision)")


def _adapt(cls, kernel: str, run, spec: dict[str, str]) -> None:
    fn = getattr(cls, kernel)
    params = list(inspect.signature(fn).parameters)[1:]
    positions = {name: params.index(name) for name in params}
    missing = set(spec) - set(positions)
    if missing:
        raise TypeError(f"{cls.__name__}.{kernel} has no argument(s) {sorted(missing)} named in its half table")
    checked = [(positions[name], name) for name in spec]
    cls.half_positions[kernel] = positions

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        for i, name in checked:
            if _has_half(args[i] if i < len(args) else kwargs.get(name)):
                return run(self, kernel, fn, spec, _Args(positions, args, kwargs))
        return fn(self, *args, **kwargs)

    setattr(cls, kernel, call)


def half_io(cls):
    """Give `cls` its half forms: converting `STAGED` and `ELEMENTWISE` kernels, refusing `FLOAT32_ONLY`."""
    cls.half_positions = {}
    for kernel, spec in STAGED.items():
        _adapt(cls, kernel, _stage, spec)
    for kernel, spec in ELEMENTWISE.items():
        _adapt(cls, kernel, _elementwise, spec)
    for kernel, names in FLOAT32_ONLY.items():
        _adapt(cls, kernel, lambda be, kernel, fn, spec, call: _refuse(kernel, tuple(spec), call),
               dict.fromkeys(names, R))
    return cls


class StagingTrace:
    """A dry run of a backend's kernels recording the staging each call would take: `high_water` as `Staging`'s."""

    def __init__(self, backend):
        self.backend = backend
        self.high_water = 0

    def __getattr__(self, name):
        if name in STAGED or name in ELEMENTWISE:
            positions = type(self.backend).half_positions[name]

            def record(*args, **kwargs):
                self.high_water = max(self.high_water, call_staging(name, _Args(positions, args, kwargs)))
            return record
        if name in NATIVE or name in FLOAT32_ONLY:
            return lambda *args, **kwargs: None
        return getattr(self.backend, name)
