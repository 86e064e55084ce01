"""The papers `minidl reproduce` knows: one row each.

Adding a paper is a module in this package with `run(quick: bool, log) -> Report` (its own models and setup, rows
of the paper's figures with ours beside them, `quick` the subset a test re-runs in seconds) and one row below.
The rows of a `--quick` run must be rows of the full run, with the same keys, so that the test can hold them to
the committed results. A row names its module, imported when the paper runs: `--help` lists the papers without
loading a planner.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module

from .tables import Report


@dataclass(frozen=True, slots=True)
class Paper:
    name: str                                  # what `minidl reproduce NAME` takes
    title: str                                 # one line for --help
    module: str                                # the module of this package whose `run` makes its report

    def run(self, quick: bool, log) -> Report:
        return import_module(f"{__package__}.{self.module}").run(quick, log)


PAPERS: dict[str, Paper] = {p.name: p for p in (
    Paper("superneurons", "SuperNeurons (PPoPP 2018): Tables 4 and 5, Fig. 10 on a 12 GB K40c", "superneurons"),
    Paper("out-of-core", "nnabla's out-of-core training (2020): ResNet-50 beyond the in-memory batch on a V100",
          "out_of_core"),
    Paper("harmony", "Harmony (VLDB 2022): swap volume and throughput against a per-micro-batch swapper on "
                     "4 x GTX 1080 Ti", "harmony"),
    Paper("comet", "COMET (VLDB 2022): AlexNet, VGG-16, ResNet-18/50 with SZ-compressed activations; accuracy over "
          "seeds", "comet"),
)}
