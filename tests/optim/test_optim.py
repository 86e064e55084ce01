"""SGD (momentum, nesterov, weight decay) and Adam match torch.optim over 10 steps."""
import numpy as np
import pytest
import torch

from minidl.backend.cpu.backend import CPUBackend
from minidl.optim import SGD, Adam

CASES = [
    (SGD, dict(lr=0.1), dict(lr=0.1)),
    (SGD, dict(lr=0.05, momentum=0.9), dict(lr=0.05, momentum=0.9)),
    (SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
     dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (SGD, dict(lr=0.05, momentum=0.8, dampening=0.3), dict(lr=0.05, momentum=0.8, dampening=0.3)),
    (Adam, dict(lr=1e-2), dict(lr=1e-2)),
    (Adam, dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2),
     dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2)),
]


@pytest.mark.parametrize("cls,ours,theirs", CASES)
def test_matches_torch_optim(cls, ours, theirs):
    rng = np.random.default_rng(0)
    shape = (70001,)  # crosses the elementwise chunk boundary
    p0 = rng.standard_normal(shape).astype(np.float32)
    grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(10)]
    opt = cls(**ours)
    p = p0.copy()
    state = {s: np.zeros(shape, np.float32) for s in opt.slots}
    be = CPUBackend()
    tp = torch.tensor(p0.copy(), requires_grad=True)
    topt = getattr(torch.optim, cls.__name__)([tp], **theirs)
    for k, g in enumerate(grads):
        opt.update(be, p, g, state, k)
        tp.grad = torch.tensor(g)
        topt.step()
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_bad_hyperparameters():
    with pytest.raises(ValueError):
        SGD(lr=0.1, nesterov=True)
    with pytest.raises(ValueError):
        Adam(betas=(1.0, 0.9))
