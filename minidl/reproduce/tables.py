"""What a reproduction produces: tables of rows, each row one of the paper's figures with ours beside it.

A row is the unit a reader checks: the paper's figure, ours, and in one line what differs from the paper's setup
(empty when nothing does). Rows carry a stable `key`, so that a `--quick` run (a subset of the rows) can be held
to the committed full results row by row: the simulator's figures are exact, so a quick row that no longer
equals its committed twin means the code changed the answer and the results were not regenerated.

The same rows are written three ways: printed (`format_text`), as `PAPER.json` (every field, for tests and for
docs/make_results.py) and as `PAPER.md` (the tables the docs include as they are).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Row:
    key: str                  # stable within the paper: "table5/vgg16"
    label: str                # what the row is, as the paper names it: "VGG16"
    paper: object             # the paper's figure (a number, or text such as "55%"); None: the paper gives none
    ours: object              # our figure, in the paper's unit; None: ours does not exist (e.g. does not fit)
    differs: str = ""         # one line: what differs from the paper's setup ("" when nothing does)
    quick: bool = False       # part of the `--quick` subset (simulated, hence exact and comparable)
    detail: dict = field(default_factory=dict)   # further figures (bytes, plan chosen, step times) for the JSON
    varies: str = ""          # "": the same on every machine (planner, simulator); "kernel": also depends on the
    #                           BLAS kernel (a trained network's accuracy); "time": this machine's measured time

    def cells(self) -> list[str]:
        return [self.label, _cell(self.paper), _cell(self.ours), self.differs or "-"]


@dataclass(slots=True)
class Table:
    key: str                  # "table4"
    title: str                # "Table 4: deepest ResNet at batch 16 in 12 GB"
    unit: str                 # what the figures count: "depth", "batch", "MB"
    rows: list[Row] = field(default_factory=list)
    note: str = ""            # a line under the table: how the figures were made

    def markdown(self) -> str:
        head = f"| row | paper ({self.unit}) | minidl ({self.unit}) | differs from the paper's setup |"
        lines = [f"**{self.title}**", "", head, "|---|---:|---:|---|"]
        lines += ["| " + " | ".join(r.cells()) + " |" for r in self.rows]
        if self.note:
            lines += ["", self.note]
        return "\n".join(lines)


@dataclass(slots=True)
class Report:
    paper: str                # the registry's name: "superneurons"
    citation: str
    setup: str                # the paper's setup and ours, in a sentence or two
    tables: list[Table]
    quick: bool = False
    meta: dict = field(default_factory=dict)

    def rows(self) -> list[Row]:
        return [r for t in self.tables for r in t.rows]

    def to_json(self) -> dict:
        return {"paper": self.paper, "citation": self.citation, "setup": self.setup, "quick": self.quick,
                **self.meta, "tables": [asdict(t) for t in self.tables]}

    @classmethod
    def from_json(cls, d: dict) -> "Report":
        """The report a `to_json` wrote (to re-render its tables without planning again)."""
        meta = {k: v for k, v in d.items() if k not in ("paper", "citation", "setup", "quick", "tables")}
        tables = [Table(t["key"], t["title"], t["unit"], [Row(**r) for r in t["rows"]], t["note"])
                  for t in d["tables"]]
        return cls(d["paper"], d["citation"], d["setup"], tables, d["quick"], meta)

    def markdown(self) -> str:
        how = f"`minidl reproduce {self.paper}{' --quick' if self.quick else ''}`"
        parts = [f"{self.citation}. {self.setup} Made by {how} ({self.meta.get('date', '?')}, "
                 f"{self.meta.get('machine', '?')})."]
        parts += [t.markdown() for t in self.tables]
        return "\n\n".join(parts) + "\n"

    def format_text(self) -> str:
        """The tables for a terminal: one line per row, the paper's figure and ours side by side."""
        out = [f"{self.citation}", self.setup]
        for t in self.tables:
            out += ["", t.title, f"  {'':<38} {'paper':>10} {'minidl':>10}  differs"]
            for r in t.rows:
                out.append(f"  {r.label:<38} {_cell(r.paper):>10} {_cell(r.ours):>10}  {r.differs or '-'}")
            if t.note:
                out.append(f"  ({t.note})")
        return "\n".join(out)

    def write(self, out_dir: Path) -> list[Path]:
        """`PAPER.json` and `PAPER.md` in `out_dir` (the paper's name with '-' as '_'), created if missing."""
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = out_dir / self.paper.replace("-", "_")
        js, md = stem.with_suffix(".json"), stem.with_suffix(".md")
        js.write_text(json.dumps(self.to_json(), indent=1, default=float) + "\n")
        md.write_text(self.markdown())
        return [js, md]


def machine_meta() -> dict:
    """The date and the machine, and numpy's BLAS kernel (what a row that `varies` with the kernel was made on)."""
    import numpy  # noqa: F401 - threadpoolctl lists the libraries already loaded
    from threadpoolctl import threadpool_info

    blas = next((f"{lib.get('internal_api')} {lib.get('architecture')}" for lib in threadpool_info()
                 if lib.get("user_api") == "blas"), None)
    return {"date": str(datetime.date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "blas": blas}


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)
