"""The smallest budget a `BudgetError` states: a budget at which the policy plans, verified by planning at it.

Why a search. A policy's first answer to "too small" is the arena its most frugal plan *at that budget* needs.
That plan depends on the budget: each convolution takes the fastest workspace that fits what is free under it,
and `auto` and `offload` cut their copy windows to it, so planning again at the stated number can choose
differently and need more (the error comes back with a larger minimum) or, with more room to choose from, less.
A number a user is told to use must work, so it is checked:

1. **verify**: plan at the stated minimum M. If it fails, its own error states a new M; repeat (at most
   `VERIFY_ROUNDS`), then step up by `STEP_UP` of M per round until a plan is made;
2. **search down**: bisect between the budget that failed and the verified M (at most `SEARCH_PROBES` plannings,
   stopping at `RESOLUTION` of M): a probe that plans becomes the new M.

What "minimum" means, per policy (also in the README):
- `none`: exact. Its placement does not depend on the budget (everything up front, fastest algorithms).
- `liveness`, `recompute`: the arena of the plan made at the failing budget, verified; then the smallest found by
  the bisection. Exact in practice (their placement depends on the budget only through workspace choices).
- `offload`, `auto`, `window`: the smallest budget found by the bisection above, verified: planning at the stated
  number succeeds. A smaller budget that plans may exist between two probes (feasibility is not monotone in the
  budget for these policies: more room can mean other choices), but never below the failing budget it started
  from, and never more than `RESOLUTION` below the stated one within the bisection's interval.
"""
from __future__ import annotations

from typing import Callable

from ...errors import BudgetError
from ..pool import ALIGNMENT, format_bytes

VERIFY_ROUNDS = 4
"""Times the stated minimum is replaced by the one a failed verification states, before stepping up."""

STEP_UP = 0.01
"""After `VERIFY_ROUNDS`, each further round raises the candidate by this share of it."""

SEARCH_PROBES = 6
"""Plannings the downward bisection may spend (ResNet-2500 under `auto`: a few seconds each)."""

RESOLUTION = 0.002
"""The bisection stops when the interval is narrower than this share of the verified minimum."""

EXACT_POLICIES = ("none",)


def verified_minimum(plan_at: Callable[[int], object], policy: str, budget: int, err: BudgetError) -> BudgetError:
    """`err` (raised planning at `budget`) with its stated minimum replaced by one at which `plan_at` plans.

    `plan_at(b)` plans at budget `b` and raises BudgetError if it does not fit. The returned error's message
    keeps the policy's own explanation and says how the number was found."""
    stated = err.min_budget_bytes
    if stated is None or policy in EXACT_POLICIES:
        return err
    m, last, rounds = stated, err, 0
    while True:
        try:
            plan_at(m)
            break
        except BudgetError as e:
            rounds += 1
            last = e
            nxt = e.min_budget_bytes if e.min_budget_bytes is not None else m
            if rounds > VERIFY_ROUNDS or nxt <= m:
                nxt = m + max(ALIGNMENT, int(m * STEP_UP))
            m = nxt
    lo, hi = budget, m
    for _ in range(SEARCH_PROBES):
        if hi - lo <= max(ALIGNMENT, int(hi * RESOLUTION)):
            break
        mid = (lo + hi) // 2
        try:
            plan_at(mid)
            hi = mid
        except BudgetError:
            lo = mid
    if hi == stated:
        note = f" (verified: '{policy}' plans at exactly that budget)"
    else:
        note = (f" (verified by planning at it; the plan made at {format_bytes(budget)} needed "
                f"{format_bytes(stated)} ({stated:,} B); smallest found by a bisection of at most {SEARCH_PROBES} "
                f"plannings)")
    msg = str(err).replace(f"{format_bytes(stated)} ({stated:,} B)", f"{format_bytes(hi)} ({hi:,} B)" + note, 1)
    if msg == str(err) and hi != stated:
        msg += f" The smallest budget that works is {format_bytes(hi)} ({hi:,} B){note}."
    return BudgetError(msg, hi, last.binding if hi != stated else err.binding)
