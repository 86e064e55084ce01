"""Schedulers: searches that combine `memory/decisions/` for a whole route under a budget (`auto` simulates its
candidates and keeps the fastest that fits); each returns an ordinary plan."""
