"""Step time of the compiled step against the interpreter, for the plans that used to be interpreted only.

    python benchmarks/compiled_runner.py --depth 20 --batches 16,4 --image-size 32 --steps 15

Packed plans (micro-batches) and plans with compression ran on the interpreted executor until the compiled step
became a recording of the interpreter's own calls; this measures what each kind of plan gains now, on one small
net, at a batch where the kernels dominate and at one where the executor's own work (dispatch) shows: per plan, the
compiled step (what every plan runs) and the interpreted one (`compiled=False`, the debug
mode's runner, and what those plans ran before). The two executors of a plan alternate step by step, so machine
noise hits both alike; the fastest of --steps steps is reported (on a shared machine, the least disturbed one; the
JSON has the medians too), after one warm-up step each (the compiled one records
its program then). The parameters after the last step are compared bit for bit. Writes
benchmarks/results/compiled_runner.{json,md}; docs/make_results.py includes the table in docs/performance.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.executor import Executor
from minidl.runtime.session import RunConfig, Session

RESULTS = Path(__file__).resolve().parent / "results"

# (label, Session keywords): the plans measured
PLANS = [
    ("liveness", dict(policy="liveness")),
    ("micro-batches 2 (liveness)", dict(policy="liveness", micro_batches=2)),
    ("micro-batches 4 (liveness)", dict(policy="liveness", micro_batches=4)),
    ("compress", dict(policy="compress")),
    ("paged 64KiB (liveness)", dict(policy="liveness", config=RunConfig(paged="64KiB"))),
    ("weights (host update)", dict(policy="weights")),
]


def measure(net_args: dict, kw: dict, steps: int) -> dict:
    net = build_model("resnet", **net_args)
    opt = SGD(lr=0.01, momentum=0.9)
    sess = Session(net, opt, seed=0, **kw)
    runners = {"compiled": sess.executor,
               "interpreted": Executor(net, sess.plan, SGD(lr=0.01, momentum=0.9), seed=0, compiled=False)}
    rng = np.random.default_rng(0)
    x = rng.standard_normal(net.input_nodes[0].shape).astype(np.float32)
    y = rng.integers(0, net_args["num_classes"], net.input_nodes[0].shape[0]).astype(np.int64)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for i in range(steps + 1):
        for name, ex in runners.items():
            t = time.perf_counter()
            ex.train_step(x, y)
            if i:  # step 0 is the warm-up (the compiled runner records its program there)
                times[name].append(time.perf_counter() - t)
    a, b = runners["compiled"], runners["interpreted"]
    same = all(np.array_equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    return {"step_runner": a.step_runner, "interpreted_runner": b.step_runner, "route_steps": len(sess.plan.steps),
            "calls": len(a.program) if a.program is not None else None,
            "compiled_s": min(times["compiled"]), "interpreted_s": min(times["interpreted"]),
            "compiled_median_s": statistics.median(times["compiled"]),
            "interpreted_median_s": statistics.median(times["interpreted"]),
            "bit_identical": same}


def markdown(d: dict) -> str:
    rows = []
    for r in d["plans"]:
        rows.append(f"| {r['batch']} | {r['plan']} | {r['route_steps']:,} | {r['interpreted_s'] * 1e3:.1f} ms | "
                    f"{r['compiled_s'] * 1e3:.1f} ms | {r['interpreted_s'] / r['compiled_s']:.2f}x | "
                    f"{'yes' if r['bit_identical'] else 'NO'} |")
    n = d["net"]
    return (f"# Compiled against interpreted steps: resnet-{n['depth']}, {n['image_size']} px\n\n"
            f"`{d['command']}` ({d['date']}; {d['machine']}; load average {d['load_average'][0]:g} before, "
            f"{d['load_average'][1]:g} after). Fastest of {d['steps']} steps per runner (the "
            "least disturbed on a shared machine; the JSON has the medians too), the two alternating step by step "
            "after one warm-up step each. Before the compiled step became a recording of "
            "the interpreter's calls, the micro-batch and compress plans ran interpreted only.\n\n"
            "| batch | plan | route steps | interpreted | compiled | speed-up | parameters bit-identical |\n"
            "|---:|---|---:|---:|---:|---:|---|\n" + "\n".join(rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=20)
    ap.add_argument("--batches", default="16,4", help="comma-separated batch sizes, each measured")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--machine", default=f"{platform.machine()}, {os.cpu_count()} cores",
                    help="how the results file names the machine")
    ap.add_argument("--out", default=str(RESULTS / "compiled_runner"), help="results path without extension")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    load_before = os.getloadavg()[0]
    plans = []
    for batch in batches:
        net_args = dict(depth=args.depth, batch=batch, image_size=args.image_size, num_classes=10)
        for label, kw in PLANS:
            r = measure(net_args, kw, args.steps)
            plans.append({"plan": label, "batch": batch, **r})
            print(f"batch {batch}, {label}: interpreted {r['interpreted_s'] * 1e3:.1f} ms, compiled "
                  f"{r['compiled_s'] * 1e3:.1f} ms ({r['step_runner']}), bit-identical {r['bit_identical']}",
                  flush=True)
    d = {"command": f"python benchmarks/compiled_runner.py --depth {args.depth} --batches {args.batches} "
                    f"--image-size {args.image_size} --steps {args.steps}",
         "date": datetime.date.today().isoformat(), "machine": args.machine, "steps": args.steps,
         "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
         "net": {"model": "resnet", "depth": args.depth, "batches": batches, "image_size": args.image_size},
         "plans": plans}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(d, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(d))


if __name__ == "__main__":
    main()
