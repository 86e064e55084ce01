"""Whether a plan fits, said in words: against `--budget`, and against the device profile's memory.

A plan made without a budget is never refused (nothing limits it), so `minidl plan` could print a 38 GiB plan and
a step time for a 12 GB card without a word that it cannot run there. The verdict here compares the plan's
smallest budget with the budget given and with the device's memory; when the device is what is exceeded, it asks
policy `auto` (the search over recomputation, offload and workspaces) for a plan under the device's memory, so
the answer names a policy and a budget that work, or the smallest budget auto itself would need (the verified
minimum of `schedulers/minimum.py`). Planning again is left to the caller (`replan`), so the suggestion is made
with the same options (backend, costs, paging, micro-batches) as the plan it stands beside.
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
"""The policy asked for a plan that fits: the fastest exact plan under a budget, by its own search."""


def size_text(n: int) -> str:
    """A size as a user would type it: "12 GB" for a whole number of decimal gigabytes (how cards are sold and
    how the device profiles are given), else `format_bytes`'s binary units."""
    return f"{n // 10**9} GB" if n and n % 10**9 == 0 else format_bytes(n)  # not size_option: "12 GB", "3.00 MiB"


def device_text(device: DeviceProfile) -> str:
    """The memory a plan may use on `device`, in words: "k40c's 12 GB" or, where a CUDA context is reserved,
    "k40c's 12 GB less its 320 MiB CUDA context (10.9 GiB)"."""
    text = f"{device.name}'s {size_text(device.memory_bytes)}"
    if device.context_bytes:
        text += (f" less its {format_bytes(device.context_bytes)} CUDA context and library handles "
                 f"({format_bytes(device.usable_bytes)})")
    return text


@dataclass(slots=True)
class Fit:
    fits: bool                   # within the budget given and within the device's memory
    needs_bytes: int             # the plan's smallest budget
    budget_bytes: int | None     # --budget (None: not given)
    device: DeviceProfile
    suggested_policy: str | None = None          # a policy that fits the device's memory, when this plan does not
    suggested_budget_bytes: int | None = None    # the budget to give it (the device's usable memory, as typed)
    suggested_needs_bytes: int | None = None     # what that plan needs (at most the suggested budget)
    suggested_step_time_s: float | None = None
    least_bytes: int | None = None               # when auto cannot fit the device: the smallest budget it needs
    no_suggestion: str | None = None             # why auto could not be asked (another option rules it out)

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
    """A --budget a user can type, of at most `n` bytes, and its bytes: `n` itself where a unit states it in a few
    digits ("12GB", "3MiB"), else `n` rounded down to two decimals of its binary unit ("10.86GiB", not
    "11391070KiB"). Rounded down, so that the suggestion stays within the memory it was computed for."""
    exact = size_option(n)
    if len(exact) <= 7:
        return exact, n
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            h = n * 100 // factor
            while h > 0:   # parse_size rounds a fraction up to 512 B: step down until it is within n
                text = f"{h // 100}.{h % 100:02d}{unit}"
                if parse_size(text) <= n:
                    return text, parse_size(text)
                h -= 1
    return exact, n


def check_fit(plan: Plan, device: DeviceProfile, budget: int | None,
              replan: Callable[[str, int], Plan] | None = None) -> Fit:
    """The verdict for `plan` (made under `budget`, None for none) on `device`. When it does not fit the device's
    memory and `replan(policy, budget)` is given, policy auto is planned at that memory for a suggestion (one
    planning if it fits; if not, its BudgetError's verified minimum is reported instead)."""
    need, mem = plan.min_budget_bytes, device.usable_bytes
    fit = Fit(need <= mem and (budget is None or need <= budget), need, budget, device)
    if need <= mem or replan is None:
        return fit
    text, suggested = typable_budget(mem)   # planned at what is printed, so the suggestion is verified as typed
    try:
        other = replan(SUGGESTED_POLICY, suggested)
    except BudgetError as e:
        fit.least_bytes = e.min_budget_bytes
        return fit
    except MinidlError as e:   # e.g. --paged or --ranks with a route auto does not plan: the verdict stands alone
        fit.no_suggestion = str(e)
        return fit
    fit.suggested_policy, fit.suggested_budget_bytes = SUGGESTED_POLICY, suggested
    fit.suggested_needs_bytes = other.min_budget_bytes
    fit.suggested_step_time_s = simulate(other, device).est_step_time_s
    return fit
