"""`minidl reproduce PAPER`: a paper's own tables, re-made on its own setup, our figures beside the paper's.

Each paper's module (`registry.PAPERS`) returns a `Report`; `reproduce` writes `PAPER.json` and `PAPER.md`
(docs/make_results.py includes them). Every fit is asked of `search.plan_on_device`, as `minidl plan` does.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..core.errors import OptionError
from .registry import PAPERS, Paper
from .tables import Report, Row, Table

__all__ = ["PAPERS", "Paper", "Report", "Row", "Table", "reproduce"]


def reproduce(name: str, quick: bool = False, out_dir: Path | str | None = None,
              log: Callable[[str], None] = lambda s: None) -> tuple[Report, list[Path]]:
    """Run paper `name` (its `--quick` subset if `quick`); write its results to `out_dir` unless None."""
    if name not in PAPERS:
        raise OptionError(f"minidl reproduce: unknown paper {name!r}; choose one of {', '.join(PAPERS)}")
    report = PAPERS[name].run(quick, log)
    return report, (report.write(Path(out_dir)) if out_dir is not None else [])
