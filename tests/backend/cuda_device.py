"""The `-m gpu` tests' CUDA backend: one per math mode for the whole test run, so the cuDNN graphs of a shape are
built (or loaded from the plan cache) and the kernels loaded once, not once per test; each test still plans and
trains its own sessions on it, in arenas of their own. Without cupy, the cuDNN frontend or a device, the test is
skipped with the reason."""
from __future__ import annotations

import pytest

_BACKENDS: dict[str, object] = {}


def cuda_backend(math: str = "fp32"):
    """The run's CUDA backend in `math` (created on first use; released at exit by the backend's own hook)."""
    be = _BACKENDS.get(math)
    if be is not None:
        return be
    cupy = pytest.importorskip("cupy", reason="the CUDA backend needs cupy (pip install 'minidl[cuda]'); "
                                              "not installed here")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver
        pytest.skip(f"cupy is installed but cannot reach a CUDA driver: {e}")
    if count < 1:
        pytest.skip("cupy is installed but no CUDA device is visible")
    pytest.importorskip("cudnn", reason="the CUDA backend needs NVIDIA's cuDNN frontend (nvidia-cudnn-frontend); "
                                        "not installed here")
    from minidl.backend import get_backend

    be = _BACKENDS[math] = get_backend("cuda", math=math)
    return be
