"""Whether a plan fits, in words: against `--budget` and the device profile's memory.

A plan made without a budget is never refused, so this verdict is what says a 38 GiB plan cannot run on a 12 GB
card; then it asks policy `auto` (through the caller's `replan`, with the same options) for a plan under the
device's memory, and names it, or the smallest budget auto needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...core.errors import BudgetError, MinidlError
from ...core.units import size_option
from ..plan import Plan
from ..pool import format_bytes, parse_size
from ..simulate import DeviceProfile, simulate

SUGGESTED_POLICY = "auto"
"""The policy asked for a plan that fits: the fastest exact plan under a budget."""


def size_text(n: int) -> str:
    """"12 GB" for whole decimal gigabytes (how cards are sold), else `format_bytes`'s binary units."""
    return f"{n // 10**9} GB" if n and n % 10**9 == 0 else format_bytes(n)


def device_text(device: DeviceProfile) -> str:
    """"k40c's 12 GB", less its CUDA context where one is reserved."""
    text = f"{device.name}'s {size_text(device.memory_bytes)}"
    if device.context_bytes:
        text += (f" less its {format_bytes(device.context_bytes)} CUDA context and library handles "
                 f"({format_bytes(device.usable_bytes)})")
    return text


@dataclass(slots=True)
class Fit:
    fits: bool                   # within the budget given and the device's memory
    needs_bytes: int             # the plan's smallest budget
    budget_bytes: int | None
    device: DeviceProfile
    suggested_policy: str | None = None          # a policy that fits the device, when this plan does not
    suggested_budget_bytes: int | None = None    # the device's usable memory, as typed
    suggested_needs_bytes: int | None = None
    suggested_step_time_s: float | None = None
    least_bytes: int | None = None               # auto cannot fit the device: the smallest budget it needs
    no_suggestion: str | None = None             # why auto could not be asked

    def to_json(self) -> dict:
        return {"fits": self.fits, "budget_bytes": self.budget_bytes, "needs_bytes": self.needs_bytes,
                "device_memory_bytes": self.device.memory_bytes,
                "device_context_bytes": self.device.context_bytes,
                "suggested": None if self.suggested_policy is None and self.least_bytes is None else {
                    "policy": SUGGESTED_POLICY, "budget_bytes": self.suggested_budget_bytes,
                    "needs_bytes": self.suggested_needs_bytes, "est_step_time_s": self.suggested_step_time_s,
                    "least_budget_bytes": self.least_bytes}}

    def format(self) -> str:
        dev, mem = self.device.name, self.device.usable_bytes
        need = f"this plan needs {format_bytes(self.needs_bytes)}"
        if self.budget_bytes is not None:
            head = f"fits the {size_text(self.budget_bytes)} budget ({need})"
            if self.needs_bytes <= mem:
                return f"  fits: yes. It {head} and {device_text(self.device)}"
            head = f"  fits: no. It {head}, but not {device_text(self.device)}"
        elif self.fits:
            return (f"  fits: yes, {device_text(self.device)} ({need}; no --budget given, so checked against the "
                    f"device)")
        else:
            head = f"  fits: no. It does not fit {device_text(self.device)}: {need}"
        if self.suggested_policy is not None:
            budget, needs = typable_budget(self.suggested_budget_bytes)[0], format_bytes(self.suggested_needs_bytes)
            return (f"{head}. Policy {self.suggested_policy} fits: --policy {self.suggested_policy} --budget "
                    f"{budget} (its plan needs {needs}, estimated step {self.suggested_step_time_s * 1e3:.1f} ms "
                    f"on {dev})")
        if self.least_bytes is not None:
            return (f"{head}. Policy {SUGGESTED_POLICY} (the search over recomputation, offload and workspaces) "
                    f"does not fit it either: it needs --budget {format_bytes(self.least_bytes)} "
                    f"({self.least_bytes:,} B) at least")
        if self.no_suggestion is not None:
            return f"{head}. Policy {SUGGESTED_POLICY} could not be tried with these options: {self.no_suggestion}"
        return head


def typable_budget(n: int) -> tuple[str, int]:
    """A --budget a user can type, at most `n`, and its bytes: "12GB", "3MiB", else rounded down to two decimals
    of a binary unit ("10.86GiB")."""
    exact = size_option(n)
    if len(exact) <= 7:
        return exact, n
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            h = n * 100 // factor
            while h > 0:   # parse_size rounds a fraction up to 512 B: step down until within n
                text = f"{h // 100}.{h % 100:02d}{unit}"
                if parse_size(text) <= n:
                    return text, parse_size(text)
                h -= 1
    return exact, n


def check_fit(plan: Plan, device: DeviceProfile, budget: int | None,
              replan: Callable[[str, int], Plan] | None = None) -> Fit:
    """The verdict for `plan` on `device`; when it misses the device's memory, `replan(policy, budget)` plans auto
    there for a suggestion (or its BudgetError's verified minimum)."""
    need, mem = plan.min_budget_bytes, device.usable_bytes
    fit = Fit(need <= mem and (budget is None or need <= budget), need, budget, device)
    if need <= mem or replan is None:
        return fit
    text, suggested = typable_budget(mem)   # planned at what is printed
    try:
        other = replan(SUGGESTED_POLICY, suggested)
    except BudgetError as e:
        fit.least_bytes = e.min_budget_bytes
        return fit
    except MinidlError as e:   # e.g. a route auto does not plan: the verdict stands alone
        fit.no_suggestion = str(e)
        return fit
    fit.suggested_policy, fit.suggested_budget_bytes = SUGGESTED_POLICY, suggested
    fit.suggested_needs_bytes = other.min_budget_bytes
    fit.suggested_step_time_s = simulate(other, device).est_step_time_s
    return fit
