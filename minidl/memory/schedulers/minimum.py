"""The smallest budget a `BudgetError` states: one at which the policy plans while one byte less does not.

A policy's plan depends on its budget (workspaces fitted to what is free; what `auto`, `offload`, `window` move),
so its stated minimum M may not plan, or a smaller one may. So: verify M (a failure states a new M; after
`VERIFY_ROUNDS`, step up by `STEP_UP`); bisect down from M (`SEARCH_PROBES`, to `RESOLUTION`); then settle on the
edge, probing the arena the plan at M needs, M - 1, and the middle. `none` is exact; `liveness` and `recompute` are
monotone in practice; for `offload`, `auto`, `window` a smaller budget may still plan (5-conv net under `offload`:
213,504 B plans, 214,528 B does not), and the message says so.
"""
from __future__ import annotations

from typing import Callable

from ...core.errors import BudgetError
from ..pool import ALIGNMENT, format_bytes

VERIFY_ROUNDS = 4
"""Times a failed verification's minimum replaces the candidate before stepping up."""

STEP_UP = 0.01
"""Share of the candidate each later round adds."""

SEARCH_PROBES = 6
"""Plannings for the downward bisection (ResNet-2500 under `auto`: seconds each)."""

RESOLUTION = 0.002
"""Bisection stops below this share of the verified minimum."""

EXACT_POLICIES = ("none",)

MONOTONE_IN_PRACTICE = ("liveness", "recompute")
"""Policies whose edge is in practice the smallest budget that plans."""


def verified_minimum(plan_at: Callable[[int], object], policy: str, budget: int, err: BudgetError) -> BudgetError:
    """`err` (raised at `budget`) restated at the edge `plan_at` (plans or raises BudgetError) finds, saying how."""
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
    lo, hi = budget, m            # lo does not plan, hi does

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
    edge_planned_at = None        # hi - 1 planned: bisect instead of walking down
    while hi - lo > 1:
        arena = plan.min_budget_bytes
        if lo < arena < hi:
            probe(arena)          # the plan at hi fits in less
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
