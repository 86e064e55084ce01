"""What a run plans for, described once: the request (policy, budget, plan options) and the target (device profile,
algorithm menu, cost table).

Both are frozen values, made at the edge (the command line, `Session`, `reproduce`) by `PlanRequest.from_options`
and `Target.for_run`, and passed down unchanged to `policies.plan_network`. The defaulting rules live here and
nowhere else, so every door means the same by the same words:

- policy: as given, else `auto` under a budget and `liveness` without one; `lossy` asks `auto` to weigh
  compression too (`auto-lossy`) and applies to `auto` alone;
- data parallel: no micro-batches, nor a policy that chooses them (`packs`): a rank reduces whole-batch gradients;
- fused update: as given, else on for `weights`, and for `auto` under a budget (`PlanRequest.fused_update`);
  never with data parallel (the update waits for the reduced gradients), nor in fp16 (a step whose gradients
  overflow is skipped whole, so every gradient is checked before the first update: no micro-batches or packs);
- `paged="auto"`: a chunk the budget holds many of (`paged.chunk_for_budget`);
- device profile: as given, else the backend's own (a plan is for where the run would train);
- menu: the backend's; without one, the measuring cost table's, else the cuDNN model for a GPU profile, else the CPU's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..backend import menu_of
from ..backend.cpu.menu import CPU_MENU, CPUMenu
from ..core.errors import DistError, OptionError
from ..core.options import MATH_MODES, PlanOptions
from .cudnn_model import CudnnModel
from .paged import chunk_for_budget
from .policy_table import POLICY_TABLE
from .pool import as_size
from .simulate import DeviceProfile, get_profile

if TYPE_CHECKING:  # pragma: no cover
    from .decisions.allreduce import DataParallel
    from .workspace import CostTable

__all__ = ["PlanOptions", "PlanRequest", "Target"]


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What is asked of the planner; `budget` in bytes (None: no limit). `verify_minimum=False` skips the dozen
    plannings that verify a stated minimum, for callers that only ask "does it fit"."""

    policy: str = "liveness"
    budget: int | None = None
    options: PlanOptions = field(default_factory=PlanOptions)
    verify_minimum: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICY_TABLE:
            raise OptionError(f"unknown policy {self.policy!r}: expected one of {', '.join(POLICY_TABLE)}")
        dp, opts = self.options.data_parallel, self.options
        if dp is not None and opts.fused_update:
            raise DistError("data parallel: --fused-update on cannot be combined with several ranks: each layer's "
                            "update would run before its gradients are all-reduced (use --fused-update off)")
        if dp is not None and (opts.micro_batches is not None or POLICY_TABLE[self.policy].packs_batch):
            asked = "--micro-batches" if opts.micro_batches is not None else f"--policy {self.policy}"
            raise DistError(f"data parallel: {asked} cannot be combined with ranks: it cuts the batch into "
                            f"micro-batches, while a rank all-reduces each gradient of its whole batch once, before "
                            f"its one update (use another policy, or train without data parallel)")
        if opts.math == "fp16":
            asked = ("--fused-update on" if opts.fused_update else "--micro-batches" if (opts.micro_batches or 1) > 1
                     else "--policy packs" if self.policy == "packs" else None)
            if asked is not None:
                raise OptionError(f"--math fp16 skips a step whose gradients overflow (dynamic loss scaling), which "
                                  f"needs every gradient before the first update; {asked} updates layers during "
                                  f"backward: use --math bf16 (not scaled), or leave {asked.split()[0]} out")

    @property
    def fused_update(self) -> bool:
        """Fusing costs no FLOPs, keeps the bits and only shortens gradients' lives, so the memory searches fuse;
        other policies keep the textbook route unless asked."""
        opts = self.options
        if opts.data_parallel is not None or opts.math == "fp16":
            return False
        if opts.fused_update is not None:
            return bool(opts.fused_update)
        return self.policy == "weights" or (self.policy in ("auto", "auto-lossy") and self.budget is not None)

    @classmethod
    def from_options(cls, policy: str | None = None, budget: int | str | None = None, *, lossy: bool = False,
                     fused_update: bool | None = None, micro_batches: int | None = None,
                     max_micro_batches: int | None = None, math: str | None = None,
                     data_parallel: DataParallel | None = None, paged: int | str | None = None,
                     host_weights: bool = True, verify_minimum: bool = True, backend: str = "cpu") -> PlanRequest:
        """The request the options describe (sizes as bytes or strings, "16MiB")."""
        budget = as_size(budget, "budget")
        if policy is None:
            policy = "auto" if budget is not None else "liveness"
        if lossy:
            if policy not in ("auto", "auto-lossy"):
                raise OptionError(f"--lossy applies to --policy auto, not {policy!r}")
            policy = "auto-lossy"
        paged = chunk_for_budget(budget, backend) if paged == "auto" else as_size(paged, "paged")
        options = PlanOptions(fused_update=fused_update, micro_batches=micro_batches,
                              max_micro_batches=max_micro_batches, math=math or MATH_MODES[0],
                              data_parallel=data_parallel, paged_chunk=paged, host_weights=host_weights)
        return cls(policy, budget, options, verify_minimum)


@dataclass(frozen=True, slots=True)
class Target:
    """Where a plan will run: the profile timing and fit assume, the convolution menu (a plan runs only on a
    backend of its kind), the cost table ranking it (None: the menu's estimates)."""

    profile: DeviceProfile
    menu: object = CPU_MENU
    costs: CostTable | None = None

    @classmethod
    def for_run(cls, device: str | DeviceProfile | None = None, backend=None, costs: CostTable | None = None,
                cpu: CPUMenu = CPU_MENU) -> Target:
        """The target the options describe; `backend` None: a plan only."""
        if device is None:
            device = backend.profile if backend is not None else "cpu"
        profile = get_profile(device) if isinstance(device, str) else device
        if backend is not None:
            menu = menu_of(backend)
        elif costs is not None and costs.autotune:
            menu = menu_of(costs.backend) if costs.backend is not None else cpu
        else:
            menu = CudnnModel(profile) if profile.gpu else cpu
        return cls(profile, menu, costs)
