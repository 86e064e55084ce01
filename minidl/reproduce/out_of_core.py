"""Out-of-core training with adaptive window-based scheduling (Hayakawa & Narihira, 2020; nnabla) on its own
setup: ResNet-50 at 224x224 on a 16 GB V100 (`v100`, context reserved), float32, momentum SGD, weights on device.

N0, the in-memory limit, is the largest batch whose `liveness` plan (no budget: every convolution on its fastest
algorithm, nothing moved) fits the device: the batch that trains in memory at full speed. Batches of 2x to 7.5x N0
are then planned under `window` (nnabla's schedule) and `auto` (minidl's search) within the same memory, by
`search.plan_on_device` (what `minidl plan --budget` does), and their simulated images/s are compared with N0's in
memory, the paper's "55% of in-memory speed". Each policy's largest batch is bisected to 1% from the largest batch
the policies before it reached, where it plans too (`auto` plans wherever `window` does, at least as fast).

In bf16 (`--math bf16`: half activations, float32 masters) the same questions again (`mixed`): N0 in bf16, the
largest batch under each policy, and the speed at 7.5x the fp32 N0 (the paper's batch) and at 7.5x bf16's own N0,
against the in-memory speed in bf16 (the profile's tensor-core rate: `DeviceProfile.half_flops`) and in fp32.

The paper's result figure also plots DenseNet (about 1150 images a batch against about 510 in memory, at about
80% of in-memory speed): the same three figures (N0, the largest batch under `window` and under `auto`, the speed)
for the zoo's DenseNet-121 (the figure does not say which DenseNet; 121 is the most common).
"""
from __future__ import annotations

from ..memory.simulate import get_profile, simulate
from ..models import build_model
from .search import largest, plan_on, plan_on_device
from .tables import Report, Row, Table, machine_meta

DEVICE = "v100"
CITATION = ("Hayakawa & Narihira, \"Out-of-core Training for Extremely Large-Scale Neural Networks With Adaptive "
            "Window-Based Scheduling\", 2020 (nnabla)")
PAPER_BATCH, PAPER_MULTIPLE, PAPER_SPEED = 1440, 7.5, 0.55
POLICIES = ("window", "auto")
FACTORS = (2, 3, 4, 5, 6, 7, 7.5)
QUICK_FACTORS = (2,)
DENSENET_DEPTH = 121
DENSENET_N0, DENSENET_BATCH, DENSENET_SPEED = 510, 1150, 0.80   # read off the paper's figure: approximate


def _net(batch: int):
    return build_model("resnet", depth=50, batch=batch, image_size=224)


def _densenet(batch: int):
    return build_model("densenet", depth=DENSENET_DEPTH, batch=batch, image_size=224)


def _in_memory(batch: int, build=_net, math: str = "fp32"):
    """The plan of `batch` in unlimited memory (liveness, fastest algorithms), whose arena the device must hold."""
    return plan_on(build(batch), "liveness", DEVICE, math=math)


def _out_of_core(batch: int, policy: str, build=_net, math: str = "fp32"):
    # nnabla keeps parameters on the device and runs the batch whole: so does `auto` here
    return plan_on_device(build(batch), policy, DEVICE, host_weights=False, max_micro_batches=1, math=math)


def _n0(math: str, log, build=_net, start: int = 128) -> tuple[int, float]:
    """The in-memory limit N0 in `math` and its simulated images/s."""
    usable = get_profile(DEVICE).usable_bytes

    def in_memory(b: int) -> bool:
        fits = _in_memory(b, build, math).min_budget_bytes <= usable
        log(f"  {math} in memory: batch {b}: {'fits' if fits else 'does not fit'}")
        return fits

    n0 = largest(in_memory, start)
    return n0, n0 / simulate(_in_memory(n0, build, math), DEVICE).est_step_time_s


def _largest_out_of_core(pol: str, lo: int, log, math: str = "fp32") -> int:
    """The largest ResNet-50 batch `pol` plans within the device in `math`, from `lo` (which fits), to 1%."""
    return largest(lambda b: _out_of_core(b, pol, math=math) is not None, round(lo * 1.25), lo=lo, within=0.01)


def mixed(quick: bool, log, n0_fp32: int, base_fp32: float) -> Table:
    """ResNet-50 beyond the in-memory batch in bf16 (see the module doc)."""
    n0, base = _n0("bf16", log, start=2 * n0_fp32)
    t = Table("bf16", "ResNet-50 beyond the in-memory batch, bf16", "batch",
              note="bf16: half activations, deltas and weight copies, float32 masters and optimizer state; speed: "
                   "simulated images/s against N0's in memory in bf16 (and in fp32, where said), products at the "
                   "v100's fp16 tensor-core rate (Volta has no bf16 arithmetic).")
    t.rows.append(Row("bf16/n0", "in-memory limit N0, bf16", None, n0, quick=True,
                      differs=f"the paper has no bf16 run; {n0 / n0_fp32:.2f}x our fp32 N0 ({n0_fp32})",
                      detail={"images_per_s": base, "fp32_n0": n0_fp32, "fp32_images_per_s": base_fp32}))
    factors = ((PAPER_MULTIPLE, n0_fp32, "fp32"),) if quick else ((PAPER_MULTIPLE, n0_fp32, "fp32"),
                                                                   (PAPER_MULTIPLE, n0, "bf16"))
    for f, ref, whose in factors:
        b = round(f * ref)
        for pol in POLICIES:
            plan = _out_of_core(b, pol, math="bf16")
            sim = simulate(plan, DEVICE) if plan else None
            speed = b / sim.est_step_time_s / base if plan else None
            log(f"  bf16 {pol} batch {b}: " + (f"{speed:.0%} of bf16 in-memory speed" if plan else "does not fit"))
            detail = {"batch": b, "policy": pol, "fits": plan is not None, "of_n0": whose}
            differs = "does not fit"
            if plan:
                vs32 = b / sim.est_step_time_s / base_fp32
                detail.update(relative_speed=speed, relative_speed_fp32=vs32, est_step_time_s=sim.est_step_time_s,
                              exposed_transfer_s=sim.exposed_transfer_s,
                              moved_bytes=plan.offloaded_bytes + plan.prefetched_bytes)
                differs = (f"{vs32:.0%} of fp32's in-memory speed; {sim.exposed_transfer_s:.1f} s of the "
                           f"{sim.est_step_time_s:.1f} s step waiting for "
                           f"{(plan.offloaded_bytes + plan.prefetched_bytes) / 1e9:.0f} GB of copies")
            t.rows.append(Row(f"bf16/{whose}/{pol}", f"7.5x {whose} N0 = {b} in bf16, `{pol}` (% of bf16 "
                                                     f"in-memory speed)", f"{PAPER_SPEED:.0%}",
                              f"{speed:.0%}" if plan else "does not fit", quick=whose == "fp32",
                              differs=differs, detail=detail))
    if not quick:
        for pol in POLICIES:
            best = _largest_out_of_core(pol, n0, log, "bf16")
            plan = _out_of_core(best, pol, math="bf16")
            sim = simulate(plan, DEVICE)
            speed = best / sim.est_step_time_s / base
            t.rows.append(Row(f"bf16/limit/{pol}", f"largest batch in bf16, `{pol}`", PAPER_BATCH, best,
                              differs=f"{best / n0:.2f}x bf16's N0, {best / n0_fp32:.2f}x fp32's, at {speed:.0%} of "
                                      f"bf16's in-memory speed, simulated",
                              detail={"multiple": best / n0, "multiple_fp32": best / n0_fp32,
                                      "relative_speed": speed, "to_within": "1%",
                                      "est_step_time_s": sim.est_step_time_s}))
    return t


def densenet(quick: bool, log) -> Table:
    """DenseNet-121 beyond its in-memory batch: N0, and (full run) the largest batch under each policy to 1%."""
    usable = get_profile(DEVICE).usable_bytes

    def in_memory(b: int) -> bool:
        fits = _in_memory(b, _densenet).min_budget_bytes <= usable
        log(f"  densenet in memory: batch {b}: {'fits' if fits else 'does not fit'}")
        return fits

    n0 = largest(in_memory, 64)
    base = n0 / simulate(_in_memory(n0, _densenet), DEVICE).est_step_time_s
    t = Table("densenet", f"DenseNet-{DENSENET_DEPTH} beyond the in-memory batch", "batch",
              note="the paper's DenseNet figures are read off its result figure (approximate); speed: simulated "
                   "images/s against N0's in memory.")
    t.rows.append(Row("densenet/n0", "DenseNet in-memory limit N0", DENSENET_N0, n0, quick=True,
                      differs=f"DenseNet-{DENSENET_DEPTH} at 224x224 (the paper's figure does not name the "
                              f"variant)",
                      detail={"images_per_s": base}))
    if quick:
        return t
    found = n0
    for pol in POLICIES:
        def fits(b: int, pol=pol) -> bool:
            ok = _out_of_core(b, pol, _densenet) is not None
            log(f"  densenet {pol} batch {b}: {'fits' if ok else 'does not fit'}")
            return ok

        # from the largest batch a policy before it reached (`auto` plans wherever `window` does)
        best = largest(fits, 2 * found, lo=found, within=0.01) or largest(fits, 2 * n0, lo=n0, within=0.01)
        found = max(found, best)
        detail: dict = {"policy": pol, "to_within": "1%"}
        differs = "does not fit even at N0"
        if best:
            plan = _out_of_core(best, pol, _densenet)
            sim = simulate(plan, DEVICE)
            speed = best / sim.est_step_time_s / base
            detail.update(multiple=best / n0, relative_speed=speed, est_step_time_s=sim.est_step_time_s,
                          moved_bytes=plan.offloaded_bytes + plan.prefetched_bytes)
            differs = (f"{best / n0:.2f}x N0 (paper about {DENSENET_BATCH / DENSENET_N0:.2f}x) at {speed:.0%} of "
                       f"in-memory speed (paper about {DENSENET_SPEED:.0%}), simulated")
        t.rows.append(Row(f"densenet/{pol}", f"DenseNet largest batch, `{pol}`", DENSENET_BATCH, best,
                          differs=differs, detail=detail))
    return t


def run(quick: bool, log) -> Report:
    usable = get_profile(DEVICE).usable_bytes

    def in_memory(b: int) -> bool:
        fits = _in_memory(b).min_budget_bytes <= usable
        log(f"  in memory: batch {b}: {'fits' if fits else 'does not fit'}")
        return fits

    n0 = largest(in_memory, 128)
    base = n0 / simulate(_in_memory(n0), DEVICE).est_step_time_s      # images/s in memory
    head = Table("limit", "ResNet-50 beyond the in-memory batch", "batch",
                 note="speed: simulated images/s against N0's in memory.")
    head.rows.append(Row("limit/n0", "in-memory limit N0", round(PAPER_BATCH / PAPER_MULTIPLE), n0,
                         differs="the paper gives 1440 = 7.5x N0 (so N0 about 192), not N0 itself", quick=True,
                         detail={"images_per_s": base}))
    curve = Table("curve", "Speed at each multiple of N0", "% of in-memory speed",
                  note="speed: simulated images/s of the plan against N0 trained in memory.")
    fitted: dict[str, list[int]] = {p: [n0] for p in POLICIES}
    failed: dict[str, list[int]] = {p: [] for p in POLICIES}
    for f in (QUICK_FACTORS if quick else FACTORS):
        for pol in POLICIES:
            b = round(f * n0)
            plan = _out_of_core(b, pol)
            (fitted if plan else failed)[pol].append(b)
            speed = b / simulate(plan, DEVICE).est_step_time_s / base if plan else None
            log(f"  {pol} batch {b} ({f}x): " + (f"{speed:.0%} of in-memory speed" if plan else "does not fit"))
            t = simulate(plan, DEVICE) if plan else None
            curve.rows.append(Row(f"curve/{pol}/{f}", f"{f}x N0 = {b}, `{pol}`",
                                  f"{PAPER_SPEED:.0%}" if f == PAPER_MULTIPLE else None,
                                  f"{speed:.0%}" if plan else "does not fit", quick=f in QUICK_FACTORS,
                                  differs="" if f == PAPER_MULTIPLE else "the paper reports the speed at 7.5x only",
                                  detail={"batch": b, "factor": f, "policy": pol, "fits": plan is not None,
                                          **({"relative_speed": speed, "exposed_transfer_s": t.exposed_transfer_s,
                                              "moved_bytes": plan.offloaded_bytes + plan.prefetched_bytes}
                                             if plan else {})}))
    if not quick:
        reached = n0
        for pol in POLICIES:
            lo = max(fitted[pol])
            hi = min(failed[pol], default=None)
            # from the largest batch a policy before it reached, where it plans too (`auto` wherever `window` does)
            if lo < reached and (hi is None or reached < hi) and _out_of_core(reached, pol):
                lo = reached
            while hi is None:        # it fits beyond the last multiple: a quarter more until it does not
                b = round(lo * 1.25)
                if _out_of_core(b, pol):
                    lo = b
                else:
                    hi = b
                log(f"  {pol} batch {b}: {'fits' if hi is None else 'does not fit'}")
            while hi - lo > max(1, lo // 100):   # to 1%: each plan takes seconds
                mid = (lo + hi) // 2
                if _out_of_core(mid, pol):
                    lo = mid
                else:
                    hi = mid
            reached = max(reached, lo)
            plan = _out_of_core(lo, pol)
            sim = simulate(plan, DEVICE)
            speed = lo / sim.est_step_time_s / base
            moved = plan.offloaded_bytes + plan.prefetched_bytes
            # why the speed falls short, where it does: the copies the link cannot hide behind compute
            head.rows.append(Row(f"limit/{pol}", f"largest batch, `{pol}`", PAPER_BATCH, lo,
                                 differs=f"{lo / n0:.2f}x N0 (paper 7.5x) at {speed:.0%} of in-memory speed "
                                         f"(paper 55%), simulated: {moved / 1e9:.0f} GB copied a step over the "
                                         f"{sim.device.link_bw / 1e9:g} GB/s link, {sim.exposed_transfer_s:.1f} s "
                                         f"of the {sim.est_step_time_s:.1f} s step waiting for copies",
                                 detail={"multiple": lo / n0, "relative_speed": speed, "to_within": "1%",
                                         "moved_bytes": moved, "link_bytes_per_s": sim.device.link_bw,
                                         "est_step_time_s": sim.est_step_time_s,
                                         "exposed_transfer_s": sim.exposed_transfer_s}))
    setup = ("Paper: ResNet-50 on a 16 GB V100. minidl: the simulator's `v100` profile (16 GB less its CUDA "
             "context), cuDNN's modeled workspaces, float32, SGD with momentum, parameters on the device, no "
             "micro-batching; step times simulated (compute roofline, host copies over the profile's link). The "
             "paper's precision is not stated in the sources we have; ours is float32.")
    return Report("out-of-core", CITATION, setup, [head, curve, densenet(quick, log), mixed(quick, log, n0, base)],
                  quick, {**machine_meta(), "device": DEVICE, "n0": n0})
