"""The smallest budget a `BudgetError` states: a budget at which the policy plans and one byte less does not.

Why a search. A policy's first answer to "too small" is the arena its most frugal plan *at that budget* needs.
That plan depends on the budget: each convolution takes the fastest workspace that fits what is free under it,
and `auto`, `offload` and `window` choose what moves and when to fit it, so planning again at the stated number
can choose differently and need more (the error comes back with a larger minimum) or, with more room to choose
from, less. A number a user is told to use must work, and be the edge, so it is searched:

1. **verify**: plan at the stated minimum M. If it fails, its own error states a new M; repeat (at most
   `VERIFY_ROUNDS`), then step up by `STEP_UP` of M per round until a plan is made;
2. **search down**: bisect between the budget that failed and the verified M (at most `SEARCH_PROBES` plannings,
   stopping at `RESOLUTION` of M): a probe that plans becomes the new M;
3. **settle on the edge**: until M - 1 is a budget known to fail, probe, in this order, the arena the plan made at M
   needs (often well below M: the plan fits in less than it was given), M - 1, and the middle of the interval
   left. What is stated is then a budget that plans while one byte less does not. Usually one or two plannings
   more than steps 1-2 (the plan's own arena, then one byte below it: `offload` on 25 random small nets, 9.0
   plannings in all on average instead of 6.7); at most about twice log2 of the interval step 2 left (23).

What the figure is, per policy (docs/policies/auto.md summarizes it for users):
- `none`: exact. Its placement does not depend on the budget (everything up front, fastest algorithms).
- every other policy: a budget at which it plans, with one byte less failing, found below the policy's own figure
  and above the budget that failed. For `liveness` and `recompute` this is the smallest budget in practice
  (their placement depends on the budget only through workspace choices). For `offload`, `auto` and `window` a
  smaller budget can still plan: whether they plan is not monotone in the budget (measured on a 5-conv net under
  `offload`: 213,504 B plans, 214,528 B does not, 229,376 B and up all do), so the smallest budget of all would
  take a planning per 512 B block; the message says which budget the search started from.
"""
from __future__ import annotations

from typing import Callable

from ...core.errors import BudgetError
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

MONOTONE_IN_PRACTICE = ("liveness", "recompute")
"""Policies whose edge is, in practice, the smallest budget that plans (see the module doc)."""


def verified_minimum(plan_at: Callable[[int], object], policy: str, budget: int, err: BudgetError) -> BudgetError:
    """`err` (raised planning at `budget`) with its stated minimum replaced by the edge of a budget at which
    `plan_at` plans (it plans there, not one byte below).

    `plan_at(b)` plans at budget `b` (returning the plan) and raises BudgetError if it does not fit. The returned
    error's message keeps the policy's own explanation and says how the number was found."""
    stated = err.min_budget_bytes
    if stated is None or policy in EXACT_POLICIES:
        return err
    m, last, rounds = stated, err, 0
    while True:
        try:
            plan = plan_at(m)
            break
        except BudgetError as e:
            rounds += 1
            last = e
            nxt = e.min_budget_bytes if e.min_budget_bytes is not None else m
            if rounds > VERIFY_ROUNDS or nxt <= m:
                nxt = m + max(ALIGNMENT, int(m * STEP_UP))
            m = nxt
    lo, hi = budget, m            # lo does not plan, hi does (with `plan`)

    def probe(b: int) -> bool:
        nonlocal lo, hi, plan
        try:
            p = plan_at(b)
        except BudgetError:
            lo = b
            return False
        hi, plan = b, p
        return True

    for _ in range(SEARCH_PROBES):
        if hi - lo <= max(ALIGNMENT, int(hi * RESOLUTION)):
            break
        probe((lo + hi) // 2)
    edge_planned_at = None        # hi - 1 planned without telling anything smaller: bisect instead of walking
    while hi - lo > 1:
        arena = plan.min_budget_bytes
        if lo < arena < hi:
            probe(arena)          # the plan made at hi fits in less: try its own arena
        elif edge_planned_at != hi:
            if probe(hi - 1):
                edge_planned_at = hi
        else:
            probe((lo + hi) // 2)
    searched = "" if hi == stated else (f"; the plan made at {format_bytes(budget)} needed {format_bytes(stated)} "
                                        f"({stated:,} B), and the edge was searched between the two")
    caveat = "" if policy in MONOTONE_IN_PRACTICE else (
        f"; a smaller budget may still plan: '{policy}' makes other choices under other budgets, and whether it "
        f"plans need not be monotone in the budget")
    note = f" (verified: '{policy}' plans at exactly that budget and not at one byte less{searched}{caveat})"
    msg = str(err).replace(f"{format_bytes(stated)} ({stated:,} B)", f"{format_bytes(hi)} ({hi:,} B)" + note, 1)
    if msg == str(err) and hi != stated:
        msg += f" It plans at {format_bytes(hi)} ({hi:,} B){note}."
    return BudgetError(msg, hi, last.binding if hi != stated else err.binding)
