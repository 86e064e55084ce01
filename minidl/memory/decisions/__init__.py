"""Decisions: what happens to a tensor between two of its uses besides staying resident (offload, recompute,
compress, weights on the host, allreduce). Each turns a base `Schedule` into another, with a reason per event; only
the planner's one placement pass places and checks the budget, so no decision is a special case downstream."""
