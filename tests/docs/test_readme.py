"""README.md cannot drift: every ```python and ```bash block in it is executed here.

How a block runs (the only changes made to what the README says, so a reader knows what was checked):

* ```python blocks run as they are, in one fresh interpreter, one after the other (a later block may use an
  earlier one's names, as a reader pasting them in order would).
* ```bash blocks run in bash from a scratch directory, with this checkout's virtual environment first on PATH
  (so ``minidl`` and ``python`` are this checkout's), after two rewrites:
  - a leading ``pip install ... &&`` is dropped: the test already runs inside an install of this checkout
    (``test_fresh_venv_runs_readme_command_1`` runs README command 1 verbatim, ``pip install`` included,
    in a new virtual environment; ``test_fresh_venv_runs_both_readme_commands_in_either_order`` runs command 1
    and command 2's install in one new environment, each after the other);
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
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from .md_blocks import ROOT, code_blocks, env_with_venv_first, fast_command, run_bash_block

README = ROOT / "README.md"


def readme_blocks(lang: str) -> list[tuple[str, str | None]]:
    return code_blocks(README, lang)


def test_readme_has_blocks_to_check():
    assert readme_blocks("bash") and readme_blocks("python")


def test_fast_command_rewrites():
    assert fast_command("pip install . && minidl train x --steps 150 --budget 4MiB") == \
        "minidl train x --steps 3 --budget 4MiB"
    assert fast_command('pip install -e ".[test,docs]" && python -m pytest -q') == "python -m pytest --collect-only -q"
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
    cwd = ROOT if "pytest" in body else tmp_path  # the suite is collected from the checkout
    run_bash_block(body, skip, cwd, f"README bash block {index}")


def _readme_command(index: int, starts: str) -> str:
    """README command `index` (0: train, 1: run the tests) verbatim: the one line of its bash block."""
    body, _ = readme_blocks("bash")[index]
    (line,) = [ln for ln in body.splitlines() if ln.strip()]
    assert line.startswith(starts), line
    return line


def _readme_command_1() -> str:
    return _readme_command(0, "pip install . &&")


def _readme_command_2_install() -> str:
    """README command 2 up to its `&&`: the install (the suite it then runs is not run inside the suite)."""
    install, _, _ = _readme_command(1, 'pip install -e ".[test,docs]" &&').partition("&&")
    return install.strip()


def _fresh_venv(tmp_path):
    """A new virtual environment with nothing but Python and pip, and a copy of this checkout's files (tracked
    and untracked, not ignored): the path of the copy, the environment's folder and the variables to run in it.
    pip runs as configured on this machine (its index and its cache: a cold cache only makes it slower). The
    compiled kernels are cached in a folder of this test (MINIDL_CACHE_DIR), not in the user's cache."""
    src = tmp_path / "minidl"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, clear=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "NUMBA_CACHE_DIR")}
    env["PATH"] = str(env_dir / "bin") + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(env_dir)
    env["MPLBACKEND"] = "Agg"
    env["MINIDL_CACHE_DIR"] = str(tmp_path / "cache")
    return src, env_dir, env


def _run_line(line: str, cwd, env) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + line], cwd=cwd, capture_output=True, text=True,
                       timeout=900, env=env)
    assert r.returncode == 0, f"{line}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def _site_package(env_dir) -> Path:
    """The folder `pip install .` puts the minidl package in, in the environment at `env_dir`."""
    r = subprocess.run([str(env_dir / "bin" / "python"), "-c",
                        "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True,
                       check=True)
    return Path(r.stdout.strip()).resolve() / "minidl"


def _files_pip_did_not_install(package: Path) -> list[str]:
    """Files inside an installed (not editable) minidl that its RECORD does not list: written by someone else,
    so pip will not remove them when it uninstalls the package (bytecode aside: pip removes the compiled
    bytecode of every module it installed, whoever wrote it)."""
    (record,) = package.parent.glob("minidl-*.dist-info/RECORD")
    listed = {(package.parent / row.split(",")[0]).resolve() for row in record.read_text().splitlines() if row}
    return sorted(str(p.relative_to(package)) for p in package.rglob("*")
                  if p.is_file() and p.suffix != ".pyc" and p.resolve() not in listed)


@pytest.mark.slow
def test_fresh_venv_runs_readme_command_1(tmp_path):
    """A new virtual environment with nothing but Python, a copy of this checkout's files, and README
    command 1 verbatim: `pip install .` must bring everything the first run needs (the digits included)."""
    src, env_dir, env = _fresh_venv(tmp_path)
    line = _readme_command_1()
    r = _run_line(line, src, env)
    accuracy = re.search(r"held-out accuracy ([\d.]+)%", r.stdout)
    # The README: "above 90% held-out accuracy"; its exact figures depend on the CPU's BLAS kernel (96.38% and
    # 97.77% on two kernels of one machine), so only the floor it promises is checked.
    assert accuracy and float(accuracy[1]) > 90.0, r.stdout[-2000:]
    r = subprocess.run([str(env_dir / "bin" / "python"), "-c", "import sklearn"], capture_output=True, env=env)
    assert r.returncode != 0, "scikit-learn got installed: the first command must not need it"


@pytest.mark.slow
def test_fresh_venv_runs_both_readme_commands_in_either_order(tmp_path):
    """Both README commands in one new virtual environment, each order: command 2's install (editable), then
    command 1 (a regular install over it, and a training run), then command 2's install again (editable over
    the regular install). Training must write nothing inside the installed package: a file pip did not install
    is one it leaves behind when it uninstalls, and a leftover `minidl` folder without its `__init__.py` imports
    as a namespace package ahead of the editable install, which breaks every `minidl` command. One environment
    serves both orders: command 2's dependencies (the test extras, torch among them) are installed once."""
    src, env_dir, env = _fresh_venv(tmp_path)
    src = src.resolve()
    install_2, line_1 = _readme_command_2_install(), _readme_command_1()
    package = _site_package(env_dir)

    elsewhere = tmp_path / "elsewhere"  # a folder with no `minidl` in it, as the current directory
    elsewhere.mkdir()

    def minidl_works(after: str) -> Path:
        """`minidl --version` and `import minidl` work; the folder minidl was imported from."""
        r = subprocess.run(["minidl", "--version"], cwd=elsewhere, capture_output=True, text=True, env=env)
        assert r.returncode == 0 and "minidl" in r.stdout, f"`minidl --version` after {after}:\n{r.stderr[-3000:]}"
        r = subprocess.run(["python", "-c", "import minidl; print(minidl.__file__)"], cwd=elsewhere,
                           capture_output=True, text=True, env=env)
        assert r.returncode == 0, f"`import minidl` after {after}:\n{r.stderr[-3000:]}"
        return Path(r.stdout.strip()).resolve().parent

    _run_line(install_2, src, env)
    assert minidl_works(install_2) == src / "minidl"
    r = _run_line(line_1, src, env)
    assert "held-out accuracy" in r.stdout
    assert minidl_works(line_1) == package
    stray = _files_pip_did_not_install(package)
    _run_line(install_2, src, env)
    assert minidl_works(f"{line_1}, then {install_2}") == src / "minidl"
    assert not stray, f"training wrote inside the installed package {package}: {stray[:10]}"
    assert not package.exists(), f"the uninstalled package left {package} behind"
    assert any((tmp_path / "cache" / "numba").rglob("*.nbi")), "the kernels were not cached in MINIDL_CACHE_DIR"
