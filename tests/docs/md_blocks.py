"""Code blocks of the project's Markdown pages (README.md, docs/*.md), and the documented rewrites with which
the tests run their commands. tests/docs/test_readme.py's docstring lists the rules."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAST_STEPS = 3
_BLOCK = re.compile(r"(?:<!--\s*readme-test:\s*(?P<directive>[^>]*?)\s*-->\s*\n)?```(?P<lang>\w+)\n(?P<body>.*?)```",
                    re.S)


def code_blocks(path: Path, lang: str) -> list[tuple[str, str | None]]:
    """(body, skip reason or None) of every ```lang block of a Markdown file, in order."""
    out = []
    for m in _BLOCK.finditer(path.read_text()):
        if m["lang"] != lang:
            continue
        directive = m["directive"]
        reason = None
        if directive is not None:
            kind, _, reason = directive.partition(" ")
            assert kind == "skip" and reason.strip(), f"readme-test directive needs 'skip REASON': {directive!r}"
        out.append((m["body"], reason))
    return out


def fast_command(line: str) -> str:
    """A shown command as the tests run it (the rewrites tests/docs/test_readme.py's docstring lists)."""
    line = re.sub(r"^\s*pip install [^&]*&&\s*", "", line)
    line = re.sub(r"--steps (\d+)", lambda m: f"--steps {min(int(m[1]), FAST_STEPS)}", line)
    line = re.sub(r"--(warmup-steps|save-every) (\d+)", lambda m: f"--{m[1]} {min(int(m[2]), FAST_STEPS - 1)}",
                  line)
    line = re.sub(r"\bpython -m pytest\b(.*)$", r"python -m pytest --collect-only\1", line)
    return line


def env_with_venv_first() -> dict:
    """The environment for a shown command: this checkout's virtual environment first on PATH, no display."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["MPLBACKEND"] = "Agg"
    return env


def run_bash_block(body: str, skip: str | None, cwd: Path, where: str) -> None:
    """Run a page's bash block as a reader would (each line through `fast_command`, stopping at the first failure,
    this checkout's venv first on PATH); skip it when the page says so or a program it calls is not installed, and
    fail naming `where` with the script and the ends of its output."""
    import pytest

    if skip is not None:
        pytest.skip(skip)
    for program in {fast_command(line).split()[0] for line in body.splitlines() if line.strip()}:
        if shutil.which(program, path=env_with_venv_first()["PATH"]) is None:
            pytest.skip(f"{program} is not installed here")
    script = "set -euo pipefail\n" + "\n".join(fast_command(line) for line in body.splitlines())
    r = subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300,
                       env=env_with_venv_first())
    assert r.returncode == 0, f"{where} failed:\n{script}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
