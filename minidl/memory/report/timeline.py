"""The memory timeline: bytes resident per role at every route step, and its PNG (`--plot`)."""
from __future__ import annotations

from pathlib import Path

from ..plan import Plan
from ..pool import align_up


def role_timeline(plan: Plan) -> tuple[list[str], dict[str, list[int]]]:
    """Bytes resident per role while each step computes (what the timeline plot stacks)."""
    labels = [s.label for s in plan.route.steps]
    series = {r.value: [0] * len(labels) for r in plan.roles}
    cur = {r.value: 0 for r in plan.roles}
    resident: dict[str, int] = {}

    def apply(ev):
        role = plan.role_of(ev.tensor).value
        if ev.kind.allocates:
            resident[ev.tensor] = ev.nbytes
            cur[role] += align_up(ev.nbytes)
        elif ev.kind.frees:
            cur[role] -= align_up(resident.pop(ev.tensor, ev.nbytes))

    for ev in plan.setup:
        apply(ev)
    for k, sp in enumerate(plan.steps):
        for ev in sp.before:
            apply(ev)
        for role, b in cur.items():
            series[role][k] = b
        for ev in sp.after:
            apply(ev)
    return labels, series


_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def plot_unit(nbytes: int) -> tuple[str, int]:
    """The one unit of a timeline's every label: the largest binary unit `nbytes` holds at least one of."""
    return next(((u, f) for u, f in _UNITS if nbytes >= f), _UNITS[-1])


def timeline_figure(plan: Plan, title: str | None = None, budget: int | None = None):
    """Resident bytes over steps, stacked by role, with the budget's line (None: the arena's), the peak marked, one
    unit throughout, the legend beside the plot; `title` names the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, series = role_timeline(plan)
    unit, factor = plot_unit(max(plan.peak_bytes, budget or 0))

    def size(n: int) -> str:   # rounded up, as format_bytes and the memory report round
        h = -(-int(n) * 100 // factor)
        return f"{h // 100}.{h % 100:02d} {unit}" if factor > 1 else f"{n} B"

    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(12, 4.5), dpi=110, layout="constrained")
    order = [r for r in series if any(series[r])]
    ax.stackplot(xs, [[b / factor for b in series[r]] for r in order], labels=order, alpha=0.85)
    peak_k = plan.peak_step
    ax.axvline(peak_k, color="k", lw=0.8, ls="--",   # said in the legend: a label on the plot would hide data
               label=f"peak {size(plan.peak_bytes)}" + (f",\n{labels[peak_k]}" if labels else ""))
    top = plan.peak_bytes
    if budget is not None:
        ax.axhline(budget / factor, color="crimson", lw=1.4, label=f"budget {size(budget)}")
        top = max(top, budget)
    n_fwd = plan.route.turn  # the first backward step (a packed route's re-forwards belong to backward)
    ax.axvspan(0, n_fwd - 0.5, color="0.93", zorder=-1)
    k = plan.binding_step if plan.steps else 0
    where = (f"the budget binds at step {k}" if budget is not None else
             f"no budget: the arena needed ({size(plan.min_budget_bytes)}) is set at step {k}")
    ax.set_xlabel(f"route step (shaded: forward; then backward and update); {where}")
    ax.set_ylabel(f"{unit} resident")
    run = f"{title}, " if title else "memory timeline, "
    given = ""
    if budget is not None and budget % 10**9 == 0:   # as typed (--budget 12GB), beside the plot's unit
        given = f" ({budget // 10**9} GB)"
    ax.set_title(f"{run}{f'budget {size(budget)}{given}' if budget is not None else 'no budget'}, "
                 f"policy {plan.policy}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    ax.set_xlim(0, max(1, len(labels) - 1))
    ax.set_ylim(0, top / factor * 1.08 or 1)
    return fig


def plot_timeline(plan: Plan, path: str | Path, title: str | None = None, budget: int | None = None) -> Path:
    """A PNG of `timeline_figure` (`--plot`)."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(plan, title, budget)
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
