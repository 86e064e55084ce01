"""The bit-identity tests (marker `bits`) again, in a subprocess, under a second OpenBLAS kernel and numba code
for a generic x86-64 CPU.

Why. minidl promises that the thread count never changes a result, and that every exact memory policy gives the
parameters of `none`. Both rest on summation orders the code fixes, never on how a BLAS kernel happens to tile a
product: a claim that held only because of one kernel's tiles (a product cut by the thread count had the whole
product's bits under OpenBLAS's AVX-512 kernels, not under its AVX2 ones) passed on the machines that had that
kernel and failed elsewhere. Run under two kernels, such a claim fails on every machine. The second kernel is
SandyBridge where the first is Haswell, else Haswell (`tests/blas_kernel.py`); `--blas-kernel` (tests/conftest.py)
stops the run unless OpenBLAS really runs it. numba's kernels are compiled for the host CPU, so the second run
also compiles them for a generic one (NUMBA_CPU_NAME=generic: no AVX, no FMA), in a cache directory of its own
(NUMBA_CACHE_DIR, which wins over any other cache setting): their bits must not depend on the vector width
(nothing is compiled with fastmath, and LLVM contracts nothing into FMAs without it).

The bit tests of the backend, the executor's lanes test and the policy matrix run there: ~2 min of tests on two
cores, plus ~80 s of numba compiling for the generic CPU the first time. That cache is kept in the temporary directory
between runs (numba recompiles whatever source changed), so later runs take ~20 s; the rest of the `bits`
tests exercise the same kernels through layers."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.blas_kernel import openblas_kernel, second_kernel

ROOT = Path(__file__).resolve().parents[1]
SELECTED = ["tests/backend/test_cpu_lanes.py", "tests/backend/test_cpu_winograd_threads.py",
            "tests/backend/test_cpu_conv_weight_grad.py", "tests/backend/test_cpu_rows_jit.py",
            "tests/backend/test_cpu_conv_accumulate.py",
            "tests/memory/test_executor.py::test_lanes_do_not_change_the_bits",
            "tests/runtime/test_policy_matrix.py"]   # every exact policy = none's bits, each runner and math mode


@pytest.mark.slow
def test_bit_identity_holds_under_a_second_blas_kernel():
    current = openblas_kernel()
    if current is None or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"numpy's BLAS is not OpenBLAS on x86-64 (kernel {current!r}, {platform.machine()})")
    other = second_kernel(current)
    env = {**os.environ, "OPENBLAS_CORETYPE": other, "NUMBA_CPU_NAME": "generic",
           "NUMBA_CACHE_DIR": str(Path(tempfile.gettempdir()) / f"minidl-numba-generic-{os.getuid()}")}
    env.pop("NUMBA_CPU_FEATURES", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "bits", "--blas-kernel", other,
           *SELECTED]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"bit tests under OpenBLAS {other} (this machine runs {current}):\n{out[-6000:]}"
    assert " passed" in out.splitlines()[-1], out[-2000:]
