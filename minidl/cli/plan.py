"""`minidl info`, `minidl plan` and `minidl reproduce`: a network's layers, its plan under a policy and budget
(no compute), a paper's tables."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from ..core.errors import OptionError
from ..memory.pool import format_bytes
from .common import (
    ProgressLine,
    build_net,
    cost_table,
    cpu_menu,
    measured_device,
    memory_json,
    moved_line,
    plan_request,
    plot_title,
    say_written,
)


def cmd_info(args) -> dict:
    from ..graph.summary import summarize

    summary = summarize(build_net(args), name=args.model)  # the same table as Network.summary()
    if not args.json:
        print(summary.format())
    return {"model": args.model, **summary.to_json()}


def cmd_plan(args) -> dict:
    from ..memory.policies import plan_network
    from ..memory.report import explain, memory_report, plot_timeline, write_trace
    from ..memory.report.fit import check_fit
    from ..memory.request import Target
    from ..memory.simulate import simulate
    from ..optim import make_optimizer

    t = time.perf_counter()
    net = build_net(args)
    opt = make_optimizer(args.optimizer, 0.01)
    request = plan_request(args)
    if args.devices is not None:
        return _plan_devices(args, net, opt)
    backend = None
    if args.backend != "cpu":
        from ..backend import get_backend

        backend = get_backend(args.backend, math=args.math)
    else:
        from ..backend.mathmode import apply_math

        apply_math(None, args.math)  # the CPU computes in fp32 only: refuses tf32, naming --math
    costs, device = cost_table(args, backend), args.device
    if device == "measured":   # this GPU's host link (and, with --autotune, efficiency) measured before planning
        if backend is None:
            raise OptionError("--device measured measures a GPU's host link: give --backend cuda")
        device = measured_device(net, opt, backend, costs)
    target = Target.for_run(device, backend, costs, cpu=cpu_menu(args))
    name = args.device or target.profile.name
    what = (f"planning {args.model}{f'-{args.depth}' if args.depth else ''} ({len(net.layer_nodes)} layers), policy "
            f"{request.policy}" + (f", budget {format_bytes(request.budget)}" if request.budget is not None else ""))

    def plan_for(policy: str, budget: int | None):
        """This request under `policy` and `budget` (the fit verdict's question: auto at the device's memory)."""
        return plan_network(net, opt.slots, replace(request, policy=policy, budget=budget), target)

    with ProgressLine(what, enabled=not args.json and sys.stderr.isatty()):
        plan = plan_for(request.policy, request.budget)
        sim = simulate(plan, target.profile)
        fit = check_fit(plan, sim.device, request.budget, plan_for)   # and, if not on the device, what would
    out = {**memory_json(plan), **fit.to_json()}
    dp = request.options.data_parallel
    if dp is not None:
        from ..memory.decisions.allreduce import allreduce_timeline

        comm = allreduce_timeline(plan, target.profile)
        out.update({"ranks": dp.world_size, "buckets": len(plan.buckets), "est_allreduce_s": comm.total_s,
                    "est_allreduce_exposed_s": comm.exposed_s,
                    "est_allreduce_hidden_fraction": comm.hidden_fraction, "interconnect_bw": comm.link.bw,
                    "est_step_time_with_allreduce_s": sim.est_step_time_s + comm.exposed_s})
    out.update({"model": args.model, "device": name, "backend": args.backend, "math": args.math,
                "est_step_time_s": sim.est_step_time_s,
                "fits_device": sim.fits_device, "planning_time_s": time.perf_counter() - t,
                "transfer_hidden_fraction": sim.transfer_hidden_fraction, "exposed_transfer_s": sim.exposed_transfer_s,
                "copy_bandwidth_bytes_per_s": sim.device.link_bw if sim.transfer_time_s else 0.0,
                "steps": len(plan.route.steps), "recompute_flops_share": sim.recompute_flops_share})
    if args.plot:
        plot_timeline(plan, args.plot, title=plot_title(args, plan), budget=request.budget)
        out["plot"] = args.plot
    if args.trace:
        write_trace(args.trace, plan, device=target.profile)
        out["trace"] = args.trace
    if args.explain is not None or args.explain_steps or args.explain_full:
        from ..memory.report.explain import parse_steps

        rng = parse_steps(args.explain_steps) if args.explain_steps else None
        text = explain(plan, select=args.explain or None, steps=rng, full=True if args.explain_full else None)
        out["explain"] = text
        if not args.json:
            print(text)
    if not args.json:
        print(memory_report(plan).format())
        print(moved_line(out["moved_bytes_by_role"]))
        print(f"  estimated step time on {name}: {sim.est_step_time_s * 1e3:.1f} ms "
              f"(planned in {out['planning_time_s']:.1f} s; math {args.math}),\n    {sim.device.model_label()}")
        if sim.transfer_time_s:
            print(f"  host transfers   {sim.transfer_time_s:.3f} s on the link, {sim.exposed_transfer_s:.3f} s exposed "
                  f"(the step waits for them), {sim.transfer_hidden_fraction:.1%} hidden behind compute")
        if dp is not None:
            print(f"  all-reduce       {out['ranks']} ranks, {out['buckets']} buckets: {out['est_allreduce_s']:.4f} s "
                  f"at {out['interconnect_bw'] / 1e9:g} GB/s, {out['est_allreduce_exposed_s']:.4f} s exposed, "
                  f"{out['est_allreduce_hidden_fraction']:.1%} hidden behind backward")
        print(fit.format())
    say_written(args, [("memory timeline", out.get("plot")), ("trace", out.get("trace"))])
    return out


def _plan_devices(args, net, opt) -> dict:
    """`minidl plan --devices N`: the pipeline and the replicas baseline (see memory/schedulers/pipeline.py)."""
    from ..memory.schedulers.pipeline import (
        OBJECTIVES,
        comparison_lines,
        least_swap_lines,
        pipeline_json,
        plan_replicas,
        search_pipeline,
    )

    batch = net.input_nodes[0].shape[0]
    if batch % args.devices:
        raise OptionError(f"--devices {args.devices}: the batch of {batch} must divide among the replicas")
    slots, device = tuple(opt.slots), args.device or "cpu"
    found = search_pipeline(net, args.devices, args.budget, device, slots, args.micro_batches)
    pipe, lean = (min(found, key=OBJECTIVES[o]) for o in ("time", "swap"))
    replica = build_net(argparse.Namespace(**{**vars(args), "batch": batch // args.devices}))
    base = plan_replicas(replica, args.devices, args.budget, device, slots)
    out = {"model": args.model, "device": device, **pipeline_json(pipe, base),
           "least_swap": pipeline_json(lean, None)}
    if not args.json:
        print("\n".join(comparison_lines(pipe, base) + least_swap_lines(lean, pipe)))
    return out


def cmd_reproduce(args) -> dict:
    """Run one paper's reproduction; progress on stderr (a full run plans hundreds of networks)."""
    from ..reproduce import reproduce

    report, written = reproduce(args.paper, args.quick, args.out,
                                log=lambda s: print(s, file=sys.stderr, flush=True))
    if not args.json:
        print(report.format_text())
        print("written: " + ", ".join(str(w) for w in written))
    return {**report.to_json(), "written": [str(w) for w in written]}
