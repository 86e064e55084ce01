"""Checks of the command line's values, run right after parsing and before anything is built or read.

argparse checks types only: `--steps 0`, `--batch -1` or `--lr nan` parse fine and fail (or are silently
changed) much later. Each rule here names the option and the value it refuses, as an `OptionError`, so the
command prints one line and nothing is trained or written.
"""
from __future__ import annotations

import math
import os

from .core.errors import OptionError

# integer options -> the smallest value accepted
_COUNTS = {"steps": 1, "batch": 1, "depth": 1, "image_size": 1, "num_classes": 1, "in_channels": 1, "seed": 0,
           "save_every": 1, "warmup_steps": 0}
# finite reals >= 0; with an upper bound where one exists
_REALS = {"lr": (0.0, math.inf), "momentum": (0.0, 1.0), "weight_decay": (0.0, math.inf)}


def _flag(attr: str) -> str:
    return "--" + attr.replace("_", "-")


def check_args(args) -> None:
    """Raise `OptionError` for the first option whose value cannot be right."""
    for attr, least in _COUNTS.items():
        v = getattr(args, attr, None)
        if v is not None and v < least:
            raise OptionError(f"{_flag(attr)} must be an integer >= {least}, got {v}")
    for attr, (lo, hi) in _REALS.items():
        v = getattr(args, attr, None)
        if v is not None and not (math.isfinite(v) and lo <= v <= hi):
            rng = f"in [{lo:g}, {hi:g}]" if math.isfinite(hi) else f">= {lo:g}"
            raise OptionError(f"{_flag(attr)} must be a finite number {rng}, got {v}")
    budget = getattr(args, "budget", None)
    if budget is not None and budget <= 0:  # (--host-limit 0 is meaningful: every offload goes to disk)
        raise OptionError(f"--budget must be a positive size, got {budget}")
    for option, example in (("save", "ckpt.npz"), ("log", "steps.csv")):
        path = getattr(args, option, None)
        if path is not None:
            check_output_path(path, f"--{option}", example)


def check_output_path(path: str, option: str = "--save", example: str = "ckpt.npz") -> None:
    """A file the run writes (--save, --log) is checked before training, not after it: a directory, or a missing
    or read-only parent directory."""
    if os.path.isdir(path):
        raise OptionError(f"{option} {path}: is a directory; give a file name, e.g. {os.path.join(path, example)}")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise OptionError(f"{option} {path}: directory {parent} does not exist (it is not created for you)")
    if not os.access(parent, os.W_OK):
        raise OptionError(f"{option} {path}: directory {parent} is not writable")
