"""Three findings of the first H100 run (shared/GPU.md), fixed and held on the host against the fakes:
copy_in of a 0-d array (the softmax cross-entropy conformance failures), cuDNN objects left to interpreter
shutdown ("nanobind: leaked N instances" at every exit), and multi-KB cuDNN fallback reasons in the report."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from minidl.backend.cuda import cudnn_specs

from .test_cuda_host import FakeCudnn, _host_backend, _op_of

ROOT = Path(__file__).resolve().parents[2]


class _DeviceArray(np.ndarray):
    """A 'device' array whose set() checks what cupy's ndarray.set checks: same shape, same dtype, C order."""

    def set(self, arr, stream=None):
        if arr.shape != self.shape or arr.dtype != self.dtype or not arr.flags.c_contiguous:
            raise ValueError(f"cupy would refuse: {arr.shape} {arr.dtype} into {self.shape} {self.dtype}")
        self[...] = arr


def test_copy_in_of_a_0d_array_keeps_its_shape():
    be = _host_backend(FakeCudnn())
    be.cp = SimpleNamespace(**{**vars(be.cp), "ndarray": _DeviceArray})  # host numpy sources go through set()
    dst = np.zeros((), np.float32).view(_DeviceArray)
    be.copy_in(dst, np.array(1.0, np.float64))          # the loss delta of softmax cross-entropy's backward
    assert dst.shape == () and float(dst) == 1.0
    grid = np.zeros((3, 4), np.float32).view(_DeviceArray)
    be.copy_in(grid, np.arange(12.0).reshape(4, 3).T)    # a non-contiguous source is made C-contiguous
    np.testing.assert_array_equal(np.asarray(grid), np.arange(12.0).reshape(4, 3).T)


def test_fallback_reasons_are_one_short_line():
    log = "cudnnGraphNotSupportedError: No valid engine configs for Matmul_MUL_\n" + "[cudnn_frontend] log " * 400

    def refuse(g):
        if _op_of(g) == "relu":
            raise RuntimeError(log)
        return False
    be = _host_backend(FakeCudnn(unsupported=refuse))
    be.relu_forward(np.array([-1, 2], np.float32), np.zeros(2, np.float32))
    reason = be.fallbacks["relu_fwd"]
    assert "\n" not in reason and len(reason) <= 200, reason
    assert "No valid engine configs" in reason
    assert be.memory_report()["fallbacks"] == {"relu_fwd": reason}


def test_cudnn_graphs_are_released_before_interpreter_shutdown():
    """An atexit hook registered when the CUDA backend is imported drops every cached graph (and handle) while
    the cudnn module is alive; a hook registered *before* that import runs *after* it and sees them gone."""
    code = textwrap.dedent("""
        import atexit, weakref
        refs = []
        atexit.register(lambda: print("graph alive at exit" if refs[0]() is not None else "graph released"))
        import numpy as np
        from tests.backend.test_cuda_host import FakeCudnn, _host_backend
        be = _host_backend(FakeCudnn())
        be.relu_forward(np.array([-1, 2], np.float32), np.zeros(2, np.float32))
        (built,) = be.graphs._cache.values()
        refs.append(weakref.ref(built.graph))  # the frontend graph: the nanobind object that leaked
        del built
        be.graphs.cudnn.graphs.clear()          # the recording fake keeps its graphs and executions;
        be.graphs.cudnn.executions.clear()      # the real module does not
        print("cached", len(be.graphs))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cached", "1", "graph", "released"], r.stdout


def test_close_releases_graphs_then_the_handle():
    destroyed = []
    fake = FakeCudnn()
    fake.destroy_handle = destroyed.append
    be = _host_backend(fake)
    be._handle = be.graphs.handle
    be.relu_forward(np.array([-1, 2], np.float32), np.zeros(2, np.float32))
    assert len(be.graphs) == 1
    be.synchronize = lambda: None
    be.close()
    assert len(be.graphs) == 0 and destroyed == [5] and be._handle is None
    be.close()                                            # idempotent
    assert destroyed == [5]
    assert cudnn_specs.EngineFilters() == be.filters
