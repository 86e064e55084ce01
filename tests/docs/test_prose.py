"""Prose as short as the code it explains: docstrings and comments at most `MAX_RATIO` of the package's other
characters (whitespace not counted), and no docstring with more lines than the rest of its function or class."""
from __future__ import annotations

import ast
from pathlib import Path

from .prose import comments, docstrings

ROOT = Path(__file__).resolve().parents[2]
MAX_RATIO = 0.35   # prose characters per code character over minidl/ and models/ (tinygrad's engine: 0.07-0.17)


def measure(src: str) -> tuple[int, int, list[str]]:
    """(prose characters, code characters, the functions and classes whose docstring outweighs them in lines)."""
    tree = ast.parse(src)
    lines = src.splitlines(keepends=True)
    prose, long = 0, []
    for node, doc in docstrings(tree):
        prose += len("".join("".join(lines[doc.lineno - 1:doc.end_lineno]).split()))
        if not isinstance(node, ast.Module):
            doc_lines = doc.end_lineno - doc.lineno + 1
            if doc_lines > node.end_lineno - node.lineno + 1 - doc_lines:
                long.append(f"{node.name} (line {node.lineno})")
    prose += sum(len("".join(c.split())) for c in comments(src))
    return prose, len("".join(src.split())) - prose, long


def _sources() -> list[Path]:
    return sorted(p for root in ("minidl", "models") for p in ROOT.joinpath(root).rglob("*.py")
                  if "__pycache__" not in p.parts)


def test_prose_is_at_most_a_third_of_the_code():
    prose = code = 0
    for path in _sources():
        p, c, _ = measure(path.read_text())
        prose, code = prose + p, code + c
    assert prose / code <= MAX_RATIO, f"prose {prose:,} characters per code {code:,}: {prose / code:.3f}"


def test_no_docstring_is_longer_than_its_function():
    long = {str(p.relative_to(ROOT)): measure(p.read_text())[2] for p in _sources()}
    assert {k: v for k, v in long.items() if v} == {}


def test_the_measure_counts_what_it_says():
    src = 'def f(x):\n    """One.\n\n    Two.\n    """\n    return x  # id\n'
    prose, code, long = measure(src)
    assert (prose, code) == (len('"""One.Two."""') + len("#id"), len("deff(x):returnx"))
    assert long == ["f (line 1)"]
