"""Each learning-rate schedule against PyTorch's scheduler of the same name, on the same steps."""
import numpy as np
import pytest

from minidl.core.errors import OptionError
from minidl.optim.schedules import Constant, Cosine, LinearLR, StepLR, WarmUp, make_schedule

torch = pytest.importorskip("torch")
BASE_LR = 0.1


def torch_lrs(make_scheduler, steps: int) -> list[float]:
    """The lr PyTorch's optimizer uses at each of `steps` updates (scheduler stepped after each update)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=BASE_LR)
    sched = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def ours(schedule, steps: int) -> list[float]:
    return [schedule.lr(BASE_LR, t) for t in range(steps)]


S = torch.optim.lr_scheduler


@pytest.mark.parametrize("step_size,gamma", [(1, 0.5), (7, 0.1), (30, 0.9)])
def test_step_lr(step_size, gamma):
    np.testing.assert_allclose(ours(StepLR(step_size, gamma), 60),
                               torch_lrs(lambda o: S.StepLR(o, step_size, gamma), 60), rtol=1e-12)


@pytest.mark.parametrize("total,eta_min", [(10, 0.0), (50, 1e-3), (7, 0.02)])
def test_cosine(total, eta_min):
    # up to and past T_max: PyTorch's cosine goes on (periodic), so does ours
    np.testing.assert_allclose(ours(Cosine(total, eta_min), 2 * total + 3),
                               torch_lrs(lambda o: S.CosineAnnealingLR(o, total, eta_min), 2 * total + 3),
                               rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("total,start,end", [(5, 1 / 3, 1.0), (20, 0.01, 1.0), (8, 1.0, 0.2)])
def test_linear_warm_up(total, start, end):
    np.testing.assert_allclose(ours(LinearLR(total, start, end), total + 10),
                               torch_lrs(lambda o: S.LinearLR(o, start, end, total), total + 10), rtol=1e-9)


@pytest.mark.parametrize("warm,total", [(5, 30), (1, 10), (12, 13)])
def test_warm_up_then_cosine(warm, total):
    def torch_sched(o):
        return S.SequentialLR(o, [S.LinearLR(o, 0.1, 1.0, warm), S.CosineAnnealingLR(o, total - warm)], [warm])

    np.testing.assert_allclose(ours(WarmUp(Cosine(total - warm), warm, 0.1), total),
                               torch_lrs(torch_sched, total), rtol=1e-9, atol=1e-15)


def test_cli_schedules_and_errors():
    assert make_schedule("constant", 10) == Constant()
    assert make_schedule("cosine", 100, warmup_steps=10) == WarmUp(Cosine(90), 10)
    assert make_schedule("step", 90) == StepLR(30, 0.1)
    with pytest.raises(OptionError, match="--lr-schedule: unknown schedule 'exp'"):
        make_schedule("exp", 10)
    with pytest.raises(OptionError, match="leaves no step"):
        make_schedule("cosine", 10, warmup_steps=10)
    with pytest.raises(OptionError, match="StepLR: step_size"):
        StepLR(0)
