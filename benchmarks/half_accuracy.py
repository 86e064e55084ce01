"""Does training in bf16 or fp16 reach what float32 reaches? ResNet-20 on the digits and a small GPT-2 on the
Python standard library's text, each mode over the same seeds (initialization, data order: the runs of one seed
differ by their arithmetic alone).

    python benchmarks/half_accuracy.py                       # writes benchmarks/results/half_accuracy.{json,md}
    python benchmarks/half_accuracy.py --seeds 0 --resnet-steps 100 --gpt2-steps 50 --json /tmp/a.json

The goals (the mixed-precision issue): held-out accuracy within 0.5 points of float32's, held-out loss within 2%,
both as the mean over seeds; each mode's spread over seeds is reported beside it (the float32 runs' own spread is
what a difference is measured against).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

from minidl.data import digits
from minidl.data.text import sequences, stdlib_corpus
from minidl.models import build_model
from minidl.optim import SGD, Adam
from minidl.optim.schedules import Cosine
from minidl.runtime.session import Session

MODES = ("fp32", "bf16", "fp16")
GOAL_ACCURACY_POINTS = 0.5   # held-out accuracy: within this many points of float32's (mean over seeds)
GOAL_LOSS_SHARE = 0.02       # held-out loss: within 2% of float32's (mean over seeds)
RESNET = dict(batch=32, lr=0.05, steps=500)
GPT2 = dict(layers=2, heads=4, width=128, seq=64, batch=16, lr=3e-3, steps=300, heldout=128)


def resnet20(mode: str, seed: int, steps: int) -> dict:
    """ResNet-20 on the 8x8 digits, SGD with momentum and a cosine schedule: held-out accuracy and loss."""
    train, held = digits().split(0.2, seed=0)
    net = build_model("resnet", depth=20, batch=RESNET["batch"], image_size=8, in_channels=1, num_classes=10)
    sess = Session(net, SGD(lr=RESNET["lr"], momentum=0.9, weight_decay=1e-4), seed=seed, math=mode,
                   lr_schedule=Cosine(steps))
    t = time.perf_counter()
    r = sess.fit(train, steps, progress=False)
    loss, acc = sess.evaluate(held)
    return {"accuracy": acc, "loss": loss, "train_loss": r.final_loss, "s": time.perf_counter() - t}


def gpt2(mode: str, seed: int, steps: int) -> dict:
    """A small GPT-2 (byte vocabulary) on the standard library's text, Adam: held-out loss per token."""
    tokens, name = stdlib_corpus()
    train, held = sequences(tokens, GPT2["seq"], name=name)
    held.x, held.y = held.x[:GPT2["heldout"]], held.y[:GPT2["heldout"]]
    net = build_model("gpt2", layers=GPT2["layers"], heads=GPT2["heads"], width=GPT2["width"], seq=GPT2["seq"],
                      batch=GPT2["batch"], num_classes=train.num_classes, dropout=0.0)
    sess = Session(net, Adam(lr=GPT2["lr"]), seed=seed, math=mode, lr_schedule=Cosine(steps))
    t = time.perf_counter()
    r = sess.fit(train, steps, progress=False)
    loss, acc = sess.evaluate(held)
    return {"accuracy": acc, "loss": loss, "train_loss": r.final_loss, "s": time.perf_counter() - t}


def summary(runs: dict[str, list[dict]], field: str) -> dict[str, dict]:
    """Per mode: mean and spread (sample standard deviation, min, max) of `field` over seeds, and the mean of the
    paired differences from float32 (the same seed)."""
    out = {}
    for mode, rs in runs.items():
        v = [r[field] for r in rs]
        d = [r[field] - b[field] for r, b in zip(rs, runs["fp32"])]
        out[mode] = {"mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0,
                     "min": min(v), "max": max(v), "diff_vs_fp32": statistics.fmean(d)}
    return out


def markdown(result: dict) -> str:
    lines = [f"Training in bf16 and fp16 against float32, same seeds ({', '.join(map(str, result['seeds']))}), "
             f"{result['date']}, {result['machine']} (CPU backend):", ""]
    for task, field in (("resnet20", "accuracy"), ("gpt2", "loss")):
        s, cfg = result[task]["summary"], result[task]["config"]
        what = ("ResNet-20 on the 8x8 digits, held-out accuracy" if task == "resnet20" else
                f"GPT-2 ({cfg['layers']} layers, width {cfg['width']}, {cfg['seq']} tokens) on the standard "
                f"library's text, held-out loss per token")
        lines += [f"**{what}** ({cfg['steps']} steps at batch {cfg['batch']})", "",
                  "| mode | mean | spread (std, min-max) | mean difference from fp32 | goal |",
                  "|---|---:|---:|---:|---|"]
        for mode, m in s.items():
            if field == "accuracy":
                cells = (f"{100 * m['mean']:.2f}%", f"{100 * m['std']:.2f} ({100 * m['min']:.2f}-{100 * m['max']:.2f})",
                         f"{100 * m['diff_vs_fp32']:+.2f} points")
                ok = abs(100 * m["diff_vs_fp32"]) <= GOAL_ACCURACY_POINTS
                goal = f"within {GOAL_ACCURACY_POINTS} points: {'met' if ok else 'not met'}"
            else:
                share = m["diff_vs_fp32"] / s["fp32"]["mean"]
                cells = (f"{m['mean']:.4f}", f"{m['std']:.4f} ({m['min']:.4f}-{m['max']:.4f})", f"{100 * share:+.2f}%")
                ok = abs(share) <= GOAL_LOSS_SHARE
                goal = f"within {100 * GOAL_LOSS_SHARE:.0f}%: {'met' if ok else 'not met'}"
            lines.append(f"| {mode} | {' | '.join(cells)} | {'-' if mode == 'fp32' else goal} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2, 3, 4])
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    ap.add_argument("--resnet-steps", type=int, default=RESNET["steps"])
    ap.add_argument("--gpt2-steps", type=int, default=GPT2["steps"])
    ap.add_argument("--json", default="benchmarks/results/half_accuracy.json")
    ap.add_argument("--md", default=None, help="default: the --json path with .md")
    args = ap.parse_args(argv)
    if "fp32" not in args.modes:
        ap.error("--modes must include fp32 (the reference)")
    result = {"date": str(datetime.date.today()), "machine": f"{platform.machine()}, shared CPU",
              "seeds": args.seeds}
    for task, fn, steps, cfg in (("resnet20", resnet20, args.resnet_steps, RESNET), ("gpt2", gpt2, args.gpt2_steps,
                                                                                      GPT2)):
        runs = {m: [] for m in args.modes}
        for seed in args.seeds:
            for mode in args.modes:
                runs[mode].append(fn(mode, seed, steps))
                r = runs[mode][-1]
                print(f"{task} seed {seed} {mode}: accuracy {r['accuracy']:.4f}, loss {r['loss']:.4f} "
                      f"({r['s']:.0f} s)", flush=True)
        result[task] = {"config": {**cfg, "steps": steps}, "runs": runs,
                        "summary": summary(runs, "accuracy" if task == "resnet20" else "loss")}
    text = markdown(result)
    print("\n" + text)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    Path(args.md or str(Path(args.json).with_suffix(".md"))).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
