"""Checks shared by the convolution thread tests (`test_cpu_lanes`, `test_cpu_rows_jit`)."""
import numpy as np
import torch


def assert_same_bits_then_torch(results, inputs, stride, padding, dilation=(1, 1), tol=1e-4):
    """Every entry of `results` ({key: (y, dx, dW)}) equals the first bit for bit, which matches PyTorch's
    convolution and gradients (in float64) of `inputs` (x, w, dy) to `tol`."""
    ref = next(iter(results.values()))
    for key, got in results.items():
        for a, b, name in zip(got, ref, ("y", "dx", "dW")):
            assert np.array_equal(a, b), (key, name)
    x, wt, dy = (torch.tensor(a, dtype=torch.float64) for a in inputs)
    x.requires_grad_(True)
    wt.requires_grad_(True)
    ty = torch.nn.functional.conv2d(x, wt, stride=stride, padding=padding, dilation=dilation)
    ty.backward(dy)
    for a, b in zip(ref, (ty.detach(), x.grad, wt.grad)):
        np.testing.assert_allclose(a, b.numpy(), rtol=tol, atol=tol)
