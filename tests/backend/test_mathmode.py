"""`--math fp32|tf32`: refused on the CPU (naming the option), carried to the CUDA backend's engine filters and
cuBLAS math, recorded in the session, its checkpoints and the command's output. No GPU: the CUDA half runs
against the host fakes of tests/backend/test_cuda_host.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

import minidl as dl
from minidl.backend import get_backend
from minidl.backend.cuda import cudnn_specs
from minidl.backend.mathmode import MATH_MODES, apply_math, backend_math
from minidl.cli import main
from minidl.core.errors import OptionError
from minidl.models import build_model
from minidl.runtime.checkpoint import load_checkpoint
from tests.backend.test_cuda_host import TABLES, FakeCudnn, _conv_arrays, _host_backend, _table_by_op


def _tiny(batch=4):
    return build_model("lenet", batch=batch, image_size=8, in_channels=1, num_classes=10)


def test_cpu_is_fp32_and_refuses_tf32_naming_the_option():
    cpu = get_backend("cpu")
    assert backend_math(cpu) == "fp32" and backend_math(None) == "fp32"
    assert apply_math(cpu, None) == "fp32" and apply_math(cpu, "fp32") == "fp32"
    with pytest.raises(OptionError, match=r"--math tf32: backend 'cpu' computes in fp32 only"):
        apply_math(cpu, "tf32")
    with pytest.raises(OptionError, match=r"--math tf32"):
        get_backend("cpu", math="tf32")
    assert apply_math(cpu, "bf16") == "bf16" and apply_math(cpu, "fp16") == "fp16"   # half storage, fp32 compute
    with pytest.raises(OptionError, match=r"--math must be one of fp32, tf32, bf16, fp16, got 'fp8'"):
        apply_math(cpu, "fp8")
    assert MATH_MODES[0] == "fp32"   # the default


def test_session_refuses_tf32_on_the_cpu_before_planning():
    with pytest.raises(OptionError, match="--math tf32"):
        dl.Session(_tiny(), dl.SGD(lr=0.1), math="tf32")


def test_session_records_the_mode_in_checkpoints(tmp_path):
    sess = dl.Session(_tiny(), dl.SGD(lr=0.1), math="fp32")
    assert sess.math == "fp32"
    assert dl.Session(_tiny(), dl.SGD(lr=0.1)).math == "fp32"   # None: the backend's own
    _, _, meta = load_checkpoint(sess.save(tmp_path / "c.npz"))
    assert meta["math"] == "fp32"


@pytest.mark.parametrize("cmd", [["plan", "lenet", "--batch", "2"],
                                 ["train", "lenet", "--batch", "2", "--steps", "1", "--no-progress"]])
def test_cli_math_option(capsys, cmd):
    assert main([*cmd, "--math", "tf32", "--json"]) == 2
    err = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert err["error"] == "OptionError" and "--math tf32" in err["message"] and "cpu" in err["message"]
    assert main([*cmd, "--math", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["math"] == "fp32"


def test_cuda_backend_switches_engine_filters_and_cublas_math():
    fake = FakeCudnn(plans=_table_by_op(TABLES))
    be = _host_backend(fake)
    calls = []
    be._cublas_math = calls.append
    assert be.math == "fp32" and "TENSOR_CORE" in be.filters.numeric_notes()
    assert apply_math(be, "tf32") == "tf32"
    assert be.math == "tf32" and be.filters == cudnn_specs.EngineFilters(allow_tf32=True, deterministic=True)
    assert "TENSOR_CORE" not in be.filters.numeric_notes() and "NONDETERMINISTIC" in be.filters.numeric_notes()
    assert calls == [True]
    # the graphs built in each mode are distinct cache entries, built with that mode's deselections
    x, w, y, p = _conv_arrays()
    be.conv2d_forward(x, w, None, y, algo=None, workspace=np.zeros(4096, np.uint8), **p)
    apply_math(be, "fp32")
    be.conv2d_forward(x, w, None, y, algo=None, workspace=np.zeros(4096, np.uint8), **p)
    assert calls == [True, False] and len(be.graphs) == 2
    deselected = [g.deselected for g in fake.graphs]
    assert deselected[0] == ["numerical_note.NONDETERMINISTIC"]
    assert "numerical_note.TENSOR_CORE" in deselected[1]


def test_cublas_math_mode_is_set_on_cupys_handle(monkeypatch):
    """cuBLAS's half of tf32: cupy's handle (the one `cupy.cublas.gemm` uses) in TF32 tensor-op math, and back."""
    import sys
    import types

    from minidl.backend.cuda.backend import _cublas_math_setter

    calls = []
    lib = types.SimpleNamespace(CUBLAS_TF32_TENSOR_OP_MATH=3, CUBLAS_DEFAULT_MATH=0,
                                setMathMode=lambda h, mode: calls.append((h, mode)))
    pkgs = {"cupy_backends": types.ModuleType("cupy_backends"), "cupy_backends.cuda": types.ModuleType("c"),
            "cupy_backends.cuda.libs": types.ModuleType("l")}
    pkgs["cupy_backends.cuda.libs"].cublas = lib
    for name, mod in pkgs.items():
        monkeypatch.setitem(sys.modules, name, mod)
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(device=types.SimpleNamespace(
        get_cublas_handle=lambda: 77)))
    setter = _cublas_math_setter(cupy)
    setter(True)
    setter(False)
    assert calls == [(77, 3), (77, 0)]
