"""Code blocks of the project's Markdown pages (README.md, docs/*.md), and the documented rewrites with which
the tests run their commands. tests/test_readme.py's docstring lists the rules."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    """A shown command as the tests run it (the rewrites tests/test_readme.py's docstring lists)."""
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
