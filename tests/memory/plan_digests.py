"""Digests of the zoo's plans under every policy: a change to how plans are asked for must not change a plan.

Each case plans one small zoo network under one policy, budget and set of options, on the CPU's menu or the
k40c's (the cuDNN model), and reduces the plan to a digest of every event (kind, step, tensor, bytes, offset),
every step's algorithm, workspace and bytes in use, and the plan's figures; a case that does not fit its budget
digests its error (type, stated minimum). `python -m tests.memory.plan_digests` writes them to
tests/memory/plan_digests.json; tests/memory/test_plan_digests.py plans them again and compares.

Budgets are shares of the network's liveness minimum, tight enough that offload, recompute, packs, window and
auto act."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from minidl.core.errors import MinidlError
from minidl.memory.decisions.allreduce import DataParallel
from minidl.memory.request import Target
from minidl.models import build_model
from minidl.optim import SGD, Adam
from tests.planning import planned

PATH = Path(__file__).with_name("plan_digests.json")

NETS = {
    "lenet": lambda: build_model("lenet", batch=8),
    "resnet20": lambda: build_model("resnet", depth=20, batch=4, image_size=16, num_classes=10),
    "resnet56": lambda: build_model("resnet", depth=56, batch=2, image_size=16, num_classes=10),
    "vgg11": lambda: build_model("vgg11", batch=2, image_size=224, num_classes=10),
    "densenet_tiny": lambda: build_model("densenet_tiny", batch=4, image_size=16),
    "inception_v4": lambda: build_model("inception_v4", batch=4, image_size=75, num_classes=10),
    "gpt2_tiny": lambda: build_model("gpt2", layers=2, heads=2, width=32, seq=16, batch=4, num_classes=64),
    "bert_tiny": lambda: build_model("bert", layers=2, heads=2, width=32, seq=16, batch=4, num_classes=64),
}

# (policy, share of the liveness minimum as the budget (None: no budget), options)
CASES = [
    ("none", None, {}),
    ("liveness", None, {}),
    ("liveness", None, {"fused_update": True}),
    ("liveness", None, {"micro_batches": 2}),
    ("liveness", None, {"paged": 4096}),
    ("liveness", None, {"data_parallel": (2, 1 << 14, "ring")}),
    ("offload", 0.97, {}),
    ("recompute", None, {}),
    ("recompute", 0.98, {}),
    ("weights", 0.6, {}),
    ("compress", None, {}),
    ("packs", 0.6, {}),
    ("packs", None, {"micro_batches": 2}),
    ("window", 0.85, {}),
    ("window", 0.85, {"data_parallel": (2, 1 << 14, "ring")}),   # gradient buckets among the window's swaps
    ("auto", None, {}),
    ("auto", 0.6, {}),
    ("auto", 0.8, {"fused_update": False}),
    ("auto", 0.35, {}),
    ("auto", 0.7, {"max_micro_batches": 1, "host_weights": False}),
    ("auto", 0.7, {"paged": 4096}),
    ("auto-lossy", 0.5, {}),
]
# the k40c's menu (cuDNN's modeled workspaces) and timing: the policies whose choices read them
GPU_CASES = [("liveness", None, {}), ("offload", 0.97, {}), ("auto", 0.6, {}), ("auto", 0.35, {}),
             ("window", 0.85, {})]
# the deep networks (hundreds of steps): fewer cases, each of the mechanisms once
DEEP_CASES = [("none", None, {}), ("liveness", None, {}), ("liveness", None, {"micro_batches": 2}),
              ("offload", 0.97, {}), ("recompute", None, {}), ("packs", None, {"micro_batches": 2}),
              ("auto", 0.6, {}), ("auto-lossy", 0.5, {})]
DEEP = ("resnet56", "vgg11", "inception_v4")


def cases(net_key: str) -> dict:
    """device -> the cases planned for `net_key` on it."""
    if net_key in DEEP:
        return {"cpu": DEEP_CASES, "k40c": GPU_CASES[:3]}
    return {"cpu": CASES, "k40c": GPU_CASES}


def optimizer(net_key: str):
    return Adam() if net_key.startswith(("gpt2", "bert")) else SGD(lr=0.1, momentum=0.9, weight_decay=1e-4)


def digest(p) -> dict:
    """The plan reduced to what a change of its caller must not change."""
    h = hashlib.sha256()

    def put(*items):
        h.update(repr(items).encode())

    for ev in p.setup:
        put("setup", ev.kind.value, ev.tensor, ev.offset, ev.nbytes)
    for k, sp in enumerate(p.steps):
        put("step", k, sp.algo, sp.workspace_bytes, sp.in_use, sp.on_host)
        for where, evs in (("before", sp.before), ("after", sp.after)):
            for ev in evs:
                put(where, ev.kind.value, ev.tensor, ev.offset, ev.nbytes)
    route = p.route
    put("route", [(s.label, s.reads, s.writes, s.workspace) for s in route.steps], route.fused_update,
        route.micro_batches, route.backend_name)
    put("buckets", sorted(p.buckets.items()))
    return {"events": h.hexdigest()[:20], "peak": p.peak_bytes, "min_budget": p.min_budget_bytes,
            "arena": p.arena_bytes, "lower_bound": p.lower_bound_bytes, "offloaded": p.offloaded_bytes,
            "fused": route.fused_update, "micro_batches": route.micro_batches,
            "paged": None if p.paged is None else [p.paged.chunk_bytes, p.paged.live_peak_bytes]}


def options(opts: dict) -> dict:
    out = dict(opts)
    if "data_parallel" in out:
        out["data_parallel"] = DataParallel(*out["data_parallel"])
    return out


def case_name(net_key, device, policy, share, opts) -> str:
    extra = ",".join(f"{k}={v}" for k, v in sorted(opts.items()))
    return f"{net_key}/{device}/{policy}/{share}" + (f"/{extra}" if extra else "")


def run_case(net_key, device, policy, share, opts, live_min) -> dict:
    budget = None if share is None else int(live_min * share)
    try:
        return digest(planned(NETS[net_key](), optimizer(net_key), policy, budget, device,
                              menu=Target.for_run(device).menu, **options(opts)))
    except MinidlError as e:
        return {"error": type(e).__name__, "min_budget": getattr(e, "min_budget_bytes", None)}


def all_digests(nets=None, log=None) -> dict:
    out = {}
    for net_key in nets or NETS:
        for device, listed in cases(net_key).items():
            live_min = planned(NETS[net_key](), optimizer(net_key), "liveness", None, device,
                               menu=Target.for_run(device).menu).min_budget_bytes
            for policy, share, opts in listed:
                name = case_name(net_key, device, policy, share, opts)
                out[name] = run_case(net_key, device, policy, share, opts, live_min)
                if log:
                    log(f"{name}: {out[name]}")
    return out


# `minidl plan` runs: the command line's own defaults (policy, device, menu, fused update, the fit verdict)
CLI = [
    "resnet --depth 20 --batch 4 --image-size 16",
    "resnet --depth 20 --batch 4 --image-size 16 --budget 1MiB",
    "resnet --depth 20 --batch 4 --image-size 16 --device cpu --budget 1MiB",
    "resnet --depth 20 --batch 4 --image-size 16 --policy packs --budget 1200KiB",
    "resnet --depth 20 --batch 4 --image-size 16 --policy offload --budget 4MiB --device k40c:3MiB",
    "resnet --depth 20 --batch 4 --image-size 16 --device k40c:900KiB",
    "resnet --depth 20 --batch 4 --image-size 16 --ranks 2 --fused-update off --device cpu",
    "resnet --depth 20 --batch 4 --image-size 16 --paged --budget 2MiB --device cpu",
    "lenet --batch 8 --policy window --budget 1100KiB --device v100",
    "gpt2 --layers 2 --heads 2 --width 32 --seq 16 --batch 4 --num-classes 64 --budget 2MiB --micro-batches 2",
]
CLI_VOLATILE = ("planning_time_s",)


def cli_digest(argv: str) -> dict:
    """`minidl plan ARGV --json`'s object, without its timing."""
    import contextlib
    import io

    from minidl.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["plan", *argv.split(), "--json"])
    out = json.loads(buf.getvalue())
    return {k: v for k, v in sorted(out.items()) if k not in CLI_VOLATILE}


def main() -> None:
    out = all_digests(log=lambda s: print(s, file=sys.stderr, flush=True))
    out.update({f"cli/{argv}": cli_digest(argv) for argv in CLI})
    PATH.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{len(out)} plans digested into {PATH}")


if __name__ == "__main__":
    main()
