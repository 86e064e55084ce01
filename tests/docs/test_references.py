"""Prose names only modules and files that exist: a docstring, comment or page naming `cpu_lanes`,
`minidl.backend.cuda.plan` or `memory/foo.py` after a move sends its reader nowhere. Checked: the package's and the
benchmarks' docstrings and comments, docs/ and README.md (CHANGELOG.md is history and may name what is gone)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from .prose import comments, docstrings

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = {"minidl": ROOT / "minidl", "minidl/models": ROOT / "models", "minidl/kernels": ROOT / "kernels"}
FLOORS = ("backend", "cli", "codec", "core", "data", "dist", "graph", "layers", "memory", "optim", "reproduce",
          "runtime", "testing", "models", "kernels")
# modules moved or merged away; their old names must not return in prose
RETIRED = re.compile(r"(?<!\w)(cli_args|cpu_(conv|eltwise_jit|gemm_jit|jit|jit_cache|lanes|norm|norm_jit|paged|pool|"
                     r"pool_jit|rows_jit|seq|seq_jit|update|update_jit|winograd|winograd_jit|workspace)|cuda_(calibrate|"
                     r"plan|vmm)|data_text|datafiles|testing_torch)\b")
DOTTED = re.compile(r"(?<![\w./])minidl((?:\.[A-Za-z_]\w*)+)")
PATHLIKE = re.compile(r"(?<![\w./-])((?:minidl/)?(?:%s)/[\w/]*\w+\.(?:py|cu))\b" % "|".join(FLOORS))


def prose(path: Path) -> str:
    """A Python file's docstrings and comments, or a page's whole text."""
    src = path.read_text()
    if path.suffix != ".py":
        return src
    parts = [doc.value.value for _, doc in docstrings(ast.parse(src))] + comments(src)
    return "\n".join(parts)


def _files() -> list[Path]:
    found = [*ROOT.joinpath("minidl").rglob("*.py"), *ROOT.joinpath("models").rglob("*.py"),
             *ROOT.joinpath("benchmarks").glob("*.py"), *ROOT.joinpath("docs").rglob("*.md"),
             *ROOT.joinpath("docs").glob("*.py"), ROOT / "README.md"]
    return sorted(p for p in found if "__pycache__" not in p.parts)


def _exists_dotted(names: list[str]) -> bool:
    """minidl.a.b.c names a module, a package or a name defined in the deepest module on the path."""
    base = ROOT / "minidl"
    for k, name in enumerate(names):
        top = "minidl/" + "/".join(names[:k + 1])
        folder = PACKAGE.get(top, base / name)
        if folder.is_dir():
            base = folder
            continue
        module = base / f"{name}.py"
        if module.exists():
            rest = names[k + 1:]
            return not rest or re.search(rf"(?m)^\s*(?:def|class)\s+{rest[0]}\b|^{rest[0]}\s*[:=]|\b{rest[0]}\b",
                                         module.read_text()) is not None
        # a name defined in the package's __init__ (or re-exported there)
        init = base / "__init__.py"
        return init.exists() and re.search(rf"\b{name}\b", init.read_text()) is not None
    return True


def _exists_path(text: str) -> bool:
    rel = text.removeprefix("minidl/")
    top, _, rest = rel.partition("/")
    if top in ("models", "kernels"):
        return (ROOT / top / rest).exists()
    return (ROOT / "minidl" / rel).exists() or any(p.exists() for p in ROOT.joinpath("minidl").glob(f"*/{rel}"))


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_prose_names_modules_that_exist(path):
    text = prose(path)
    gone = sorted({m.group(0) for m in RETIRED.finditer(text)})
    dangling = sorted({"minidl" + m.group(1) for m in DOTTED.finditer(text)
                       if not _exists_dotted(m.group(1).strip(".").split("."))})
    missing = sorted({m.group(1) for m in PATHLIKE.finditer(text) if not _exists_path(m.group(1))})
    assert (gone, dangling, missing) == ([], [], []), f"{path.relative_to(ROOT)} names what does not exist"
