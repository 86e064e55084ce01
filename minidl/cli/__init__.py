"""The `minidl` command: info, plan, train, evaluate, predict, reproduce (with --json, each prints one JSON object).
"""
from __future__ import annotations

import json
import sys
import traceback
from importlib import import_module

from ..core import startup
from ..core.errors import EXIT_INTERRUPTED, MinidlError, exit_status
from .checks import check_args
from .parser import build_parser

__all__ = ["build_parser", "main"]

# command -> (module of this package, function): imported when that command runs, not before
_COMMANDS = {"info": ("plan", "cmd_info"), "plan": ("plan", "cmd_plan"), "train": ("train", "cmd_train"),
             "evaluate": ("infer", "cmd_evaluate"), "predict": ("infer", "cmd_predict"),
             "reproduce": ("plan", "cmd_reproduce")}


def _command(name: str):
    module, fn = _COMMANDS[name]
    return getattr(import_module(f"{__package__}.{module}"), fn)


def _say_error(e: BaseException, args) -> None:
    """A user error's first line on stderr (the rest, a table of what was tried, with --explain); with --json, JSON."""
    summary, _, detail = str(e).partition("\n")
    if getattr(args, "json", False):
        err = {"error": type(e).__name__, "message": " ".join(summary.split())}
        if detail:
            err["detail"] = detail.splitlines()
        if getattr(e, "min_budget_bytes", None) is not None:
            err["min_budget_bytes"] = e.min_budget_bytes
        print(json.dumps(err))
        return
    print(f"minidl: error: {' '.join(summary.split())}", file=sys.stderr)
    if not detail:
        return
    if getattr(args, "explain", None) is not None:
        print(detail, file=sys.stderr)
    else:
        how = "--explain" if args.cmd == "plan" else "`minidl plan` with these options and --explain"
        print(f"minidl: {how} prints the {len(detail.splitlines())} lines of detail left out here", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    startup.begin()
    try:
        return _main(argv)
    finally:
        startup.CLOCK.stop()


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):   # numpy's BLAS outside the steps (the CPU menu's lanes run the steps)
        import numpy  # noqa: F401 - threadpoolctl limits the libraries already loaded
        from threadpoolctl import threadpool_limits
        threadpool_limits(args.threads, user_api="blas")
    try:
        check_args(args)
        out = _command(args.cmd)(args)
    except (MinidlError, ValueError, OSError) as e:  # user errors: a few lines (a bug keeps its traceback)
        if getattr(args, "debug", False):
            traceback.print_exc()
        _say_error(e, args)
        return exit_status(e)
    except KeyboardInterrupt:  # outside a training step, or a second Ctrl-C in one
        print("\nminidl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.json and not getattr(args, "quiet", False):
        print(json.dumps(out, default=float))
    return EXIT_INTERRUPTED if out.get("interrupted") else 0
