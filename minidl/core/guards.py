"""Cheap run-time checks that turn a bad input or a diverging run into a `MinidlError` naming what went wrong.

Each check is O(batch) or O(parameters) per step, small next to a training step, and each one runs before the
damage: labels before the loss indexes with them, the host arena before it is allocated, and non-finite
gradients after backward but before the update, so a diverging run keeps its last good parameters.
"""
from __future__ import annotations

import math
import os

import numpy as np

from .errors import DataError, DivergenceError, HostMemoryError


def _as_array(a, where: str, what: str) -> np.ndarray:
    try:
        return np.asarray(a)
    except (ValueError, TypeError) as e:  # a ragged list: "setting an array element with a sequence"
        raise DataError(f"{where}: {what} must be an array, got {type(a).__name__} ({e})") from None


def _shape_text(shape) -> str:
    """(None, 1, 8, 8) -> "(N, 1, 8, 8)": None is a size that may be anything (the number of samples)."""
    return "(" + ", ".join("N" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _shape_fits(got: tuple, want) -> bool:
    return len(got) == len(want) and all(w is None or g == w for g, w in zip(got, want))


def check_images(x, where: str, shape=None) -> np.ndarray:
    """Images must be numeric (float or integer, which the copy into the network's dtype converts exactly enough;
    a bool or a string array is a mistake), and of `shape` when one is given (a batch: the network input's shape;
    None in it matches any size). Returns `x` as an array. The one check of images: data sets, batches, predict."""
    x = _as_array(x, where, "images")
    numeric = x.dtype != np.bool_ and (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer))
    if not numeric or (shape is not None and not _shape_fits(x.shape, shape)):
        want = "" if shape is None else f" of shape {_shape_text(shape)}"
        raise DataError(f"{where}: images must be numeric (float or integer){want}, got {x.dtype} of shape "
                        f"{x.shape}")
    return x


def check_labels(y, num_classes: int | None, where: str, shape=None, ignore_index: int | None = None) -> np.ndarray:
    """Labels must be integers (a float label would be truncated, a bool read as class 0 or 1), of `shape` when
    given, and in [0, num_classes) when it is given: numpy reads -1 as the last class and K as an IndexError.
    `ignore_index` (a loss's label that counts for nothing, e.g. -100 on padding) is allowed besides.
    Returns `y` as an array. The one check of labels: data sets, batches."""
    y = _as_array(y, where, "labels")
    if y.dtype == np.bool_ or not np.issubdtype(y.dtype, np.integer) or (
            shape is not None and not _shape_fits(y.shape, shape)):
        rng = "" if num_classes is None else f" in [0, {num_classes})"
        want = "" if shape is None else f" of shape {_shape_text(shape)}"
        raise DataError(f"{where}: labels must be integers{rng}{want}, got {y.dtype} of shape {y.shape}")
    if num_classes is None or y.size == 0:
        return y
    real = y if ignore_index is None else y[y != ignore_index]
    if real.size == 0:
        return y
    lo, hi = int(real.min()), int(real.max())
    if lo < 0 or hi >= num_classes:
        bad = lo if lo < 0 else hi
        raise DataError(f"{where}: label {bad} is outside [0, {num_classes}) (there are {num_classes} classes)")
    return y


def check_finite_data(x: np.ndarray, where: str) -> None:
    """Images must be finite: one NaN makes every parameter NaN after a step, long before the loss says so."""
    if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
        bad = np.argwhere(~np.isfinite(x))[0]
        raise DataError(f"{where}: images contain {x[tuple(bad)]} (first at sample {int(bad[0])}, index "
                        f"{tuple(int(i) for i in bad[1:])}); clean or drop those samples")


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what the kernel can give without swapping), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_allocation(nbytes: int, what: str) -> None:
    """Refuse a host allocation larger than the available memory, before trying it: numpy would either raise a
    bare MemoryError or, with overcommit, succeed and let the kernel kill the process at the first touch."""
    avail = available_host_bytes()
    if avail is not None and nbytes > avail:
        raise HostMemoryError(f"{what} needs {_gib(nbytes)} of host memory, but only {_gib(avail)} is available "
                              f"on this machine; give a smaller --budget (policy auto fits the plan into it) or "
                              f"a smaller batch")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def nonfinite(be, a) -> bool:
    """True if `a` holds a NaN or an infinity. One reduction (a sum is finite unless some entry is not, or it
    overflows), then the exact elementwise test only if the sum says so: no temporary of a's size per step."""
    s = float(a.sum())  # numpy and cupy arrays alike; float() of a cupy scalar waits for it
    if math.isfinite(s):
        return False
    return not bool(np.isfinite(np.asarray(be.to_host(a))).all())


def check_step(be, iteration: int, loss: float, grads_backward_order, buffers=()) -> None:
    """The divergence guard, run after backward and before the update: raise `DivergenceError` if the loss, a
    gradient or a buffer is not finite. `grads_backward_order` yields (layer name, parameter name, gradient array)
    in the order backward produced them, so the layer named is where the non-finite values appeared first.
    `buffers` yields (layer name, buffer name, array) for the buffers the forward updated (BN running
    statistics): a finite but huge input (3e38) can overflow a running variance while the normalized output, the
    loss and every gradient stay finite, and an infinite statistic would then poison every later evaluation."""
    for layer, pname, g in grads_backward_order:
        if nonfinite(be, g):
            lossmsg = f"loss {loss}; " if not math.isfinite(loss) else ""
            raise DivergenceError(f"step {iteration}: {lossmsg}the gradient of {layer}.{pname} is not finite (the "
                                  f"first layer, in backward order, where it is not); the update was not applied, "
                                  f"so the parameters are those after step {iteration - 1}. Lower the learning "
                                  f"rate, or look at the data.", iteration, layer)
    if not math.isfinite(loss):
        raise DivergenceError(f"step {iteration}: the loss is {loss}; the update was not applied, so the "
                              f"parameters are those after step {iteration - 1}. Lower the learning rate, or look "
                              f"at the data.", iteration, None)

    for layer, name, b in buffers:
        if nonfinite(be, b):
            raise DivergenceError(f"step {iteration}: the running statistic {layer}.{name} is not finite (the "
                                  f"inputs of {layer} overflowed float32); the step was not applied, so the "
                                  f"parameters and running statistics are those after step {iteration - 1}. Look "
                                  f"at the data (its scale), or lower the learning rate.", iteration, layer)
