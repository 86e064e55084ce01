"""The memory timeline: bytes resident per role at every route step, and its PNG (`--plot`)."""
from __future__ import annotations

from pathlib import Path

from ...core.tensors import Role
from ..plan import Plan
from ..pool import align_up, format_bytes


def role_timeline(plan: Plan) -> tuple[list[str], dict[str, list[int]]]:
    """Bytes resident per role while each step computes (what the timeline plot stacks)."""
    labels = [s.label for s in plan.route.steps]
    series = {r.value: [0] * len(labels) for r in Role}
    cur = {r.value: 0 for r in Role}
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


def plot_timeline(plan: Plan, path: str | Path, title: str | None = None) -> Path:
    """A PNG of resident bytes over route steps, stacked by role, with the peak marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, series = role_timeline(plan)
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(11, 4.5), dpi=110)
    order = [r for r in series if any(series[r])]
    ax.stackplot(xs, [[b / 2**20 for b in series[r]] for r in order], labels=order, alpha=0.85)
    k = plan.binding_step if plan.steps else 0
    peak_k = plan.peak_step
    ax.axvline(peak_k, color="k", lw=0.8, ls="--")
    ax.annotate(f"peak {format_bytes(plan.peak_bytes)}\n{labels[peak_k] if labels else ''}",
                (peak_k, plan.peak_bytes / 2**20), textcoords="offset points", xytext=(8, -20), fontsize=8)
    n_fwd = plan.route.turn  # the first backward step (a packed route's re-forwards belong to backward)
    ax.axvspan(0, n_fwd - 0.5, color="0.93", zorder=-1)
    ax.set_xlabel(f"route step (shaded: forward; then backward and update); budget binds at step {k}")
    ax.set_ylabel("MiB resident")
    ax.set_title(title or f"memory timeline, policy '{plan.policy}'")
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.set_xlim(0, max(1, len(labels) - 1))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
