"""Schedulers: searches combining `memory/decisions/` for a whole route under a budget; each returns a plan."""
