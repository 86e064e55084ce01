"""Suite-wide pytest options. `--fuzz-examples N`: hypothesis examples per property of tests/fuzz (default: a
few, so the suite stays fast; a long local run uses e.g. 2000)."""
from __future__ import annotations


def pytest_addoption(parser):
    parser.addoption("--fuzz-examples", type=int, default=None,
                     help="hypothesis examples per property in tests/fuzz (default 12)")


def pytest_configure(config):
    from hypothesis import HealthCheck, settings

    n = config.getoption("--fuzz-examples") or 12
    settings.register_profile("minidl-fuzz", max_examples=n, deadline=None, derandomize=n <= 12,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.filter_too_much])
