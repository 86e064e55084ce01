"""fp16's dynamic loss scale (`minidl.optim.loss_scale.LossScaler`) against `torch.amp.GradScaler` on scripted
sequences of finite and non-finite gradients: the same scale after every step, the same skipped steps, the same
unscaled gradients bit for bit, and a resume from `state_dict` that continues the same sequence."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minidl.core.errors import OptionError
from minidl.optim.loss_scale import LossScaler


def _torch_run(pattern: str, **kw):
    """PyTorch's scales and applied steps for `pattern` ('.' finite gradients, 'i' an inf, 'n' a NaN)."""
    p = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", **kw)
    scales, applied, grads = [], [], []
    for c in pattern:
        before = p.detach().clone()
        scaler.scale(torch.tensor(1.0))  # what starts an iteration (it makes the scale on its first call)
        g = torch.tensor([0.3, -1e-3, 0.5]) * scaler.get_scale()
        if c != ".":
            g[1] = float("inf") if c == "i" else float("nan")
        p.grad = g
        scaler.unscale_(opt)
        grads.append(p.grad.detach().numpy().copy())
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        applied.append(not torch.equal(before, p.detach()))
    return scales, applied, grads


def _minidl_run(pattern: str, scaler: LossScaler):
    scales, applied, grads = [], [], []
    for c in pattern:
        with np.errstate(over="ignore"):
            g = np.array([0.3, -1e-3, 0.5], np.float32) * np.float32(scaler.scale)
        if c != ".":
            g[1] = np.inf if c == "i" else np.nan
        found = scaler.unscale([g])
        grads.append(g)
        applied.append(scaler.update(found))
        scales.append(scaler.scale)
    return scales, applied, grads


PATTERNS = {
    "warmup": "iii" + "." * 10 + "n" + "." * 7 + "i.i.",
    "growth-capped": "." * 40,
}


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("kw", [dict(growth_interval=3), dict(init_scale=3.0e38, growth_interval=2),
                                dict(init_scale=100.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=4)])
def test_same_scales_as_torch(name, kw):
    pattern = PATTERNS[name]
    want = _torch_run(pattern, **kw)
    mine = LossScaler(**{{"init_scale": "scale"}.get(k, k): v for k, v in kw.items()})
    got = _minidl_run(pattern, mine)
    assert got[0] == want[0]
    assert got[1] == want[1]
    for g, w in zip(got[2], want[2]):
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))


def test_default_growth_interval_is_2000():
    pattern = "i" + "." * 2001 + "i" + "." * 3
    assert _minidl_run(pattern, LossScaler())[0] == _torch_run(pattern)[0]


def test_resume_from_state_continues_the_same_scales():
    pattern = "ii" + "." * 5 + "n" + "." * 9
    whole = _minidl_run(pattern, LossScaler(growth_interval=4))[0]
    first = LossScaler(growth_interval=4)
    head = _minidl_run(pattern[:6], first)[0]
    resumed = LossScaler.from_state(first.state_dict())
    assert head + _minidl_run(pattern[6:], resumed)[0] == whole


def test_diverging_after_max_skips_in_a_row():
    s = LossScaler(max_skips=3)
    for found in (True, True, False, True, True):
        s.update(found)
    assert not s.diverging
    s.update(True)
    assert s.diverging and s.skipped_in_a_row == 3


@pytest.mark.parametrize("kw,match", [(dict(scale=0.0), "initial scale"), (dict(growth_factor=1.0), "growth_factor"),
                                      (dict(backoff_factor=1.0), "backoff_factor"),
                                      (dict(growth_interval=0), "growth_interval")])
def test_bad_settings_are_named(kw, match):
    with pytest.raises(OptionError, match=match):
        LossScaler(**kw)
    with pytest.raises(OptionError, match="unknown field"):
        LossScaler.from_state({"scale": 1.0, "bogus": 2})
