"""Schedulers: searches that choose decisions for a whole route under a budget.

`auto` is the global one: it tries bases (liveness, speed- and memory-centric recomputation), offloads on top and
per-step workspace sizing, simulates each candidate and keeps the fastest that fits. A scheduler only combines the
decisions of `memory/decisions/`; its result is an ordinary plan.
"""
