"""Offload windows fitted to the budget (`decisions/offload_fit.py`), and the readable plan report around it."""
import pytest

from minidl.cli import main
from minidl.memory.report import explain
from minidl.memory.simulate import get_profile, simulate
from minidl.models import build_model
from minidl.optim import make_optimizer
from tests.planning import planned


def _resnet110():
    return build_model("resnet", depth=110, batch=64), make_optimizer("sgd", 0.01)


def test_auto_hides_copies_that_used_to_be_exposed():
    """ResNet-110 b64 on a K40c at half its liveness budget: before the copies were fitted to the budget, `auto`
    fell back to releasing at once and prefetching just in time, which hid 0% of 1.37 s of copies (estimated step
    3.11 s against 1.72 s in memory). Fitted, every copy hides and the step costs what it costs in memory."""
    net, opt = _resnet110()
    live = planned(net, opt, "liveness")
    in_memory = simulate(live, get_profile("k40c:64GB"))
    plan = planned(net, opt, "auto", live.min_budget_bytes // 2, device="k40c")
    sim = simulate(plan, "k40c")
    assert plan.min_budget_bytes <= live.min_budget_bytes // 2
    assert plan.offloaded_bytes > 0 and sim.transfer_time_s > 0.5
    assert sim.transfer_hidden_fraction >= 0.99
    assert sim.est_step_time_s <= 1.01 * in_memory.est_step_time_s


def test_device_with_its_memory_raised():
    p = get_profile("k40c:64GB")
    assert p.memory_bytes == 64 * 10**9 and p.name == "k40c" and p.flops == get_profile("k40c").flops
    with pytest.raises(ValueError, match="k40c:lots"):
        get_profile("k40c:lots")
    with pytest.raises(ValueError, match="unknown device profile"):
        get_profile("k41:12GB")


def test_explain_filters_and_summary():
    net = build_model("resnet", depth=20, batch=4)   # (weights on the device: only activations move)
    plan = planned(net, make_optimizer("sgd", 0.01), "auto", 4 * 2**20, device="cpu", host_weights=False)
    one = explain(plan, select="layer2.0.conv1")
    steps = [ln for ln in one.splitlines() if ln.startswith("step ")]
    assert steps and all("layer2.0.conv1" in ln or "layer2.0.bn1" in ln for ln in steps)
    assert "act:layer1.0.conv1" not in one
    rng = explain(plan, steps=(10, 12))
    assert [ln.split()[1] for ln in rng.splitlines() if ln.startswith("step ")] == ["10", "11"]
    short = explain(plan, full=False)
    assert "summary of" in short and "--explain-full" in short and len(short.splitlines()) < 150
    assert len(explain(plan).splitlines()) > len(short.splitlines())   # 189 steps: full listing by default
    # an allocation and its free report the same size (a 64 B tensor takes a 512 B block: both say so)
    full = explain(plan)
    assert "64 B (512 B block)" in full and " 512 B  " not in full


def test_plan_text_shows_transfer_figures(capsys, tmp_path):
    assert main(["plan", "resnet", "--depth", "20", "--batch", "4", "--budget", "4MiB", "--device", "cpu",
                 "--plot", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert "estimated step time on cpu" in out
    assert "exposed" in out and "hidden behind compute" in out


def test_plan_trace_is_the_predicted_timeline(tmp_path):
    """`plan --trace`: steps at the simulator's estimated times, copies when the link carries them."""
    import json

    from minidl.memory.report import write_trace
    from minidl.memory.simulate import predicted_timeline

    net, opt = _resnet110()
    live = planned(net, opt, "liveness")
    plan = planned(net, opt, "auto", live.min_budget_bytes // 2, device="k40c")
    sim = simulate(plan, "k40c")
    evs = json.loads(write_trace(tmp_path / "t.json", plan, device="k40c").read_text())["traceEvents"]
    compute = sorted((e for e in evs if e.get("tid") == 1 and e["ph"] == "X"), key=lambda e: e["ts"])
    copies = [e for e in evs if e.get("tid") == 2 and e["ph"] == "X"]
    assert len(compute) == len(plan.steps)
    # the step ends when the simulator says; compute alone sums to its compute time (the rest is waiting)
    assert compute[-1]["ts"] + compute[-1]["dur"] == pytest.approx(sim.est_step_time_s * 1e6, rel=1e-9)
    assert sum(e["dur"] for e in compute) == pytest.approx(sim.compute_time_s * 1e6, rel=1e-9)
    # each copy takes bytes / link bandwidth, one at a time on the link, and they sum to the transfer time
    link = get_profile("k40c").link_bw
    assert all(e["dur"] == pytest.approx(e["args"]["bytes"] / link * 1e6) for e in copies)
    assert sum(e["dur"] for e in copies) == pytest.approx(sim.transfer_time_s * 1e6, rel=1e-9)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in copies)
    assert all(a1 <= b0 + 1e-6 for (_, a1), (b0, _) in zip(spans, spans[1:]))
    # an offload starts no earlier than the end of the step after which it is issued
    tl = predicted_timeline(plan, "k40c")
    ends = {s.label: t1 for s, (_, t1) in zip(plan.route.steps, tl.steps)}
    k_of = {ev.tensor: k for k, sp in enumerate(plan.steps) for ev in sp.after if ev.kind.value == "offload"}
    for kind, tensor, t0, _, _ in tl.copies:
        if kind == "offload":
            assert t0 >= ends[plan.route.steps[k_of[tensor]].label] - 1e-12


def test_progress_line_only_on_a_terminal(capsys, monkeypatch):
    import io
    import time

    from minidl.cli import common as cli

    monkeypatch.setattr(cli.ProgressLine, "AFTER_S", 0.0)
    monkeypatch.setattr(cli.ProgressLine, "EVERY_S", 0.01)
    tty = io.StringIO()
    monkeypatch.setattr(cli.sys, "stderr", tty)
    with cli.ProgressLine("planning x", enabled=True):
        time.sleep(0.1)
    assert "planning x... " in tty.getvalue() and tty.getvalue().endswith("\r\033[K")
    quiet = io.StringIO()
    monkeypatch.setattr(cli.sys, "stderr", quiet)
    with cli.ProgressLine("planning y", enabled=False):
        time.sleep(0.05)
    assert quiet.getvalue() == ""
    assert main(["plan", "lenet", "--batch", "2", "--budget", "64MiB"]) == 0   # stderr is not a TTY here
    assert "planning" not in capsys.readouterr().err


def test_explain_names_the_workspace_algorithm_chosen():
    net = build_model("resnet", depth=20, batch=4)   # (weights on the device: some workspaces refused)
    plan = planned(net, make_optimizer("sgd", 0.01), "auto", 4 * 2**20, device="cpu", host_weights=False)
    k = next(k for k, sp in enumerate(plan.steps) if sp.refused)
    text = explain(plan, steps=(k, k + 1))
    free = next(ln for ln in text.splitlines() if "- free" in ln and "ws:" in ln)
    assert free.rstrip().endswith(f"workspace of {plan.steps[k].algo}")
