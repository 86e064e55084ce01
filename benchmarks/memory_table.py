"""Peak memory of one training step per policy, for the model zoo, from the planner (no compute).

    python benchmarks/memory_table.py                       # batch 32, SGD with momentum, markdown table
    python benchmarks/memory_table.py --models resnet50 --batch 16 --json out.json
    python benchmarks/memory_table.py --check --json benchmarks/results/memory_table.json \
        --md benchmarks/results/memory_table.md             # the committed results
    python benchmarks/memory_table.py --models gpt2_small --check --merge \
        --json benchmarks/results/memory_table.json --md benchmarks/results/memory_table.md
    python benchmarks/memory_table.py --models resnet50 gpt2_small --math bf16 --device v100 --check --merge \
        --json benchmarks/results/memory_table.json --md benchmarks/results/memory_table.md   # the bf16 rows

Image models run at `--batch` (default 32) and their own image size (224 px; inception_v4 299); the sequence
models (gpt2, bert) at `--seq-batch` (default 8) sequences of `--seq` tokens (default: the model's context, 1024
for GPT-2 and 512 for BERT). `--merge` replaces (or appends) only the rows measured now in the `--json` file and
rewrites `--md` from all its rows, so one row can be re-measured without re-running the others. `--math bf16|fp16`
plans in that mode (half activations, deltas and weight copies; float32 masters, gradients and optimizer state) and
`--device` a GPU profile plans its workspaces with the cuDNN model: a row not float32 on the CPU says its mode and
device (on the CPU's menu a half mode also plans the float32 copies its kernels stage, which a GPU does not need).

Columns (all bytes are exact: the plan is placed by the pool's own allocator, and the executor measures the
same peak when it runs the plan):

- none        every tensor allocated up front, never freed (a framework without memory planning)
- liveness    each tensor allocated before its first use, freed after its last (SuperNeurons' first idea)
- none/live   the ratio of the two
- recompute   liveness + cost-aware recomputation of cheap layers (peak in use)
- auto min    the smallest budget policy `auto` accepts (asked with an impossible budget: its BudgetError
              names the smallest budget that works, under the most memory-frugal combination)
- lower bound parameters + gradients + optimizer state + the largest single step's working set (with the
              smallest workspace): no schedule of this route can go below it
- min/LB      auto min / lower bound (the goal is <= 1.1)
- window min  the arena of policy `window`'s tightest window (nnabla's scheduler: only the current step's
              tensors and the parameters on the device), the minimum it states; `plan_network`'s verified
              minimum can be a little lower (see schedulers/window.py)
- arena/live  liveness plan: the arena it needs / its peak of live bytes, on the contiguous best-fit pool
              (fragmentation) and on the paged pool (`--paged`, chunk `--chunk`, default 20 MiB: the goal is
              1.00 up to chunk rounding)
- paged/rounded  the paged arena / the peak of live bytes with every tensor rounded up to whole chunks: at most
              1.00 (no fragmentation; below 1 where small tensors share chunks)

Every column but "auto min" is the plan's *peak in use*; "auto min" is an arena size, so it also pays for the
allocator's fragmentation at the binding step.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

from minidl.core.errors import BudgetError
from minidl.core.options import MATH_MODES
from minidl.memory.policies import plan_network
from minidl.memory.pool import format_bytes, parse_size
from minidl.memory.request import PlanRequest, Target
from minidl.memory.schedulers.window import window_min_budget
from minidl.models import build_model, is_sequence_model
from minidl.optim import SGD

DEVICE = "cpu"   # the profile of the table's plain rows; a row for another names it
MODELS = ["alexnet", "vgg16", "resnet50", "resnet101", "resnet152", "densenet121", "inception_v4", "gpt2_small",
          "gpt2_medium", "bert_base", "bert_large"]


def auto_minimum(net, opt, device: str, math: str = "fp32") -> int:
    """The smallest budget `auto` accepts: ask for an impossible one and read the BudgetError."""
    try:
        plan = plan_network(net, opt.slots, PlanRequest.from_options("auto", 1, math=math), Target.for_run(device))
        return plan.min_budget_bytes
    except BudgetError as e:
        return int(e.min_budget_bytes)


def row(model: str, batch: int, device: str, check: bool, chunk: int = 20 * 2**20, seq: int | None = None,
        math: str = "fp32") -> dict:
    """One model's columns. `seq`: a sequence model's tokens per sequence (None: its context length); `math` the
    math mode (a row in another mode than fp32, or for another device than `DEVICE`, records both)."""
    sequence = is_sequence_model(model)
    net = build_model(model, batch=batch, **({"seq": seq} if sequence and seq else {}))
    opt = SGD(lr=0.01, momentum=0.9)
    t = time.perf_counter()
    out = {"model": model, "batch": batch, "input": list(net.input_nodes[0].shape)}
    if sequence:
        out["seq"] = out["input"][1]
    if math != "fp32" or device != DEVICE:
        out.update(math=math, device=device)
    target = Target.for_run(device)
    for pol in ("none", "liveness", "recompute"):
        p = plan_network(net, opt.slots, PlanRequest.from_options(pol, math=math), target)
        out[pol] = p.peak_bytes
        out[f"{pol}_min_budget"] = p.min_budget_bytes
        out["lower_bound"] = p.lower_bound_bytes
    m = auto_minimum(net, opt, device, math)
    out["auto_min"] = m
    if check:  # auto at exactly that budget must plan
        p = plan_network(net, opt.slots, PlanRequest.from_options("auto", m, math=math), target)
        out["auto_min_checked"] = p.min_budget_bytes <= m
    slots = tuple(opt.slots)
    out["window_min"] = window_min_budget(net.route(training=True, optimizer_slots=slots, menu=target.menu,
                                                    math=math))
    paged = plan_network(net, opt.slots, PlanRequest.from_options("liveness", paged=chunk, math=math), target)
    out["paged_chunk"] = chunk
    out["paged_arena"] = paged.min_budget_bytes
    out["paged_live_peak"] = paged.paged.live_peak_bytes
    out["arena_over_live"] = out["liveness_min_budget"] / out["liveness"]
    out["paged_arena_over_live"] = paged.min_budget_bytes / paged.paged.live_peak_bytes
    out["paged_rounded_peak"] = paged.paged.rounded_peak_bytes
    out["paged_arena_over_rounded"] = paged.min_budget_bytes / paged.paged.rounded_peak_bytes
    out["none_over_liveness"] = out["none"] / out["liveness"]
    out["min_over_lb"] = m / out["lower_bound"]
    out["planning_s"] = time.perf_counter() - t
    return out


def label(r: dict) -> str:
    """A row's model cell: a sequence model also names its tokens per sequence, a row in another math mode than
    fp32 that mode and its device."""
    extra = [f"{r['seq']} tokens"] if "seq" in r else []
    extra += [f"{r['math']}, {r['device']}"] if "math" in r else []
    return f"{r['model']} ({', '.join(extra)})" if extra else r["model"]


def same_row(a: dict, b: dict) -> bool:
    """Whether two rows measure the same thing (a merge replaces the old one)."""
    return all(a.get(k) == b.get(k) for k in ("model", "batch", "seq", "paged_chunk", "math", "device"))


def merged(old: list[dict], new: list[dict]) -> list[dict]:
    """`old` with each row of `new` in place of the one it re-measures, or appended."""
    out = list(old)
    for r in new:
        i = next((i for i, o in enumerate(out) if same_row(o, r)), None)
        if i is None:
            out.append(r)
        else:
            out[i] = r
    return out


def caption(rows: list[dict], device: str) -> str:
    """The table's first line: what every row shares (`device`: the plain rows' profile), and the dates its rows
    were measured on."""
    dates = sorted({r["date"] for r in rows if "date" in r})
    undated = "" if all("date" in r for r in rows) else "before the rows recorded their date; "
    when = undated + (", ".join(dates) if dates else "")
    return (f"Peak bytes of one training step, SGD with momentum, float32 (a row naming a mode and a device: planned "
            f"so); image models at their image size, sequence models at the tokens shown ({when}, "
            f"{platform.machine()}, planned for profile '{device}'):")


def markdown(rows: list[dict]) -> str:
    head = ("| model | batch | none | liveness | none/live | recompute | auto min | lower bound | min/LB | window min "
            "| arena/live | paged arena/live | paged/rounded |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {label(r)} | {r['batch']} | {format_bytes(r['none'])} | {format_bytes(r['liveness'])} | "
                     f"{r['none_over_liveness']:.2f}x | {format_bytes(r['recompute'])} | "
                     f"{format_bytes(r['auto_min'])} | {format_bytes(r['lower_bound'])} | {r['min_over_lb']:.3f} | "
                     f"{format_bytes(r['window_min'])} | {r['arena_over_live']:.3f} | "
                     f"{r['paged_arena_over_live']:.3f} | {r['paged_arena_over_rounded']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=MODELS)
    ap.add_argument("--batch", type=int, default=32, help="batch of the image models (default 32)")
    ap.add_argument("--seq-batch", type=int, default=8, help="batch of the sequence models (default 8)")
    ap.add_argument("--seq", type=int, default=None,
                    help="tokens per sequence of the sequence models (default: each model's context)")
    ap.add_argument("--device", default=DEVICE, help="the profile planned for (its menu: the CPU's, or the cuDNN "
                                                      "model for a GPU) and auto's step times")
    ap.add_argument("--check", action="store_true", help="also plan auto at exactly its minimum")
    ap.add_argument("--chunk", type=parse_size, default=20 * 2**20, help="paged pool chunk (default 20MiB)")
    ap.add_argument("--math", default="fp32", choices=MATH_MODES, help="the math mode planned (default fp32)")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    ap.add_argument("--md", default=None, help="write the caption and table to this file")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of --json that this run does not re-measure (the table is rewritten whole)")
    args = ap.parse_args(argv)
    if args.merge and not args.json:
        ap.error("--merge needs --json (the file whose rows it keeps)")
    rows = []
    for m in args.models:
        seq_model = is_sequence_model(m)
        r = row(m, args.seq_batch if seq_model else args.batch, args.device, args.check, args.chunk,
                args.seq if seq_model else None, args.math)
        r["date"] = str(datetime.date.today())
        rows.append(r)
        print(f"{label(r)}: planned in {r['planning_s']:.1f} s", flush=True)
    if args.merge:
        with open(args.json) as f:
            rows = merged(json.load(f), rows)
    text = caption(rows, DEVICE) + "\n\n" + markdown(rows) + "\n"
    print("\n" + text, end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
