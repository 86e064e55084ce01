"""Checks of hyper-parameters at construction, accepting what PyTorch's constructors accept: `int(2.9)` truncates
and `nan < 0` is False, so `Conv2d(3.9, 3)` or `Dropout(nan)` would fail much later. `OptionError` names the
layer, the argument and the value.
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
    """An integer >= `least` (bools and floats refused, even 3.0, as PyTorch does)."""
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
    """A sequence of integers >= 1 (never (2.7, 3) read as (2, 3))."""
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
    """A bool, numpy's, or 0 or 1: `bias="no"` is a mistake, not True."""
    if isinstance(v, (bool, np.bool_)) or (isinstance(v, numbers.Integral) and int(v) in (0, 1)):
        return bool(v)
    raise _bad(cls_name, name, arg, "True or False", v)


def choice(cls_name: str, name: str | None, arg: str, v, options: tuple[str, ...]) -> str:
    """One of the strings `options`."""
    if not isinstance(v, str) or v not in options:
        raise _bad(cls_name, name, arg, "one of " + ", ".join(repr(o) for o in options), v)
    return v
