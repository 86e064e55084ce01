"""The memory timeline's figure (`--plot`): the budget drawn, one unit throughout, the legend beside the data, and
no "budget binds" on a plan made without a budget."""
import matplotlib.pyplot as plt

import minidl as dl
from minidl.memory.report.timeline import plot_unit, timeline_figure
from tests.planning import planned

from .nets import NETS


def _figure(budget):
    plan = planned(NETS["resnet20"](), dl.SGD(lr=0.1), "auto" if budget else "liveness", budget)
    return plan, timeline_figure(plan, "resnet20", budget)


def test_the_timeline_draws_the_budget_in_the_units_of_its_axis():
    plan0, _ = _figure(None)
    budget = plan0.min_budget_bytes * 3 // 4 // 512 * 512
    plan, fig = _figure(budget)
    try:
        (ax,) = fig.axes
        unit, factor = plot_unit(max(plan.peak_bytes, budget))
        assert ax.get_ylabel() == f"{unit} resident"
        lines = [ln for ln in ax.get_lines() if ln.get_label().startswith("budget ")]
        assert len(lines) == 1 and lines[0].get_ydata()[0] == budget / factor
        assert unit in ax.get_title() and f"budget {lines[0].get_label().split()[1]} {unit}" in ax.get_title()
        assert ax.get_ylim()[1] > budget / factor
        fig.canvas.draw()   # the legend sits right of the axes, over no data
        renderer = fig.canvas.get_renderer()
        assert ax.get_legend().get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1
        assert "the budget binds at step" in ax.get_xlabel()
    finally:
        plt.close(fig)


def test_a_timeline_without_budget_says_no_budget_binds():
    plan, fig = _figure(None)
    try:
        (ax,) = fig.axes
        assert "budget binds" not in ax.get_xlabel() and "no budget" in ax.get_xlabel()
        assert "no budget" in ax.get_title()
        assert not [ln for ln in ax.get_lines() if ln.get_label().startswith("budget")]
    finally:
        plt.close(fig)


def test_plot_unit():
    assert plot_unit(3 * 2**30) == ("GiB", 2**30) and plot_unit(2**30 - 1) == ("MiB", 2**20)
    assert plot_unit(100) == ("B", 1)
