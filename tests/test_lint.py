"""The house rules, enforced: ruff is clean, the import graph keeps its floors (import-linter), and no module of
minidl or the model zoo is part of an import circle (checked directly on grimp's graph, which import-linter
builds on, so a circle is named even where no contract lists its modules)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_is_clean():
    if shutil.which("ruff") is None:
        pytest.skip("ruff is not installed (it is in the test extra)")
    r = _run(["ruff", "check", "--no-cache", "."])
    assert r.returncode == 0, r.stdout + r.stderr


def test_import_layers_contracts_are_kept():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (it is in the test extra)")
    r = _run([exe, "--no-cache"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in graph.modules:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_circles():
    grimp = pytest.importorskip("grimp")
    sys.path.insert(0, str(ROOT))  # `models` is its own tree on disk (installed as minidl.models)
    try:
        graph = grimp.build_graph("minidl", "models", cache_dir=None, exclude_type_checking_imports=True)
    finally:
        sys.path.remove(str(ROOT))
    assert len(graph.modules) > 50
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_planted_circle():
    """The check above cannot pass vacuously: on a graph with a circle it names it."""
    grimp = pytest.importorskip("grimp")
    g = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        g.add_module(m)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.c")
    g.add_import(importer="p.c", imported="p.a")
    assert _cycles(g) == [["p.a", "p.b", "p.c"]]


def test_architecture_doc_names_every_module_of_the_contracts():
    """docs/architecture.md describes the floors the linter enforces: every module or package the contracts list,
    and every top-level module of minidl and of its memory package, is named there (and nothing it names in its
    floor tables is missing from the code)."""
    import re
    import tomllib

    doc = (ROOT / "docs" / "architecture.md").read_text()
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    listed = {m.strip() for c in cfg["contracts"] for layer in c["layers"] for m in layer.split("|")}
    on_disk = {f"minidl.{p.stem}" for p in (ROOT / "minidl").glob("*.py") if p.stem != "__init__"}
    on_disk |= {f"minidl.{p.name}" for p in (ROOT / "minidl").iterdir() if (p / "__init__.py").exists()}
    on_disk |= {f"minidl.memory.{p.stem}" for p in (ROOT / "minidl" / "memory").glob("*.py") if p.stem != "__init__"}
    on_disk |= {f"minidl.memory.{p.name}" for p in (ROOT / "minidl" / "memory").iterdir()
                if (p / "__init__.py").exists()}
    assert on_disk <= listed | {"minidl.memory"}, f"modules no contract places: {sorted(on_disk - listed)}"

    def named(mod: str) -> bool:
        short = mod.removeprefix("minidl.")
        return f"`{mod}`" in doc or f"`{short}`" in doc or f"`{short.removeprefix('memory.')}`" in doc

    missing = sorted(m for m in listed | on_disk if not named(m) and not m.startswith("models."))
    assert not missing, f"docs/architecture.md does not mention: {missing}"
    tables = re.findall(r"^\| \d+ \| (.+?) \|", doc, re.M)
    for cell in tables:
        for mod in re.findall(r"`([a-z_.]+)`", cell):
            full = mod if mod.startswith(("minidl", "models")) else f"minidl.{mod}"
            assert full in listed or full.replace("minidl.", "minidl.memory.", 1) in listed \
                or full == "minidl.models", \
                f"docs/architecture.md names {mod!r}, which no contract lists"


def test_tensor_ids_are_never_parsed_back():
    """The layer a tensor belongs to is its spec's `owner`; a compressed block's tensor is `compressed_source`.
    Splitting an id at its first ':' is a second, silent definition of the id format, so none may remain."""
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "minidl").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if 'split(":", 1)' in line]
    assert not hits, hits


def test_micro_batch_ids_are_spelled_in_one_place():
    """A micro-batch's tensor ids (`act:conv1@2`, `act:conv1@2r`) are spelled by `core.tensors.micro_id` alone:
    the route builder names tensors with it and the executor loads a micro-batch's inputs with it. A second
    f-string spelling `...@{m}` would be a second definition of the format."""
    import re

    spelled = re.compile(r"[\w}]@\{")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "minidl").rglob("*.py"))
            if p.relative_to(ROOT).as_posix() != "minidl/core/tensors.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if spelled.search(line)]
    assert not hits, hits


def _resolve(ref: str) -> bool:
    """Whether `ref` ("planner.place", "Executor._handlers", "program._Lowering.events") names code of minidl:
    a module (under one of the packages a reader would look in) and attributes of it, or a class defined
    somewhere in minidl and an attribute of it (an instance attribute counts when its class assigns it)."""
    import importlib
    import inspect
    import re

    parts = ref.split(".")
    obj = None
    for k in range(len(parts), 0, -1):
        bases = ("",) if parts[0] == "minidl" else (  # never a top-level module of the same name (docs/policies/)
            "minidl.", "minidl.memory.", "minidl.runtime.", "minidl.graph.", "minidl.core.", "minidl.memory.decisions.",
            "minidl.memory.schedulers.", "minidl.backend.")
        for base in bases:
            try:
                obj = importlib.import_module(base + ".".join(parts[:k]))
            except ImportError:
                continue
            rest = parts[k:]
            break
        if obj is not None:
            break
    if obj is None:  # a class named by itself: find the module that defines it
        for p in sorted((ROOT / "minidl").rglob("*.py")):
            if re.search(rf"^class {parts[0]}\b", p.read_text(), re.M):
                mod = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                obj, rest = importlib.import_module(mod), parts
                break
        else:
            return False
    for name in rest:
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif inspect.isclass(obj) and f"self.{name} =" in inspect.getsource(obj):
            return True
        else:
            return False
    return True


def test_architecture_walkthrough_names_code_that_exists():
    """The walk-through of docs/architecture.md (how a plan is made, adding a mechanism) is followed against the
    code: every dotted name it gives (`planner.place`, `Executor._handlers`, ...) is a module, function, class or
    attribute that exists, so the page cannot keep describing code that moved."""
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    tail = doc[doc.index("## How a plan is made"):]
    refs = sorted(set(re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`", tail)))
    assert len(refs) >= 8, refs
    missing = [r for r in refs if not _resolve(r)]
    assert not missing, f"docs/architecture.md names code that does not exist: {missing}"
