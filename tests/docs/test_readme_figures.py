"""The README's exact figures, asserted: the first command's 34 MiB (`none`) / 6.3 MiB (`liveness`) / fits in
4 MiB (`auto`), its held-out accuracy and final loss under the OpenBLAS kernel this machine runs, and ResNet-2500
planning within 12 GB under `auto` (slow); and the mutation-testing paragraph of docs/guarantees.md against its
results file."""
from __future__ import annotations

import json
import re

import pytest

from minidl.models import build_model
from minidl.optim import make_optimizer
from tests.benchmarks import bench_scripts
from tests.blas_kernel import openblas_kernel
from tests.planning import planned

from .md_blocks import ROOT

MIB = 2**20


def _first_command_net():
    # `minidl train resnet --depth 20 --data digits --batch 32`: digits are 1 x 8 x 8, 10 classes
    return build_model("resnet", depth=20, batch=32, image_size=8, num_classes=10, in_channels=1)


def _opt():
    return make_optimizer("sgd", 0.05, 0.9, 0.0)  # the command line's defaults


def test_first_command_figures():
    none = planned(_first_command_net(), _opt(), "none", device="cpu").peak_bytes
    live = planned(_first_command_net(), _opt(), "liveness", device="cpu").peak_bytes
    auto = planned(_first_command_net(), _opt(), "auto", 4 * MIB, device="cpu")
    assert f"{none / MIB:.0f}" == "34", none       # "the same run needs 34 MiB under --policy none"
    assert f"{live / MIB:.1f}" == "6.3", live      # "and 6.3 MiB under --policy liveness"
    assert auto.peak_bytes <= 4 * MIB             # "inside a 4 MiB pool"


def test_first_command_reaches_the_recorded_figures_of_this_blas_kernel():
    """README command 1, run again under the OpenBLAS kernel numpy runs here, reaches exactly the held-out accuracy
    and final loss that benchmarks/results/first_command.json records for that kernel (README's table and
    docs/performance.md's are generated from it): a change that moves them fails here until
    `python benchmarks/first_command.py --figures-only` and the docs generators have run. Every kernel the script
    records (those of the CI machines) must have its row; another kernel is skipped, naming it."""
    bench = bench_scripts.load("first_command")
    rec = json.loads(bench.OUT.read_text())["figures"]
    rows = rec["by_kernel"]
    redo = "run `python benchmarks/first_command.py --figures-only`, then docs/make_readme.py and docs/make_results.py"
    assert rec["command"] == bench.readme_command_1(), f"README command 1 changed: {redo}"
    missing = [k for k in bench.KERNELS if k not in rows]
    assert not missing, f"first_command.json has no figures for OpenBLAS kernel(s) {missing}: {redo} on a CPU " \
                        f"that runs them"
    kernel = openblas_kernel()
    if kernel not in rows:
        pytest.skip(f"numpy's BLAS runs kernel {kernel!r} here, not one whose figures are recorded "
                    f"({', '.join(rows)}): `python benchmarks/first_command.py` records this machine's")
    out = bench.run_command(rec["command"], bench.command_env())
    got = {"accuracy": out["accuracy"], "final_loss": out["final_loss"]}
    assert got == rows[kernel], (f"README command 1 under OpenBLAS {kernel} now gives {got}, first_command.json "
                                 f"records {rows[kernel]} (numpy {rec['numpy']}): {redo}")


@pytest.mark.slow
def test_resnet2500_plans_within_12gb_under_auto():
    net = build_model("resnet", depth=2500, batch=16)
    plan = planned(net, make_optimizer("sgd", 0.1, 0.9, 0.0), "auto", 12 * 10**9, device="k40c")
    assert plan.peak_bytes <= 12 * 10**9


def _docs_paragraph(marker: str, page: str = "docs/guarantees.md") -> str:
    """The one paragraph (or list item) of `page` that names `marker`, on one line."""
    text = (ROOT / page).read_text()
    paragraphs = [p for p in re.split(r"\n\n|\n(?=- )", text) if marker in p]
    assert len(paragraphs) == 1, f"{len(paragraphs)} paragraphs of {page} name {marker}"
    return " ".join(paragraphs[0].split())


def test_mutation_kill_rate_is_the_recorded_one():
    """The docs' mutation-testing paragraph (docs/guarantees.md) quotes the kill rate that `benchmarks/mutation.py`
    wrote (its percentage, counts and date), or, with no run recorded, quotes none."""
    para = _docs_paragraph("benchmarks/mutation.py")
    results = ROOT / "benchmarks" / "results" / "mutation.json"
    if not results.exists():
        assert "%" not in para and "No run is recorded yet" in para, para
        return
    res = json.loads(results.read_text())
    o = res["overall"]
    assert f"{100 * o['kill_rate']:.1f}% ({o['killed']} of {o['total']} mutants" in para, para
    assert res["date"][:10] in para, para
    assert ("every file" in para) == res["complete"], para   # a sample is never quoted as the whole
