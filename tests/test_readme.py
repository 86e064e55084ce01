"""README.md cannot drift: every ```python and ```bash block in it is executed here.

How a block runs (the only changes made to what the README says, so a reader knows what was checked):

* ```python blocks run as they are, in one fresh interpreter, one after the other (a later block may use an
  earlier one's names, as a reader pasting them in order would).
* ```bash blocks run in bash from a scratch directory, with this checkout's virtual environment first on PATH
  (so ``minidl`` and ``python`` are this checkout's), after two rewrites:
  - a leading ``pip install ... &&`` is dropped: the test already runs inside an install of this checkout
    (``test_fresh_venv_runs_readme_command_1`` runs README command 1 verbatim, ``pip install`` included,
    in a new virtual environment);
  - ``--steps N`` above ``FAST_STEPS`` becomes ``--steps FAST_STEPS`` (a shorter run of the same command), and
    ``--warmup-steps W`` / ``--save-every N`` at least that long become ``FAST_STEPS - 1`` (so they still happen
    inside the shorter run).
  ``python -m pytest`` (the suite itself) runs as ``python -m pytest --collect-only -q``: it checks that the
  command and the suite are valid without running the suite inside itself.
* A block preceded by ``<!-- readme-test: skip REASON -->`` is not run; the test requires a reason.
* A bash block whose commands need a program this machine lacks (``mpiexec`` for data-parallel runs) is skipped,
  naming the program; it runs wherever the program is installed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv

import pytest

from .md_blocks import ROOT, code_blocks, env_with_venv_first, fast_command

README = ROOT / "README.md"


def readme_blocks(lang: str) -> list[tuple[str, str | None]]:
    return code_blocks(README, lang)


def test_readme_has_blocks_to_check():
    assert readme_blocks("bash") and readme_blocks("python")


def test_fast_command_rewrites():
    assert fast_command("pip install . && minidl train x --steps 150 --budget 4MiB") == \
        "minidl train x --steps 3 --budget 4MiB"
    assert fast_command('pip install -e ".[test]" && python -m pytest -q') == "python -m pytest --collect-only -q"
    assert fast_command("minidl train x --steps 60 --warmup-steps 5 --save-every 20") == \
        "minidl train x --steps 3 --warmup-steps 2 --save-every 2"


def test_readme_python_blocks_run(tmp_path):
    blocks = [b for b, skip in readme_blocks("python") if skip is None]
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n\n".join(blocks))
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=env_with_venv_first())
    assert r.returncode == 0, f"README python blocks failed:\n{r.stdout}\n{r.stderr}"


@pytest.mark.parametrize("index", range(len(readme_blocks("bash"))))
def test_readme_bash_block_runs(index, tmp_path):
    body, skip = readme_blocks("bash")[index]
    if skip is not None:
        pytest.skip(skip)
    for program in {fast_command(line).split()[0] for line in body.splitlines() if line.strip()}:
        if shutil.which(program, path=env_with_venv_first()["PATH"]) is None:
            pytest.skip(f"{program} is not installed here")
    script = "set -euo pipefail\n" + "\n".join(fast_command(line) for line in body.splitlines())
    cwd = ROOT if "pytest" in body else tmp_path  # the suite is collected from the checkout
    r = subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300,
                       env=env_with_venv_first())
    assert r.returncode == 0, f"README bash block {index} failed:\n{script}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def _readme_command_1() -> str:
    body, _ = readme_blocks("bash")[0]
    (line,) = [ln for ln in body.splitlines() if ln.strip()]
    assert line.startswith("pip install . &&"), line
    return line


@pytest.mark.slow
def test_fresh_venv_runs_readme_command_1(tmp_path):
    """A new virtual environment with nothing but Python, a copy of this checkout's files, and README
    command 1 verbatim: `pip install .` must bring everything the first run needs (the digits included)."""
    src = tmp_path / "minidl"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, clear=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = str(env_dir / "bin") + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(env_dir)
    env["MPLBACKEND"] = "Agg"
    line = _readme_command_1()
    r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + line], cwd=src, capture_output=True, text=True,
                       timeout=900, env=env)
    assert r.returncode == 0, f"{line}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert "held-out accuracy" in r.stdout
    r = subprocess.run([str(env_dir / "bin" / "python"), "-c", "import sklearn"], capture_output=True, env=env)
    assert r.returncode != 0, "scikit-learn got installed: the first command must not need it"
