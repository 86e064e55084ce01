"""Suite-wide pytest options. `--fuzz-examples N`: hypothesis examples per property of tests/fuzz (default: a
few, so the suite stays fast; a long local run uses e.g. 2000). `--blas-kernel NAME`: stop before any test
unless numpy's OpenBLAS runs that kernel (threadpoolctl's `architecture`): tests/test_second_blas_kernel.py
passes it, so that a second kernel that did not take effect fails loudly instead of re-testing the first."""
from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--fuzz-examples", type=int, default=None,
                     help="hypothesis examples per property in tests/fuzz (default 12)")
    parser.addoption("--blas-kernel", default=None, metavar="NAME",
                     help="fail unless numpy's OpenBLAS runs this kernel (e.g. SandyBridge)")


def pytest_configure(config):
    from hypothesis import HealthCheck, settings

    want = config.getoption("--blas-kernel")
    if want is not None:
        from tests.blas_kernel import openblas_kernel

        got = openblas_kernel()
        if (got or "").lower() != want.lower():
            raise pytest.UsageError(f"--blas-kernel {want}: numpy's OpenBLAS runs {got!r} (OPENBLAS_CORETYPE="
                                    f"{os.environ.get('OPENBLAS_CORETYPE')!r} did not take effect)")

    n = config.getoption("--fuzz-examples") or 12
    settings.register_profile("minidl-fuzz", max_examples=n, deadline=None, derandomize=n <= 12,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.filter_too_much])


@pytest.fixture
def lanes():
    """`lanes(n)`: the CPU's kernels run on n lanes for the rest of the test (what a CPU menu's `threads` sets for
    its backend's steps, `cpu.lanes.using`)."""
    from contextlib import ExitStack

    from minidl.backend.cpu import lanes as cpu_lanes

    stack = ExitStack()

    def use(n) -> None:
        stack.close()
        stack.enter_context(cpu_lanes.using(int(n)))
    yield use
    stack.close()
