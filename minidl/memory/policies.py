"""The table of policies, and the one entry point from (network, optimizer, policy, budget) to a plan.

Every command and the trainer go through `plan_network`, so a policy listed in `POLICIES` is available everywhere
at once (CLI choices included). A policy is a function `(route, budget, device, costs) -> Plan` (`costs`: the
`workspace.CostTable` that ranks convolution algorithms, None for the menu's own estimates).

Why a table and not self-registration: the modules that implement the mechanisms (`decisions/`, `schedulers/`)
sit below this one and never import it, so the import graph has no circle and a reader sees every policy in one
place. Adding a policy is one import and one row here (see docs/architecture.md).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

from ..core.errors import BudgetError, DistError, OptionError
from ..core.units import size_option
from ..graph.network import Network
from ..graph.route import PlanOptions, Route
from ..optim import Optimizer
from .decisions.allreduce import DataParallel, add_allreduce_events, with_buckets
from .decisions.compress import compress_policy
from .decisions.offload_fit import offload_policy
from .decisions.recompute import recompute_policy
from .decisions.weights import weights_policy
from .paged import LEAST_CHUNK
from .plan import Plan
from .planner import default_workspace, make_plan, none_schedule
from .pool import ALIGNMENT, as_size, format_bytes
from .schedulers.auto import Rival, auto_policy
from .schedulers.lossy import auto_lossy_policy
from .schedulers.minimum import verified_minimum
from .schedulers.packs import packs_policy
from .schedulers.window import window_policy
from .workspace import CostTable

PolicyFn = Callable[[Route, "int | None", str, "CostTable | None"], Plan]


@dataclass(frozen=True, slots=True)
class Policy:
    """One row of the table: the name users type, what it does in one line (every `--help` lists these; the
    mechanism's own module says the rest), the function that plans it, when to pick it and the paper it comes
    from. README's policy table and docs/policies/ are generated from these fields (docs/make_readme.py,
    docs/make_policies.py), so --help and the docs cannot disagree."""

    name: str
    help: str
    plan: PolicyFn
    lossy: bool = False   # True: parameters are NOT bit-identical to policy 'none' (opt-in compression)
    when: str = ""        # when a user should pick it, in one line
    paper: str = ""       # the system it reproduces
    portfolio: bool = False  # also plans every exact policy without it as one of its candidates (`auto`)
    homes_weights: bool = False  # its plans may keep weights on the host (not a candidate under host_weights off)
    packs_batch: bool = False  # its plan is layer packs at a micro-batch count it chooses (`auto.Rival`)


def _none(route: Route, budget: int | None, device: str, costs: CostTable | None = None) -> Plan:
    ws = default_workspace(route, costs)
    return make_plan(route, "none", budget, workspace=ws, schedule=none_schedule(route, ws))


def _liveness(route: Route, budget: int | None, device: str, costs: CostTable | None = None) -> Plan:
    return make_plan(route, "liveness", budget, workspace=default_workspace(route, costs))


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("none", "every tensor allocated up front, never freed: the baseline", _none,
           when="to measure what planning saves, or as the reference for another policy's results",
           paper="the baseline"),
    Policy("liveness", "each tensor allocated just before its first use, freed right after its last", _liveness,
           when="the default without a budget: no copies, no recomputation, nothing to tune",
           paper="SuperNeurons (Wang et al., PPoPP 2018): liveness analysis"),
    Policy("offload", "liveness + under a budget, the longest-idle tensors copied to the host and prefetched back",
           offload_policy,
           when="the activations do not fit and the host link is fast enough to hide their copies",
           paper="SuperNeurons (Wang et al., PPoPP 2018): unified tensor pool"),
    Policy("recompute", "liveness + cheap layers' outputs (ReLU, BN, pool) dropped after forward, recomputed in "
                        "backward", recompute_policy,
           when="the activations do not fit and spare compute is cheaper than host copies",
           paper="SuperNeurons (Wang et al., PPoPP 2018): cost-aware recomputation"),
    Policy("weights", "liveness + weights and optimizer state of conv/FC layers kept and updated on the host",
           weights_policy, homes_weights=True,
           when="the parameters, gradients and optimizer state alone do not fit on the device",
           paper="Harmony (Li et al., VLDB 2022): per-layer weight swapping"),
    Policy("compress", "LOSSY, opt-in: liveness + activations stored compressed between forward and backward",
           compress_policy, lossy=True,
           when="memory matters more than bit-identical results (opt-in; check accuracy on your task)",
           paper="COMET (Jin et al., VLDB 2022)"),
    Policy("packs", "Harmony's layer packs and micro-batches, packed to fit the budget (weights in once a pack)",
           packs_policy, homes_weights=True, packs_batch=True,
           when="weights do not fit and a larger batch should move fewer bytes per sample",
           paper="Harmony (Li et al., VLDB 2022): layer packs and micro-batches"),
    Policy("auto", "with a budget: the fastest exact plan that fits (recompute, offload, workspaces, weights on the "
                   "host, micro-batches, and every other exact policy's own plan); else liveness",
           auto_policy, portfolio=True,
           when="the default with --budget: the fastest exact plan that fits; start here",
           paper="SuperNeurons (Wang et al., PPoPP 2018), extended to weights (Harmony)"),
    Policy("auto-lossy", "LOSSY, opt-in (--policy auto --lossy): auto, also weighing compression of activations, "
                         "kept on the device or offloaded",
           auto_lossy_policy, lossy=True, portfolio=True,
           when="auto could not fit, or is slow, and lossy results are acceptable",
           paper="SuperNeurons's search with COMET's compression (Jin et al., VLDB 2022)"),
    Policy("window", "nnabla's out-of-core schedule: tensors swapped by a window over the access order",
           window_policy,
           when="the largest batch under a budget, activations swapped by a local schedule",
           paper="Hayakawa & Narihira, 2020 (nnabla's out-of-core training)"),
)}


def available_policies() -> tuple[str, ...]:
    return tuple(POLICIES)


def policies_help() -> str:
    """One line per policy, name and what it does: the epilog of `minidl --help`, `plan --help` and `train --help`
    (a list of ten names says nothing about which one to pick)."""
    width = max(map(len, POLICIES))
    return "policies (--policy):\n" + "\n".join(f"  {p.name:<{width}}  {p.help}" for p in POLICIES.values())


def exact_policies() -> tuple[str, ...]:
    """The policies whose parameters are bit-identical to policy 'none' on the CPU (all but the lossy ones)."""
    return tuple(name for name, p in POLICIES.items() if not p.lossy)


def use_fused_update(fused_update: bool | None, policy: str, budget: int | None) -> bool:
    """Whether the route fuses each layer's update into its backward. None (the `auto` choice): yes for policy
    `auto` under a budget, and always for `weights` (whose host update needs it). Fusing costs no FLOPs, gives
    bit-identical parameters, and only ever shortens gradients' lives (backward .. update instead of backward ..
    end of step), so when memory is what is being searched for there is no reason not to; other policies keep
    the textbook route unless asked."""
    if fused_update is not None:
        return bool(fused_update)
    return policy == "weights" or (policy in ("auto", "auto-lossy") and budget is not None)


def plan_network(net: Network, optimizer: Optimizer | None = None, policy: str = "liveness",
                 budget: int | str | None = None, device: str = "cpu", training: bool = True, backend=None,
                 costs: CostTable | None = None, fused_update: bool | None = None,
                 paged: int | None = None, data_parallel: DataParallel | None = None,
                 micro_batches: int | None = None, max_micro_batches: int | None = None,
                 verify_minimum: bool = True, host_weights: bool = True) -> Plan:
    """Plan `net` (with `optimizer`'s state) under `policy` and `budget`.

    `device` names the simulator profile whose speeds (compute, link) the policy's timing decisions use;
    `backend` (None: the CPU reference) is the backend the plan will run on, whose convolution algorithms
    and workspace sizes the plan chooses among. A plan runs only on a backend of the kind it was made for.
    `costs` ranks those algorithms (default: the menu's estimates; `CostTable(autotune=True, backend=...)`
    measures them once per shape). `budget` is bytes or a size string ("16MiB", "12GB"). `fused_update`: each
    layer's optimizer update right after its backward (True), one update step at the end (False), or None:
    decided by `use_fused_update`. `paged` (a chunk size in bytes) places tensors by chunks on a paged arena
    (`memory/paged.py`), under any policy.
    `data_parallel` (one rank of several): gradient buckets are added to the route and planned like any tensor,
    and their all-reduce events to the plan (`decisions/allreduce.py`); it needs the textbook route (the update
    must wait for the reduced gradients), so it rules out a fused update.
    `micro_batches`: the batch cut into micro-batches: policy `packs` plans Harmony's route of layer packs
    (`packs.py`; it chooses the count when None), every other policy gradient accumulation (`route.py`: each
    micro-batch's forward, then its backward; one micro-batch's activations alive at a time).
    `max_micro_batches`: when `micro_batches` is not given, the most micro-batches a policy may split the batch
    into by itself (`auto` where that is faster or the only fit, `packs` by the bytes it moves; None: any count
    dividing the batch; 1: never, e.g. to measure the largest batch without micro-batching).
    `host_weights=False`: weights and optimizer state stay on the device whatever the budget (`auto` does not
    home them on the host, nor weigh `weights` and `packs` plans), as SuperNeurons and nnabla's out-of-core
    training keep them.
    `verify_minimum=False`: a plan that does not fit raises the policy's own BudgetError, without the search for
    the edge budget it would state (`schedulers/minimum.py`: a dozen plannings more). For callers that only ask
    "does it fit", many times over (a search for the largest batch), and never show the stated minimum.
    """
    budget = as_size(budget, "budget")
    if policy not in POLICIES:
        raise OptionError(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES)}")
    slots = tuple(optimizer.slots) if optimizer is not None else ()
    fused = use_fused_update(fused_update, policy, budget)
    if data_parallel is not None and training:
        if fused and fused_update:
            raise DistError("data parallel: --fused-update on cannot be combined with several ranks: each layer's "
                            "update would run before its gradients are all-reduced (use --fused-update off)")
    packed = micro_batches is not None and training  # micro-batched: layer packs (cut by policy packs) or accumulate
    if packed and data_parallel is not None:
        raise DistError("data parallel with micro-batches (packs) is not supported")
    options = PlanOptions(paged_chunk=paged, max_micro_batches=max_micro_batches, host_weights=host_weights)

    def route_of(p: str) -> Route:
        """The route policy `p` plans: its update fused or not (`use_fused_update`; never with several ranks),
        cut into the micro-batches asked for (one pack per layer for `packs`)."""
        fuse = use_fused_update(fused_update, p, budget) and (data_parallel is None or not training)
        return net.route(training=training, optimizer_slots=slots, backend=backend, fused_update=fuse,
                         micro_batches=micro_batches or 1,
                         packs=[[n.name] for n in net.layer_nodes] if packed and p == "packs" else None
                         ).with_options(options)

    route, buckets = route_of(policy), None
    if data_parallel is not None and training:
        route, buckets = with_buckets(route, data_parallel)
    rivals = _rivals(policy, budget, route_of, route if buckets is not None else None)
    plan = _plan_verified(route, policy, budget, device, costs, verify_minimum, rivals)
    return plan if buckets is None else add_allreduce_events(plan, buckets, data_parallel)


def _rivals(policy: str, budget: int | None, route_of: Callable[[str], Route],
            ranks_route: Route | None) -> tuple[Rival, ...]:
    """What a `portfolio` policy plans besides its own search: every exact policy without the flag, on the route
    that policy is given (`plan_network`), so that it fits wherever one of them does, and is as fast. With several
    ranks, on the one route with the gradient buckets (every exact policy's route is then the same, and `packs`,
    which cuts the batch into micro-batches, is left out: data parallel does not support them)."""
    if not POLICIES[policy].portfolio or budget is None:
        return ()
    names = [p for p in exact_policies() if not POLICIES[p].portfolio]
    if ranks_route is not None:
        return tuple(Rival(p, POLICIES[p].plan, lambda: ranks_route, POLICIES[p].homes_weights,
                           POLICIES[p].packs_batch) for p in names if not POLICIES[p].packs_batch)
    return tuple(Rival(p, POLICIES[p].plan, partial(route_of, p), POLICIES[p].homes_weights, POLICIES[p].packs_batch)
                 for p in names)


def _whole_batch(route_of: Callable[[], Route]) -> Route:
    """The route `route_of` builds, with no micro-batches chosen by the policy itself."""
    route = route_of()
    return route.with_options(replace(route.options, max_micro_batches=1))


def _plan_verified(route: Route, policy: str, budget: int | None, device: str, costs: CostTable | None,
                   verify_minimum: bool = True, rivals: tuple[Rival, ...] = ()) -> Plan:
    """Plan with the table's function; a BudgetError leaves with a minimum verified by planning at it
    (`schedulers/minimum.py` says what "minimum" means per policy).

    A budget is planned as the whole pool blocks it holds (`ALIGNMENT`: every block starts and ends on one, so the
    bytes past the last boundary can never be used). Handing the policies the raw number let its last few bytes
    steer their choices (`offload` scales its room by the excess of a first placement): 36,045 B planned where
    36,044 B did not and 35,533 B did again, so no stated minimum could be the edge. The plan's arena is still the
    budget given."""
    def fn(r: Route, b: int | None) -> Plan:
        return POLICIES[policy].plan(r, b, device, costs, **({"rivals": rivals} if rivals else {}))

    def plan_at(b: int | None) -> Plan:
        if b is None:
            return fn(route, None)
        usable = b - b % ALIGNMENT
        try:
            plan = fn(route, usable)
        except BudgetError as e:
            if usable == b:
                raise
            raise BudgetError(str(e).replace(f"{format_bytes(usable)} ({usable:,} B)", f"{format_bytes(b)} ({b:,} B)",
                                             1), e.min_budget_bytes, e.binding) from None
        if plan.arena_bytes == usable:
            plan.arena_bytes = b
        return plan

    try:
        plan = plan_at(budget)
    except BudgetError as e:
        if budget is None or not verify_minimum:
            raise
        # verified with the batch whole: `auto` searching every micro-batch count at each of the dozen budgets the
        # verification plans cost minutes (ResNet-20 at batch 8: 1 s -> 3 min); the budget it states plans either way
        route = route.with_options(replace(route.options, max_micro_batches=1))   # (plan_at reads this route)
        rivals = tuple(replace(r, route_of=partial(_whole_batch, r.route_of)) for r in rivals)   # (and these)
        e = verified_minimum(plan_at, policy, budget, e)
        if route.options.paged_chunk:   # the chunk is as much a cause as the budget: say so, and that it can be smaller
            chunk = route.options.paged_chunk
            smaller = max(LEAST_CHUNK["cpu"], chunk // 8)
            hint = (f"each large tensor takes whole chunks, so a smaller chunk (e.g. --paged {size_option(smaller)}) "
                    f"may plan in less" if smaller < chunk else "the smallest chunk --paged picks by itself")
            e = BudgetError(f"{e} Tensors are placed by {format_bytes(chunk)} chunks (--paged {size_option(chunk)}): "
                            f"{hint}.", e.min_budget_bytes, e.binding)
        raise e from None
    if route.options.paged_chunk and plan.paged is None:   # a policy that plans a route of its own must pass --paged on
        raise OptionError(f"policy '{policy}' did not place its plan by chunks: --paged is not supported with it")
    return plan
