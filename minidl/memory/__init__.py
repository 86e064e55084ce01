"""The memory subsystem: liveness, the tensor pool, plans and policies, the simulator, reports."""
