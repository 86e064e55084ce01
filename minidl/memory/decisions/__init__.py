"""Decisions: what happens to one tensor between two of its uses, besides staying resident.

Each module here turns a base `Schedule` (from liveness) into one with some tensors' residencies changed, and says
why in the events' reasons: `offload` (copy to the host after the forward use, prefetch before the backward use)
and `recompute` (drop cheap layers' outputs, rebuild them from the segment's checkpoint). None of them places
tensors or checks a budget alone: the planner's single placement pass does that, so a new decision never needs a
special case in the executor or the simulator.
"""
