"""The Python API a newcomer types first: top-level names, sizes as strings, docstrings."""
import pytest

import minidl as dl
from minidl.models import build_model


def _tiny(batch=8):
    return build_model("lenet", batch=batch, image_size=8, in_channels=1, num_classes=10)


def test_top_level_names():
    from minidl.optim import SGD, Adam
    from minidl.session import Session

    assert dl.Session is Session and dl.SGD is SGD and dl.Adam is Adam
    assert dl.parse_size("16MiB") == 16 * 2**20


def test_session_takes_budget_as_string():
    a = dl.Session(_tiny(), dl.SGD(lr=0.1), policy="liveness", budget="16MiB")
    b = dl.Session(_tiny(), dl.SGD(lr=0.1), policy="liveness", budget=16 * 2**20)
    assert a.plan.arena_bytes == b.plan.arena_bytes and a.plan.peak_bytes == b.plan.peak_bytes
    dl.Session(_tiny(), dl.SGD(lr=0.1), policy="offload", budget="16MiB", host_limit_bytes="1MiB")


def test_bad_size_string_names_the_option():
    with pytest.raises(dl.OptionError, match="budget: .*'lots'"):
        dl.Session(_tiny(), dl.SGD(lr=0.1), budget="lots")
    with pytest.raises(dl.OptionError, match="host_limit_bytes"):
        dl.Session(_tiny(), dl.SGD(lr=0.1), host_limit_bytes="3 parsecs")
