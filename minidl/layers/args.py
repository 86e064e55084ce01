"""Checks of layer hyper-parameters at construction, so a mistyped value fails where it is written.

`int(2.9)` silently truncates and `float("nan") < 0` is False: a constructor that converts without checking
accepts `Conv2d(3.9, 3)` or `Dropout(nan)` and fails (or worse, trains) much later. These helpers accept exactly
the values PyTorch's constructors accept (integers, including numpy integers, but not bools or floats; finite
reals in a stated range) and raise `OptionError` naming the layer class, its name, the argument and the value.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ..core.errors import OptionError


def _who(cls_name: str, name: str | None) -> str:
    return f"{cls_name}{f' {name!r}' if name else ''}"


def _bad(cls_name: str, name: str | None, arg: str, want: str, v) -> OptionError:
    return OptionError(f"{_who(cls_name, name)}: {arg} must be {want}, got {v!r} ({type(v).__name__})")


def integer(cls_name: str, name: str | None, arg: str, v, least: int) -> int:
    """An integer >= `least` (bools and floats refused, even 3.0: PyTorch refuses them too)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or int(v) < least:
        raise _bad(cls_name, name, arg, f"an integer >= {least}", v)
    return int(v)


def int_pair(cls_name: str, name: str | None, arg: str, v, least: int) -> tuple[int, int]:
    """An integer or a pair of integers, each >= `least`."""
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise _bad(cls_name, name, arg, f"an integer or a pair of integers >= {least}", v)
        return integer(cls_name, name, arg, v[0], least), integer(cls_name, name, arg, v[1], least)
    try:
        i = integer(cls_name, name, arg, v, least)
    except OptionError:
        raise _bad(cls_name, name, arg, f"an integer or a pair of integers >= {least}", v) from None
    return i, i


def shape(cls_name: str, name: str | None, arg: str, v) -> tuple[int, ...]:
    """A shape: a sequence (tuple, list, 1-D array) of integers >= 1. `tuple(int(s) for s in v)` would read
    (2.7, 3) as (2, 3) and (True, 3) as (1, 3); the message shows the whole shape and the first bad entry."""
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__") or getattr(v, "ndim", 1) != 1:
        raise _bad(cls_name, name, arg, "a sequence of integers >= 1 such as (8, 3, 32, 32)", v)
    items = list(v)
    for k, s in enumerate(items):
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, numbers.Integral) or int(s) < 1:
            raise OptionError(f"{_who(cls_name, name)}: {arg} must be a sequence of integers >= 1, got "
                              f"{tuple(items)!r}: entry {k} is {s!r} ({type(s).__name__})")
    return tuple(int(s) for s in items)


def real(cls_name: str, name: str | None, arg: str, v, lo: float, hi: float = math.inf,
         lo_open: bool = False, hi_open: bool = False) -> float:
    """A finite real in [lo, hi] (either end open if asked)."""
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))
    if ok:
        f = float(v)
        ok = (f > lo if lo_open else f >= lo) and (f < hi if hi_open else f <= hi)
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open or hi == math.inf else ']'}"
        raise _bad(cls_name, name, arg, f"a finite number in {rng}", v)
    return float(v)


def flag(cls_name: str, name: str | None, arg: str, v) -> bool:
    """A bool (numpy's, or the integers 0 and 1, included): `bias="no"` is a mistake, not True."""
    if isinstance(v, (bool, np.bool_)) or (isinstance(v, numbers.Integral) and int(v) in (0, 1)):
        return bool(v)
    raise _bad(cls_name, name, arg, "True or False", v)


def choice(cls_name: str, name: str | None, arg: str, v, options: tuple[str, ...]) -> str:
    """One of the strings `options` (GELU's approximate='tanh'): a typo fails here, naming what is accepted."""
    if not isinstance(v, str) or v not in options:
        raise _bad(cls_name, name, arg, "one of " + ", ".join(repr(o) for o in options), v)
    return v
