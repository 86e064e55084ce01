"""Host tests of the CUDA backend's half modes (`--math bf16|fp16`): storage (bf16 bits in uint16 device arrays),
copies that move the bits unchanged, the I/O check of a kernel's arrays, the mode switch and the capabilities.
No GPU: fakes of cupy stand in (the numerics run in gpu-marked tests)."""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from minidl.backend import get_backend
from minidl.backend.cuda import cudnn_specs, halves, launches, views
from minidl.backend.cuda.backend import CUDABackend, DeviceArena
from minidl.backend.mathmode import apply_math, backend_math
from tests.backend.test_cuda_host import (
    _DEVICE_ARRAYS,
    FakeCudnn,
    _DeviceArray,
    _FakeCupyArrays,
    _host_backend,
    _timed_backend,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
#: float32 values whose bf16 / fp16 roundings are ties or overflow: 1 + 2^-8 ties to even (1.0), 1 + 3*2^-8 ties up,
#: 70000 overflows fp16 to inf, a NaN stays a NaN.
VALUES = np.array([1 + 2**-8, 1 + 3 * 2**-8, -2.5, 70000.0, np.nan, 3e-41], np.float32)


# -- storage

def test_storage_dtypes_and_kernel_variants():
    assert halves.storage_dtype(BF16) == np.uint16 and halves.storage_dtype(np.float16) == np.float16
    assert halves.storage_dtype(np.float32) == np.float32 and halves.storage_dtype(np.int64) == np.int64
    assert halves.host_dtype(np.uint16) == BF16 and halves.host_dtype(np.float16) == np.float16
    assert views.storage_dtype is halves.storage_dtype
    assert [halves.half_of(np.empty(1, d)) for d in (np.uint16, np.float16, np.float32, np.int64)] == \
        ["bf16", "fp16", None, None]
    assert [halves.variant("relu_forward", h) for h in (None, "bf16", "fp16")] == \
        ["relu_forward", "relu_forward_bf16", "relu_forward_f16"]


def test_device_arena_views_bf16_as_its_bits():
    arena = DeviceArena(_FakeCupyArrays(), 1 << 16)
    v = arena.view_at(1024, (4, 8), BF16)
    assert v.dtype == np.uint16 and v.shape == (4, 8) and v.offset == 1024
    assert arena.view_at(1024, (4, 8), np.float16).dtype == np.float16
    spec = views.view_spec(1024, (4, 8), BF16, 1 << 16)
    assert (spec.dtype, spec.nbytes, spec.strides) == (np.uint16, 64, (16, 2))
    with pytest.raises(ValueError, match="past the arena"):
        arena.view_at((1 << 16) - 512, (257,), BF16)


# -- copies: the bits cross unchanged

class _Flags:
    c_contiguous = True


class _Dev:
    """A fake cupy ndarray over a host array: `get` and `set` copy it, as cupy's do."""

    def __init__(self, a):
        self.a = a
        self.shape, self.dtype, self.flags = a.shape, a.dtype, _Flags()

    def get(self, stream=None):
        return self.a.copy()

    def set(self, host, stream=None):
        assert host.dtype == self.a.dtype and host.shape == self.a.shape
        self.a[...] = host


def _copy_backend(half=None):
    cp = SimpleNamespace(ndarray=_Dev, copyto=None)
    be = CUDABackend.from_parts(cupy=cp, cupyx=None, cudnn=None, cublas=None, compute=_NullSync(),
                                transfer=_NullSync(), graphs=None, side=None, limits=launches.DeviceLimits(1024, 80),
                                filters=cudnn_specs.EngineFilters(half=half))
    return be


class _NullSync:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


@pytest.mark.parametrize("half", [BF16, np.dtype(np.float16)])
def test_copy_in_rounds_as_numpy_and_to_host_gives_the_half_back(half):
    be = _copy_backend()
    dev = _Dev(np.zeros(VALUES.shape, halves.storage_dtype(half)))
    be.copy_in(dev, VALUES)
    with np.errstate(over="ignore"):
        want = VALUES.astype(half)                  # round to nearest even, as the CPU's copy_in
    assert dev.a.tobytes() == want.tobytes()
    cpu = np.empty(VALUES.shape, half)
    get_backend("cpu").copy_in(cpu, VALUES)
    assert cpu.tobytes() == want.tobytes()
    back = be.to_host(dev)
    assert back.dtype == half and back.tobytes() == want.tobytes()
    be.copy_in(dev, want)                           # a half host array goes in bit for bit
    assert dev.a.tobytes() == want.tobytes()


def test_bf16_offload_and_prefetch_move_bits_and_pin_bf16_buffers():
    be = _timed_backend()
    bits = VALUES.astype(BF16).view(np.uint16)
    dev = _DeviceArray(bits.copy(), copy_ms=1.0)
    try:
        host = be.host_empty(bits.shape, dev.dtype)
        assert host.dtype == BF16
        be.transfer_sync(be.offload_async(dev, host))
        assert host.view(np.uint16).tobytes() == bits.tobytes()
        dev.a[...] = 0
        be.transfer_sync(be.prefetch_async(host, dev))
        assert dev.a.tobytes() == bits.tobytes()
        with pytest.raises(ValueError, match="dtypes must match"):
            be.offload_async(dev, np.empty(bits.shape, np.float16))
    finally:
        _DEVICE_ARRAYS.pop(dev.data.ptr, None)


# -- a kernel's I/O: float32, or the mode's half, one dtype for all

def test_check_io_returns_the_half_and_names_what_is_wrong():
    bf = _host_backend(FakeCudnn())
    bf.filters = cudnn_specs.EngineFilters(half="bf16")
    x, y = np.zeros((2, 3), np.uint16), np.zeros((2, 3), np.uint16)
    assert bf._check_io("relu_forward", x=x, y=y, dx=None) == "bf16"
    assert bf._check_io("relu_forward", x=np.zeros(3, np.float32), y=np.zeros(3, np.float32)) is None
    assert bf._check_io("relu_forward") is None
    with pytest.raises(TypeError, match=r"relu_forward: y is float32 but x is uint16: a kernel's arrays share one"):
        bf._check_io("relu_forward", x=x, y=np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match=r"relu_forward: y must be float32 or uint16 in --math bf16, got float16"):
        bf._check_io("relu_forward", x=x, y=np.zeros((2, 3), np.float16))
    with pytest.raises(TypeError, match=r"relu_forward: x must be a cupy array on the device, got list"):
        bf._check_io("relu_forward", x=[1.0])
    with pytest.raises(ValueError, match=r"relu_forward: x must be C-contiguous"):
        bf._check_io("relu_forward", x=np.zeros((3, 2), np.uint16).T)
    fp = _host_backend(FakeCudnn())
    fp.filters = cudnn_specs.EngineFilters(half="fp16")
    assert fp._check_io("conv", x=np.zeros(2, np.float16), w=np.zeros(2, np.float16)) == "fp16"
    with pytest.raises(TypeError, match=r"conv: x must be float32 or float16 in --math fp16, got uint16"):
        fp._check_io("conv", x=x)
    f32 = _host_backend(FakeCudnn())
    with pytest.raises(TypeError, match=r"conv: x must be float32 in --math fp32, got float16"):
        f32._check_io("conv", x=np.zeros(2, np.float16))


# -- the mode switch and the capabilities

@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_set_math_takes_the_half_modes(mode):
    be = _host_backend(FakeCudnn())
    calls = []
    be._cublas_math = calls.append
    assert apply_math(be, mode) == mode and backend_math(be) == mode == be.math
    assert be.filters == cudnn_specs.EngineFilters(allow_tf32=False, deterministic=True, half=mode)
    assert be.filters.numeric_notes() == ("DOWN_CONVERT_INPUTS", "NONDETERMINISTIC")  # tensor cores, no TF32
    assert calls == []                                                                   # cuBLAS stays default math
    be.set_math("tf32")
    assert be.math == "tf32" and be.filters.half is None and calls == [True]
    be.set_math(mode)
    assert be.math == mode and calls == [True, False]
    be.set_math("fp32")
    assert be.math == "fp32" and be.filters.numeric_notes() == ("TENSOR_CORE", "DOWN_CONVERT_INPUTS",
                                                                 "NONDETERMINISTIC")


def test_half_kernels_are_the_union_of_the_two_lists():
    assert CUDABackend.capabilities.half_kernels == launches.HALF_KERNELS | cudnn_specs.HALF_KERNELS
    assert isinstance(launches.HALF_KERNELS, frozenset) and isinstance(cudnn_specs.HALF_KERNELS, frozenset)
