"""docs/tour.md cannot drift: every command it shows runs here (with fewer training steps, the rewrites of
tests/docs/md_blocks.py), and every stage is re-planned to check the tour's exact memory figures (bytes)."""
from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from minidl.cli import main

from .md_blocks import ROOT, code_blocks, env_with_venv_first, fast_command

TOUR = ROOT / "docs" / "tour.md"
FIGURES = json.loads((ROOT / "docs" / "tour" / "figures.json").read_text())
COMMANDS = [line for body, skip in code_blocks(TOUR, "bash") if skip is None
            for line in body.splitlines() if line.strip()]


def test_the_tour_shows_every_stage_and_its_timeline():
    text = TOUR.read_text()
    for slug, fig in FIGURES.items():
        assert fig["command_plan"] in COMMANDS and fig["command_train"] in COMMANDS, slug
        assert f"(tour/{slug}.png)" in text and (ROOT / "docs" / "tour" / f"{slug}.png").stat().st_size > 0
        assert fig["pool_peak_bytes"] == fig["peak_bytes"], slug  # the tour says measured = planned


@pytest.mark.parametrize("slug", sorted(FIGURES))
def test_the_tour_memory_figures_still_hold(slug, capsys):
    """The plan each stage shows gives, today, the bytes the tour printed."""
    fig = FIGURES[slug]
    argv = [a for a in shlex.split(fig["command_plan"])[1:] if a != "--explain"]
    i = argv.index("--plot")
    del argv[i:i + 2]
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("peak_bytes", "min_budget_bytes", "offloaded_bytes", "prefetched_bytes"):
        assert got[key] == fig[key], f"{slug}: {key} is {got[key]}, the tour says {fig[key]}: run docs/make_tour.py"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_tour_command_runs(command, tmp_path):
    r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + fast_command(command)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env=env_with_venv_first())
    assert r.returncode == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
