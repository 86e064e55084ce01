"""SuperNeurons (Wang et al., PPoPP 2018) on its own setup: a 12 GB K40c (`k40c`, context reserved), float32,
momentum SGD, 3x227x227 AlexNet and 224x224 inputs otherwise.

- Table 4, the deepest ResNet at batch 16 on the paper's own family, bottleneck stages (6, 32, k, 6): each
  framework of the paper beside the minidl policy with the same mechanism (Caffe and Torch reuse nothing across
  layers, as `none`; MXNet and TensorFlow free dead tensors, as `liveness`; SuperNeurons adds offload and
  recomputation, as `auto` with the weights on the device, where SuperNeurons keeps them); then ResNet-2500.
- Table 5, the largest batch in 12 GB under `auto` without micro-batching (one batch per step, as the paper);
  then micro-batching as a column of its own: it removes the batch limit, so what it shows is bounded instead,
  the micro-batches `auto` splits 8x the paper's batch into to fit 12 GB, and that plan's simulated speed.
- Fig. 10, AlexNet at batch 200: the memory each mechanism needs, naive -> liveness -> offload -> recompute.
- In bf16 (`--math bf16`: half activations, float32 masters), Table 4's depth under `liveness` and `auto` and Table
  5's batches again: what halving the activations buys on the paper's own device (the K40c has no fast half
  arithmetic: the simulated speeds are its float32 rate's).
Every plan comes from `search.plan_on_device` (what `minidl plan --budget` does), and each row carries the
simulated step time against the in-memory step (the paper's "leading performance"), labelled as simulated.
"""
from __future__ import annotations

from ..core.errors import BudgetError
from ..memory.pool import format_bytes
from ..memory.simulate import get_profile, simulate
from ..models import build_model
from .search import largest, plan_on, plan_on_device
from .tables import Report, Row, Table, machine_meta

DEVICE = "k40c"
CITATION = ("Wang et al., \"SuperNeurons: Dynamic GPU Memory Management for Training Deep Neural Networks\", "
            "PPoPP 2018")

TABLE4 = [("Caffe", 148, "none"), ("Torch", 152, "none"), ("MXNet", 480, "liveness"),
          ("TensorFlow", 592, "liveness"), ("SuperNeurons", 1920, "auto")]
"""The paper's deepest ResNet per framework, and the minidl policy with that framework's mechanism."""

TABLE5 = [("AlexNet", "alexnet", 227, 1792), ("VGG16", "vgg16", 224, 224), ("InceptionV4", "inception_v4", 224, 240),
          ("ResNet50", "resnet50", 224, 384), ("ResNet101", "resnet101", 224, 256),
          ("ResNet152", "resnet152", 224, 176)]
"""(the paper's name, the zoo's, image size, SuperNeurons' largest batch in 12 GB)."""

MICRO_FACTOR = 8
"""Table 5's micro-batching column plans MICRO_FACTOR x the paper's batch: far beyond what fits as one batch."""

MICRO_SKIPPED = {"resnet152": "about 3 minutes"}
"""Models whose micro-batched plan takes minutes of planning at that batch: not planned, said in their row."""

FIG10 = [("naive", 2189, "none"), ("liveness", 1489, "liveness"), ("+ offload", 1132, "offload"),
         ("+ recompute", 886, "auto")]
"""AlexNet at batch 200: the paper's peak (MB) after each optimization, and the minidl policy that has it."""

MB = 2 ** 20
STAGES = (6, 32, 6)     # the family's fixed stages 1, 2 and 4: depth 3 (44 + k) + 2


def depth_of(k: int) -> int:
    return 3 * (sum(STAGES) + k) + 2


def _resnet(k: int):
    return build_model("resnet", blocks=(STAGES[0], STAGES[1], k, STAGES[2]), batch=16)


def _speed(plan, net, math: str = "fp32") -> float:
    """In-memory step time / this plan's step time, simulated: 1.0 is the speed of the same network trained with
    unlimited memory (liveness, fastest algorithms), in the same math mode."""
    free = plan_on(net, "liveness", DEVICE, math=math)
    return simulate(free, DEVICE).est_step_time_s / simulate(plan, DEVICE).est_step_time_s


def _policy_options(policy: str) -> dict:
    # SuperNeurons keeps the training state on the device and the batch whole: so does `auto` here
    return {"host_weights": False, "max_micro_batches": 1} if policy == "auto" else {}


def table4(quick: bool, log) -> Table:
    t = Table("table4", "Table 4: deepest ResNet at batch 16 in 12 GB, blocks (6, 32, k, 6)", "depth",
              note="minidl: the largest k whose plan fits (doubling, then bisection; fitting is monotone in k); "
                   "speed: the simulated step against the same network in unlimited memory.")
    found: dict[str, tuple[int, dict]] = {}
    for framework, depth, policy in TABLE4:
        if quick and policy == "auto":
            continue
        if policy not in found:
            def ok(k, policy=policy):
                plan = plan_on_device(_resnet(k), policy, DEVICE, **_policy_options(policy))
                log(f"  table 4: {policy} k={k} (ResNet-{depth_of(k)}): {'fits' if plan else 'does not fit'}")
                return plan is not None
            # auto's plans of ResNets of thousands of layers take minutes each: its depth is found to 1%
            k = largest(ok, {"none": 1, "liveness": 128, "auto": 1024}[policy], within=0.01 if policy == "auto" else 0)
            detail = {"policy": policy, "k": k}
            if k:
                net = _resnet(k)
                plan = plan_on_device(net, policy, DEVICE, **_policy_options(policy))
                detail.update(min_budget_bytes=plan.min_budget_bytes, speed_vs_in_memory=_speed(plan, net))
            found[policy] = (depth_of(k) if k else 0, detail)
        ours, detail = found[policy]
        t.rows.append(Row(f"table4/{framework.lower()}", f"{framework} / minidl `{policy}`", depth, ours,
                          differs=_table4_differs(policy, detail), quick=policy != "auto", detail=detail))
    if not quick:
        net = build_model("resnet", depth=2500, batch=16)
        plan = plan_on_device(net, "auto", DEVICE, **_policy_options("auto"))
        spare = get_profile(DEVICE).usable_bytes - plan.min_budget_bytes if plan else None
        t.rows.append(Row("table4/resnet2500", "ResNet-2500 (6, 32, 788, 6) under `auto`", "trains",
                          f"fits, {format_bytes(spare)} spare" if plan else "does not fit",
                          differs="simulated plan, not trained", detail={"spare_bytes": spare}))
    return t


def _table4_differs(policy: str, detail: dict) -> str:
    speed = detail.get("speed_vs_in_memory")
    at = f"simulated speed {speed:.0%} of in-memory" if speed else "nothing fits"
    return {"none": f"minidl `none` holds every tensor for the whole step (no reuse at all); {at}",
            "liveness": f"frees each tensor after its last use; {at}",
            "auto": f"recompute/offload/workspaces searched, weights on the device, each gradient freed at its "
                    f"layer's update (fused); depth to 1%; {at}"}[policy]


def table5(quick: bool, log) -> Table:
    t = Table("table5", "Table 5: largest batch in 12 GB", "batch",
              note="minidl: `auto` without micro-batching (one batch per step), weights on the device; the largest "
                   "batch whose plan fits the K40c's 12 GB less its CUDA context.")
    for name, model, size, paper in TABLE5:
        if quick and model != "alexnet":
            continue

        def ok(b, model=model, size=size):
            plan = plan_on_device(build_model(model, batch=b, image_size=size), "auto", DEVICE,
                                  **_policy_options("auto"))
            log(f"  table 5: {model} batch {b}: {'fits' if plan else 'does not fit'}")
            return plan is not None

        best = largest(ok, paper)
        detail: dict = {"model": model, "image_size": size}
        differs = f"{size}x{size} input"
        if best:
            net = build_model(model, batch=best, image_size=size)
            plan = plan_on_device(net, "auto", DEVICE, **_policy_options("auto"))
            detail.update(min_budget_bytes=plan.min_budget_bytes, speed_vs_in_memory=_speed(plan, net))
            differs = f"simulated speed {detail['speed_vs_in_memory']:.0%} of in-memory"
        t.rows.append(Row(f"table5/{model}", name, paper, best, differs=differs, quick=model == "alexnet",
                          detail=detail))
    return t


def table5_micro(quick: bool, log) -> Table:
    t = Table("table5micro", f"Table 5 with micro-batching: micro-batches `auto` needs for {MICRO_FACTOR}x the "
              "paper's batch in 12 GB", "micro-batches",
              note=f"minidl: micro-batching removes the batch limit (a batch fits once one micro-batch does), so "
                   f"this column is not a largest batch: it is the number of micro-batches `auto` splits "
                   f"{MICRO_FACTOR}x the paper's Table 5 batch into to fit the K40c's 12 GB less its CUDA context "
                   f"(the fastest of 2, 4, 8, ... dividing the batch, weighed by simulated step time; weights on the "
                   f"device or the host, as `auto` chooses), and the simulated speed of that plan against the same "
                   f"batch in unlimited memory. "
                   f"The paper does not micro-batch: it has no figure here.")
    for name, model, size, paper in TABLE5:
        if quick and model != "alexnet":
            continue
        batch = MICRO_FACTOR * paper
        label = f"{name} at batch {batch} ({MICRO_FACTOR}x {paper})"
        if model in MICRO_SKIPPED:
            t.rows.append(Row(f"table5micro/{model}", label, None, "not planned",
                              differs=f"not planned: its micro-batched plan at this batch takes "
                                      f"{MICRO_SKIPPED[model]} to search", detail={"model": model, "batch": batch}))
            continue
        net = build_model(model, batch=batch, image_size=size)
        plan = plan_on_device(net, "auto", DEVICE)
        log(f"  table 5, micro-batched: {model} batch {batch}: "
            + (f"{plan.route.micro_batches} micro-batches" if plan else "does not fit"))
        detail: dict = {"model": model, "image_size": size, "batch": batch}
        if plan:
            detail.update(micro_batches=plan.route.micro_batches, min_budget_bytes=plan.min_budget_bytes,
                          speed_vs_in_memory=_speed(plan, net))
            differs = (f"{batch // plan.route.micro_batches} images a micro-batch; simulated speed "
                       f"{detail['speed_vs_in_memory']:.0%} of in-memory")
        else:
            differs = "does not fit at any micro-batch count"
        t.rows.append(Row(f"table5micro/{model}", label, None, plan.route.micro_batches if plan else "does not fit",
                          differs=differs, quick=model == "alexnet", detail=detail))
    return t


def fig10(log) -> Table:
    t = Table("fig10", "Fig. 10: AlexNet (227x227) at batch 200, peak memory per optimization", "MiB",
              note="minidl: the smallest budget each policy plans in (its verified minimum; `none` and `liveness`: "
                   "their peak), MiB = 2^20 B, parameters, gradients and momentum included; speed: simulated step "
                   "against the in-memory step.")
    net = build_model("alexnet", batch=200, image_size=227)
    for label, paper, policy in FIG10:
        if policy in ("none", "liveness"):   # their peak: neither depends on a budget
            plan = plan_on(net, policy, DEVICE)
        else:
            plan = _at_minimum(net, policy)
        step = simulate(plan, DEVICE).est_step_time_s
        log(f"  fig 10: {policy}: {format_bytes(plan.min_budget_bytes)}")
        t.rows.append(Row(f"fig10/{policy}", f"{label} (`{policy}`)", paper, round(plan.min_budget_bytes / MB),
                          quick=True, detail={"policy": policy, "min_budget_bytes": plan.min_budget_bytes,
                                              "est_step_time_s": step}))
    live = next(r for r in t.rows if r.detail["policy"] == "liveness").detail["est_step_time_s"]
    for r in t.rows:
        r.detail["speed_vs_in_memory"] = live / r.detail["est_step_time_s"]
        r.differs = f"simulated speed {r.detail['speed_vs_in_memory']:.0%} of in-memory" + (
            "; recompute with offload and workspaces searched (`auto`, weights on the device)"
            if r.detail["policy"] == "auto" else "")
    return t


def _at_minimum(net, policy: str):
    """The plan of `policy` at the smallest budget it states (and verifies) for `net`."""
    opts = _policy_options(policy)
    try:
        plan_on(net, policy, DEVICE, 1, **opts)
    except BudgetError as e:
        return plan_on(net, policy, DEVICE, e.min_budget_bytes, **opts)
    raise AssertionError("a one-byte budget cannot plan")


def _deepest(policy: str, log, math: str) -> tuple[int, dict]:
    """Table 4's search: the largest k (ResNet-(3 (44 + k) + 2) at batch 16) `policy` fits in `math`."""
    def ok(k):
        plan = plan_on_device(_resnet(k), policy, DEVICE, math=math, **_policy_options(policy))
        log(f"  table 4 ({math}): {policy} k={k} (ResNet-{depth_of(k)}): {'fits' if plan else 'does not fit'}")
        return plan is not None
    # auto's plans of ResNets of thousands of layers take minutes each: its depth is found to 1%
    k = largest(ok, {"none": 1, "liveness": 128, "auto": 1024}[policy], within=0.01 if policy == "auto" else 0)
    detail = {"policy": policy, "k": k, "math": math}
    if k:
        net = _resnet(k)
        plan = plan_on_device(net, policy, DEVICE, math=math, **_policy_options(policy))
        detail.update(min_budget_bytes=plan.min_budget_bytes, speed_vs_in_memory=_speed(plan, net, math))
    return (depth_of(k) if k else 0), detail


def mixed(quick: bool, log, fp32_rows: list[Row]) -> Table:
    """Table 4's deepest ResNet and Table 5's largest batches in bf16, beside the paper's (float32) figures and
    ours in float32 (`fp32_rows`, where this run has them)."""
    t = Table("bf16", "Tables 4 and 5 in bf16 (half activations, float32 masters)", "depth or batch",
              note="minidl in bf16: activations, deltas and the weights' half copies in bf16, masters, gradients and "
                   "momentum in float32; the paper's figures are float32. Speed: simulated against the same "
                   "network in unlimited memory in bf16 (the K40c's float32 rate: it has no fast half arithmetic).")
    ours32 = {r.key: r.ours for r in fp32_rows}
    for framework, paper, policy in (("MXNet", 480, "liveness"), ("SuperNeurons", 1920, "auto")):
        if quick and policy == "auto":
            continue
        depth, detail = _deepest(policy, log, "bf16")
        was = ours32.get(f"table4/{framework.lower()}")
        speed = detail.get("speed_vs_in_memory")
        t.rows.append(Row(f"bf16/table4/{policy}", f"deepest ResNet at batch 16, `{policy}`, bf16", paper, depth,
                          quick=policy != "auto", detail={**detail, "fp32_depth": was},
                          differs=(f"{framework}'s figure (float32); ours in float32: {was}; " if was else "")
                          + (f"simulated speed {speed:.0%} of in-memory" if speed else "nothing fits")))
    for name, model, size, paper in TABLE5:
        if quick and model != "alexnet":
            continue

        def ok(b, model=model, size=size):
            plan = plan_on_device(build_model(model, batch=b, image_size=size), "auto", DEVICE, math="bf16",
                                  **_policy_options("auto"))
            log(f"  table 5 (bf16): {model} batch {b}: {'fits' if plan else 'does not fit'}")
            return plan is not None

        best = largest(ok, 2 * paper)
        was = ours32.get(f"table5/{model}")
        detail: dict = {"model": model, "image_size": size, "math": "bf16", "fp32_batch": was}
        differs = "does not fit"
        if best:
            net = build_model(model, batch=best, image_size=size)
            plan = plan_on_device(net, "auto", DEVICE, math="bf16", **_policy_options("auto"))
            detail.update(min_budget_bytes=plan.min_budget_bytes, speed_vs_in_memory=_speed(plan, net, "bf16"))
            differs = (f"ours in float32: {was}; " if was else "") + \
                f"simulated speed {detail['speed_vs_in_memory']:.0%} of in-memory"
        t.rows.append(Row(f"bf16/table5/{model}", f"{name}, largest batch in bf16", paper, best, differs=differs,
                          quick=model == "alexnet", detail=detail))
    return t


def run(quick: bool, log) -> Report:
    setup = ("Paper: a 12 GB K40c, float32, AlexNet at 3x227x227, the others at 224x224. minidl: the simulator's "
             "`k40c` profile (12 GB less its CUDA context), cuDNN's modeled workspaces, float32, SGD with momentum; "
             "every figure is a plan (what fits; step times simulated).")
    tables = [table4(quick, log), table5(quick, log), table5_micro(quick, log), fig10(log)]
    tables.append(mixed(quick, log, [r for t in tables for r in t.rows]))
    return Report("superneurons", CITATION, setup, tables, quick, {**machine_meta(), "device": DEVICE})
