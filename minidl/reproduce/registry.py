"""The papers `minidl reproduce` knows: one row each.

Adding a paper: a module with `run(quick: bool, log) -> Report` and one row below. A `--quick` run's rows must be
rows of the full run, same keys (the test holds them to the committed results). Modules load only when run.
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
