"""The policies by name, as words only: the parser lists them without importing a planner; `policies.POLICIES`
adds the planning functions; README's table and docs/policies/ are generated from these fields, so --help and the
docs agree."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PolicyInfo:
    """One row: the name users type and what it does in one line."""

    name: str
    help: str
    lossy: bool = False   # parameters are NOT bit-identical to policy 'none'
    when: str = ""        # when to pick it, in one line
    paper: str = ""       # the system it reproduces
    portfolio: bool = False  # also plans every exact policy without it as one of its candidates (`auto`)
    homes_weights: bool = False  # its plans may keep weights on the host (not a candidate under host_weights off)
    packs_batch: bool = False  # its plan is layer packs at a micro-batch count it chooses (`auto.Rival`)


POLICY_TABLE: dict[str, PolicyInfo] = {p.name: p for p in (
    PolicyInfo("none", "every tensor allocated up front, never freed: the baseline",
               when="to measure what planning saves, or as the reference for another policy's results",
               paper="the baseline"),
    PolicyInfo("liveness", "each tensor allocated just before its first use, freed right after its last",
               when="the default without a budget: no copies, no recomputation, nothing to tune",
               paper="SuperNeurons (Wang et al., PPoPP 2018): liveness analysis"),
    PolicyInfo("offload", "liveness + under a budget, the longest-idle tensors copied to the host and prefetched back",
               when="the activations do not fit and the host link is fast enough to hide their copies",
               paper="SuperNeurons (Wang et al., PPoPP 2018): unified tensor pool"),
    PolicyInfo("recompute", "liveness + cheap layers' outputs (ReLU, BN, pool) dropped after forward, recomputed in "
                            "backward",
               when="the activations do not fit and spare compute is cheaper than host copies",
               paper="SuperNeurons (Wang et al., PPoPP 2018): cost-aware recomputation"),
    PolicyInfo("weights", "liveness + weights and optimizer state of conv/FC layers kept and updated on the host",
               homes_weights=True,
               when="the parameters, gradients and optimizer state alone do not fit on the device",
               paper="Harmony (Li et al., VLDB 2022): per-layer weight swapping"),
    PolicyInfo("compress", "LOSSY, opt-in: liveness + activations stored compressed between forward and backward",
               lossy=True,
               when="memory matters more than bit-identical results (opt-in; check accuracy on your task)",
               paper="COMET (Jin et al., VLDB 2022)"),
    PolicyInfo("packs", "Harmony's layer packs and micro-batches, packed to fit the budget (weights in once a pack)",
               homes_weights=True, packs_batch=True,
               when="weights do not fit and a larger batch should move fewer bytes per sample",
               paper="Harmony (Li et al., VLDB 2022): layer packs and micro-batches"),
    PolicyInfo("auto", "with a budget: the fastest exact plan that fits (recompute, offload, workspaces, weights on "
                       "the host, micro-batches, and every other exact policy's own plan); else liveness",
               portfolio=True,
               when="the default with --budget: the fastest exact plan that fits; start here",
               paper="SuperNeurons (Wang et al., PPoPP 2018), extended to weights (Harmony)"),
    PolicyInfo("auto-lossy", "LOSSY, opt-in (--policy auto --lossy): auto, also weighing compression of activations, "
                             "kept on the device or offloaded",
               lossy=True, portfolio=True,
               when="auto could not fit, or is slow, and lossy results are acceptable",
               paper="SuperNeurons's search with COMET's compression (Jin et al., VLDB 2022)"),
    PolicyInfo("window", "nnabla's out-of-core schedule: tensors swapped by a window over the access order",
               when="the largest batch under a budget, activations swapped by a local schedule",
               paper="Hayakawa & Narihira, 2020 (nnabla's out-of-core training)"),
)}


def available_policies() -> tuple[str, ...]:
    return tuple(POLICY_TABLE)


def policies_help() -> str:
    """One line per policy: the epilog of `minidl --help`, `plan --help` and `train --help`."""
    width = max(map(len, POLICY_TABLE))
    return "policies (--policy):\n" + "\n".join(f"  {p.name:<{width}}  {p.help}" for p in POLICY_TABLE.values())


def exact_policies() -> tuple[str, ...]:
    """Policies bit-identical to 'none' on the CPU (all but the lossy ones)."""
    return tuple(name for name, p in POLICY_TABLE.items() if not p.lossy)
