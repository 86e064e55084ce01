"""Checks of the command line's values after parsing, before anything is built or read: argparse checks types only
(`--lr nan` parses). Each refusal is an `OptionError` naming the option and the value."""
from __future__ import annotations

import math
import os
from pathlib import Path

from ..core.errors import OptionError

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
    if budget is not None and budget <= 0:  # (--host-limit 0 means every offload goes to disk)
        raise OptionError(f"--budget must be a positive size, got {budget}")
    for option, example in (("save", "ckpt.npz"), ("log", "steps.csv")):
        path = getattr(args, option, None)
        if path is not None:
            check_output_path(path, f"--{option}", example)
    check_paths_apart(args)


def best_path(save: str) -> Path:
    """Where --early-stop keeps the best state beside --save: r.npz -> r.best.npz."""
    p = Path(save)
    return p.with_name(f"{p.stem}.best{p.suffix or '.npz'}")


def _run_paths(args) -> tuple[list[tuple[str, Path]], list[tuple[str, Path]]]:
    """(inputs, outputs) of the command as (option, path): what it reads and what it writes."""
    inputs = [(f"--{o}", Path(getattr(args, o)).expanduser()) for o in ("resume", "checkpoint", "input")
              if getattr(args, o, None)]
    data = getattr(args, "data", None)
    if isinstance(data, str):
        from ..data.load import data_paths  # imported only by a command that reads data

        inputs += [(f"--data {data}", p) for p in data_paths(data)]
    outputs = [(f"--{o}", Path(getattr(args, o)).expanduser()) for o in ("save", "log", "plot", "trace", "output")
               if getattr(args, o, None)]
    if getattr(args, "autotune", None):   # read, then written back with the new measurements
        outputs.append(("--autotune", Path(args.autotune).expanduser()))
    if getattr(args, "save", None) and getattr(args, "early_stop", None):
        outputs.append(("--early-stop's best checkpoint", best_path(args.save)))
    return inputs, outputs


def _same(a: Path, b: Path) -> bool:
    """One file under two names: the same resolved path, or (both existing) the same inode."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _inside(path: Path, directory: Path) -> bool:
    return directory.is_dir() and Path(os.path.realpath(directory)) in Path(os.path.realpath(path)).parents


def check_paths_apart(args) -> None:
    """No output may be an input, another output, or inside an input directory; `--save` may be the `--resume`
    checkpoint (written atomically after it is read)."""
    inputs, outputs = _run_paths(args)
    for i, (option, path) in enumerate(outputs):
        for other, earlier in outputs[:i]:
            if _same(path, earlier):
                raise OptionError(f"{option} {path} and {other} {earlier} name the same file: one would overwrite "
                                  f"the other; give each its own path")
        for source, read in inputs:
            if option == "--save" and source == "--resume":
                continue
            if _same(path, read):
                raise OptionError(f"{option} {path} is {source}'s file {read}: writing it would destroy an input "
                                  f"of this run; give another path")
            if _inside(path, read):
                raise OptionError(f"{option} {path} lies inside {source}'s directory {read}: the run would write "
                                  f"into its own data; give a path outside it")


def check_output_path(path: str, option: str = "--save", example: str = "ckpt.npz") -> None:
    """Refuse before training an output that is a directory or whose parent is missing or read-only."""
    if os.path.isdir(path):
        raise OptionError(f"{option} {path}: is a directory; give a file name, e.g. {os.path.join(path, example)}")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise OptionError(f"{option} {path}: directory {parent} does not exist (it is not created for you)")
    if not os.access(parent, os.W_OK):
        raise OptionError(f"{option} {path}: directory {parent} is not writable")
