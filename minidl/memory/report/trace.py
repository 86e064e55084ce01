"""A Chrome/Perfetto trace of a plan or a run (`--trace`): compute, transfer and all-reduce tracks and a memory
counter."""
from __future__ import annotations

import json
from pathlib import Path

from ..plan import EventKind, Plan

TRACKS = {"compute": 1, "transfer": 2, "allreduce": 3}
"""Thread ids of the trace's tracks: kernels, copies, all-reduces in flight."""


def write_trace(path: str | Path, plan: Plan, events=None, device="k40c") -> Path:
    """A Chrome/Perfetto trace from timed events, with a memory counter; without events, the simulator's predicted
    timeline on `device`."""
    trace = []
    if events:
        for e in events:
            trace.append({"name": e.name, "ph": "X", "ts": e.start_s * 1e6, "dur": max(e.dur_s * 1e6, 0.01),
                          "pid": 1, "tid": TRACKS.get(e.track, 2), "args": {"step": e.step}})
            if e.track == "compute":  # copies carry no pool reading
                trace.append({"name": "pool in use", "ph": "C", "ts": e.start_s * 1e6, "pid": 1,
                              "args": {"bytes": e.in_use}})
    else:
        _predicted(trace, plan, device)
    meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "transfer"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 3, "args": {"name": "allreduce"}},
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"minidl ({plan.policy})"}}]
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": meta + trace, "displayTimeUnit": "ms"}))
    return path


def _predicted(trace: list, plan: Plan, device) -> None:
    from ..simulate import predicted_timeline

    tl = predicted_timeline(plan, device)
    for (step, sp), (t0, t1) in zip(zip(plan.route.steps, plan.steps), tl.steps):
        trace.append({"name": step.label, "ph": "X", "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6, "pid": 1, "tid": 1})
        trace.append({"name": "pool in use", "ph": "C", "ts": t0 * 1e6, "pid": 1, "args": {"bytes": sp.in_use}})
    for kind, tensor, t0, t1, nbytes in tl.copies:
        trace.append({"name": f"{kind} {tensor}", "ph": "X", "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6, "pid": 1,
                      "tid": TRACKS["transfer"], "args": {"bytes": nbytes}})
    reducing: dict[str, float] = {}   # all-reduce track: from ALLREDUCE to the REDUCED that ends it (at boundaries)
    for sp, (before_at, after_at) in zip(plan.steps, tl.boundaries):
        for ev, ts in [(ev, before_at) for ev in sp.before] + [(ev, after_at) for ev in sp.after]:
            if ev.kind is EventKind.ALLREDUCE:
                reducing[ev.tensor] = ts
            elif ev.kind is EventKind.REDUCED and ev.tensor in reducing:
                t0 = reducing.pop(ev.tensor)
                trace.append({"name": f"allreduce {ev.tensor}", "ph": "X", "ts": t0 * 1e6,
                              "dur": max((ts - t0) * 1e6, 0.01), "pid": 1, "tid": TRACKS["allreduce"],
                              "args": {"bytes": ev.nbytes}})
