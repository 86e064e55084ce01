"""A Chrome/Perfetto trace of a plan or a run (`--trace`): compute, transfer and all-reduce tracks and a memory
counter."""
from __future__ import annotations

import json
from pathlib import Path

from ..plan import EventKind, Plan

TRACKS = {"compute": 1, "transfer": 2, "allreduce": 3}
"""Thread ids of the trace's tracks: kernels, host<->device copies, data-parallel all-reduces (in flight)."""


def write_trace(path: str | Path, plan: Plan, events=None) -> Path:
    """A Chrome/Perfetto trace: compute (and transfer) tracks from timed events, and a memory counter track.

    Without timed events (plan only), steps are laid out one microsecond apart so the memory track still
    reads as a function of the route.
    """
    trace = []
    if events:
        for e in events:
            trace.append({"name": e.name, "ph": "X", "ts": e.start_s * 1e6, "dur": max(e.dur_s * 1e6, 0.01),
                          "pid": 1, "tid": TRACKS.get(e.track, 2), "args": {"step": e.step}})
            if e.track == "compute":  # transfer events (tid 2) carry no pool reading
                trace.append({"name": "pool in use", "ph": "C", "ts": e.start_s * 1e6, "pid": 1,
                              "args": {"bytes": e.in_use}})
    else:
        copying: dict[str, float] = {}  # transfer track: from OFFLOAD/PREFETCH to the RELEASE/WAIT that ends it
        for k, (step, sp) in enumerate(zip(plan.route.steps, plan.steps)):
            trace.append({"name": step.label, "ph": "X", "ts": float(k), "dur": 1.0, "pid": 1, "tid": 1})
            trace.append({"name": "pool in use", "ph": "C", "ts": float(k), "pid": 1, "args": {"bytes": sp.in_use}})
            for ev, ts in [(ev, float(k)) for ev in sp.before] + [(ev, k + 1.0) for ev in sp.after]:
                if ev.kind in (EventKind.OFFLOAD, EventKind.PREFETCH):
                    copying[ev.tensor] = ts
                elif ev.kind in (EventKind.RELEASE, EventKind.WAIT) and ev.tensor in copying:
                    t0 = copying.pop(ev.tensor)
                    name = ("offload " if ev.kind is EventKind.RELEASE else "prefetch ") + ev.tensor
                    trace.append({"name": name, "ph": "X", "ts": t0, "dur": max(ts - t0, 0.01), "pid": 1, "tid": 2,
                                  "args": {"bytes": plan.sizes.get(ev.tensor, ev.nbytes)}})
                elif ev.kind is EventKind.ALLREDUCE:
                    copying[ev.tensor] = ts
                elif ev.kind is EventKind.REDUCED and ev.tensor in copying:
                    t0 = copying.pop(ev.tensor)
                    trace.append({"name": f"allreduce {ev.tensor}", "ph": "X", "ts": t0, "dur": max(ts - t0, 0.01),
                                  "pid": 1, "tid": TRACKS["allreduce"], "args": {"bytes": ev.nbytes}})
    meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "transfer"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 3, "args": {"name": "allreduce"}},
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"minidl ({plan.policy})"}}]
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": meta + trace, "displayTimeUnit": "ms"}))
    return path
