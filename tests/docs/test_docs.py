"""docs/ and README.md cannot drift from what they describe.

* Every generated region or page (README's policy table and first-run times, docs/cli.md, the policy pages'
  examples and figures, docs/reproductions.md and docs/performance.md) equals what its generator
  (docs/make_*.py) makes now from the policy table, the argument parser, the planner and `benchmarks/results/`:
  a changed help text, a re-planned example or a re-run benchmark fails here until the page is regenerated.
* Every ```python and ```bash block of every page of docs/ runs, with the rules of tests/docs/test_readme.py's
  docstring (the python blocks of one page in one interpreter, in order; bash commands with fewer training steps;
  `<!-- readme-test: skip REASON -->` skips a block and must say why; a block whose program is not installed is
  skipped naming it). docs/tour.md's commands run in tests/docs/test_tour.py.
* docs/index.md links every page, every relative link of README.md and docs/ resolves, README stays short, and no
  product page names work items or the history of its making (that is CHANGELOG.md's).
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .md_blocks import ROOT, code_blocks, env_with_venv_first, run_bash_block

DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(p for p in DOCS.rglob("*.md") if p.name != "tour.md")
GENERATORS = ("make_readme", "make_cli", "make_policies", "make_results")


def _generator(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(DOCS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(DOCS))
    return module


@pytest.mark.parametrize("name", GENERATORS)
def test_generated_pages_are_current(name):
    module = _generator(name)
    sys.path.insert(0, str(DOCS))
    try:
        pages = module.pages()
    finally:
        sys.path.remove(str(DOCS))
    for path, text in pages.items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run python docs/{name}.py"


def test_readme_policy_table_is_the_policies_table():
    """One row per policy of minidl/memory/policies.py, with its help text, when to pick it and its paper."""
    from minidl.memory.policies import POLICIES

    table = _generator("make_readme").policy_table()
    assert table in README.read_text()
    for name, p in POLICIES.items():
        assert p.when and p.paper, f"policy {name!r} needs `when` and `paper` (README's table and --help show them)"
        assert f"[`{name}`](docs/policies/{name}.md) | {p.help} | {p.when} | {p.paper} |" in table


def test_every_policy_has_a_page():
    from minidl.memory.policies import POLICIES

    assert sorted(p.stem for p in (DOCS / "policies").glob("*.md") if p.stem != "index") == sorted(POLICIES)


def test_index_links_every_page():
    index = (DOCS / "index.md").read_text()
    linked = {(DOCS / m).resolve() for m in re.findall(r"\]\(([^)#]+\.md)", index)}
    pages = {p.resolve() for p in DOCS.rglob("*.md")} - {(DOCS / "index.md").resolve()}
    assert not pages - linked, f"docs/index.md does not link {sorted(str(p) for p in pages - linked)}"


@pytest.mark.parametrize("page", [README, *PAGES, DOCS / "tour.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"


def test_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    bash = [b for b, _ in code_blocks(README, "bash")]
    assert bash[0].strip().startswith("pip install . && minidl train ")
    assert bash[1].strip() == 'pip install -e ".[test,docs]" && python -m pytest -q'


_HISTORY = re.compile(r"\b(issues? \d+|this stop|earlier stop|next stop|load average of the machine)\b", re.I)


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_product_pages_name_no_work_items_or_history(page):
    hits = [line for line in page.read_text().splitlines() if _HISTORY.search(line)]
    assert not hits, f"{page.relative_to(ROOT)}: {hits[:3]} (history belongs in CHANGELOG.md)"


def _pages_with(lang: str) -> list[Path]:
    return [p for p in PAGES if code_blocks(p, lang)]


@pytest.mark.parametrize("page", _pages_with("python"), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_python_blocks_run(page, tmp_path):
    blocks = [b for b, skip in code_blocks(page, "python") if skip is None]
    script = tmp_path / "page_blocks.py"
    script.write_text("\n\n".join(blocks))
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=env_with_venv_first())
    assert r.returncode == 0, f"{page.relative_to(ROOT)}: python blocks failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


_BASH = [(p, i) for p in PAGES for i in range(len(code_blocks(p, "bash")))]


@pytest.mark.parametrize("page,index", _BASH, ids=[f"{p.relative_to(ROOT)}:{i}" for p, i in _BASH])
def test_docs_bash_blocks_run(page, index, tmp_path):
    body, skip = code_blocks(page, "bash")[index]
    run_bash_block(body, skip, tmp_path, f"{page.relative_to(ROOT)} bash block {index}")


def test_the_site_builds_offline_without_a_warning(tmp_path):
    """`mkdocs build --strict` (mkdocs.yml) turns every warning into a failure: a link to no page or file, a page
    left out of the build, a docstring mkdocstrings cannot gather for the Python API page. Nothing is fetched
    (no theme or inventory from the network)."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed: "
                                                               "pip install -e '.[docs]'")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env_with_venv_first())
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    api = (site / "python-api" / "index.html").read_text()
    assert "EarlyStop" in api and "training steps on mini-batches of" in api   # docstrings gathered
    assert (site / "_repo" / "benchmarks" / "results" / "superneurons.json").is_file()   # linked from outside docs/
