"""Cheap checks (O(batch) or O(parameters) a step) that turn bad input or divergence into a `MinidlError`, each
before the damage: labels before the loss indexes, the host arena before allocation, gradients before the update.
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
    """(None, 1, 8, 8) -> "(N, 1, 8, 8)"."""
    return "(" + ", ".join("N" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _shape_fits(got: tuple, want) -> bool:
    return len(got) == len(want) and all(w is None or g == w for g, w in zip(got, want))


def check_images(x, where: str, shape=None) -> np.ndarray:
    """`x` as an array: numeric, not bool, of `shape` if given (None matches any size). The one image check."""
    x = _as_array(x, where, "images")
    numeric = x.dtype != np.bool_ and (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer))
    if not numeric or (shape is not None and not _shape_fits(x.shape, shape)):
        want = "" if shape is None else f" of shape {_shape_text(shape)}"
        raise DataError(f"{where}: images must be numeric (float or integer){want}, got {x.dtype} of shape "
                        f"{x.shape}")
    return x


def check_labels(y, num_classes: int | None, where: str, shape=None, ignore_index: int | None = None) -> np.ndarray:
    """`y` as an array: integers (not bool), of `shape` and in [0, num_classes) if given (numpy would read -1 as
    the last class), or `ignore_index`. The one label check."""
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
    """One NaN makes every parameter NaN after a step, long before the loss says so."""
    if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
        bad = np.argwhere(~np.isfinite(x))[0]
        raise DataError(f"{where}: images contain {x[tuple(bad)]} (first at sample {int(bad[0])}, index "
                        f"{tuple(int(i) for i in bad[1:])}); clean or drop those samples")


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, None where unknown."""
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
    """Refuse beforehand: numpy would raise a bare MemoryError, or overcommit and be killed at the first touch."""
    avail = available_host_bytes()
    if avail is not None and nbytes > avail:
        raise HostMemoryError(f"{what} needs {_gib(nbytes)} of host memory, but only {_gib(avail)} is available "
                              f"on this machine; give a smaller --budget (policy auto fits the plan into it) or "
                              f"a smaller batch")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def nonfinite(be, a) -> bool:
    """Whether `a` holds a NaN or infinity: one sum, the elementwise test only if it is not finite."""
    s = float(a.sum())  # float() of a cupy scalar waits for it
    if math.isfinite(s):
        return False
    return not bool(np.isfinite(np.asarray(be.to_host(a))).all())


def check_step(be, iteration: int, loss: float, grads_backward_order, buffers=()) -> None:
    """The divergence guard between backward and update: `DivergenceError` on a non-finite loss, gradient (in
    backward order: the first layer named) or forward-updated buffer (a 3e38 input overflows a running variance
    while loss and gradients stay finite)."""
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
