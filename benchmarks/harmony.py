"""Harmony across devices, in the simulator: swap volume per step of a pipeline of layer packs over 2, 4, 8 devices
of 12 GB against as many data-parallel replicas that each virtualize their own memory (policy `auto`).

    python benchmarks/harmony.py                 # wide VGG-16 (width 16), batch 32, 64 px; writes results/
    python benchmarks/harmony.py --width 4       # a smaller variant, for a quick look

The model: VGG-16's thirteen 3x3 convolutions (five stages, max-pool after each) with every stage `width` times
as wide (64w, 128w, 256w, 512w, 512w channels), ReLU after each, then global average pooling and one fully
connected layer to 1000 classes. At width 16 that is 3.77 G parameters: 15.1 GB of weights alone, more than a
12 GB device holds, with no single layer above 2.4 GB (which is what lets any plan run it at all: a layer's
weights and its gradient must fit one device together). SGD with momentum.

Device profile `harmony` (minidl/memory/simulate.py): a K40c's compute and 12 GB, with the link bandwidths
Harmony's own simulator assumes, 11.5 GiB/s host swap and 8.2 GiB/s GPU to GPU. The pipeline and the replicas
baseline are `minidl plan MODEL --devices N` (memory/schedulers/pipeline.py says what each counts). Everything
is the simulator's: no multi-device run.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import minidl as dl
from minidl.layers import Conv2d, GlobalAvgPool, Linear, MaxPool2d, ReLU, SoftmaxCrossEntropy
from minidl.memory.schedulers.pipeline import OBJECTIVES, pipeline_json, plan_replicas, search_pipeline
from minidl.memory.simulate import get_profile

OUT = Path(__file__).resolve().parent / "results"
STAGES = ((64, 64), (128, 128), (256,) * 3, (512,) * 3, (512,) * 3)   # VGG-16's configuration D


def wide_vgg16(width: int, batch: int, image_size: int = 64, num_classes: int = 1000) -> dl.Network:
    """VGG-16's convolutions at `width` x their channels, global average pooling, one classifier layer."""
    net = dl.Network(f"vgg16_w{width}")
    h = net.input((batch, 3, image_size, image_size), name="data")
    y = net.input((batch,), dtype="int64", name="label")
    for s, widths in enumerate(STAGES, start=1):
        for i, c in enumerate(widths, start=1):
            h = ReLU(name=f"relu{s}_{i}")(Conv2d(c * width, 3, padding=1, name=f"conv{s}_{i}")(h))
        h = MaxPool2d(2, stride=2, name=f"pool{s}")(h)
    h = Linear(num_classes, name="fc")(GlobalAvgPool(name="gap")(h))
    net.set_loss(SoftmaxCrossEntropy(name="loss")(h, y))
    return net


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--device", default="harmony")
    ap.add_argument("--devices", default="2,4,8")
    ap.add_argument("--out", default=str(OUT / "harmony"))
    ap.add_argument("--table-only", action="store_true", help="rewrite OUT.md from OUT.json without planning")
    args = ap.parse_args()
    if args.table_only:
        data = json.loads(Path(args.out + ".json").read_text())
        Path(args.out + ".md").write_text(table(data["meta"], data["rows"]))
        return
    prof = get_profile(args.device)
    net = wide_vgg16(args.width, args.batch, args.image_size)
    params = sum(t.nbytes for t in net.route().tensors.values() if t.role.name == "PARAMETER")
    rows = []
    for n in (int(x) for x in args.devices.split(",")):
        t = time.perf_counter()
        found = search_pipeline(net, n, None, args.device, ("momentum",))
        tp = time.perf_counter() - t
        base = plan_replicas(wide_vgg16(args.width, args.batch // n, args.image_size), n, None, args.device,
                             ("momentum",))
        for objective in OBJECTIVES:
            pipe = min(found, key=OBJECTIVES[objective])
            row = {"objective": objective, **pipeline_json(pipe, base), "candidates": len(found),
                   "planning_time_s": time.perf_counter() - t, "pipeline_search_s": tp}
            rows.append(row)
            p, b = row["pipeline"], row["replicas"]
            print(f"{n} devices, best by {objective}: pipeline host {p['host_bytes'] / 1e9:.2f} GB, device "
                  f"{p['device_bytes'] / 1e9:.3f} GB, {p['est_step_time_s']:.2f} s; replicas host "
                  f"{b['host_bytes'] / 1e9:.2f} GB, all-reduce {b['device_bytes'] / 1e9:.2f} GB, "
                  f"{b['est_step_time_s']:.2f} s  ({row['planning_time_s']:.0f} s)", flush=True)
    meta = {"model": net.name, "width": args.width, "batch": args.batch, "image_size": args.image_size,
            "parameter_bytes": params, "optimizer": "sgd momentum", "device": args.device,
            "device_memory_bytes": prof.memory_bytes, "host_link_bytes_per_s": prof.link_bw,
            "peer_link_bytes_per_s": prof.peer_bw, "date": date.today().isoformat(),
            "machine": f"{platform.node()} (2 cores, shared with other engineers' jobs; planning times only)",
            "command": "python benchmarks/harmony.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "table_only"))}
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    Path(args.out + ".md").write_text(table(meta, rows))
    print(table(meta, rows))


OBJECTIVE_WORDS = {"time": "fastest step", "swap": "least host swap"}


def _gb(x: int) -> str:
    return f"{x / 1e9:.2f}"


def table(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Harmony across devices (simulator): {meta['model']}, batch {meta['batch']}, "
             f"{meta['image_size']} px, {meta['parameter_bytes'] / 1e9:.1f} GB of weights; "
             f"{meta['device']} profile, {meta['device_memory_bytes'] / 1e9:g} GB per device",
             "",
             f"`{meta['command']}` ({meta['date']}; {meta['machine']}). Bytes per training step, all devices "
             "together; GB = 10^9 B.",
             "",
             "| devices | pipeline chosen by | M | packs (cut) | pipeline host<->device GB "
             "| pipeline device<->device GB | pipeline step s | replicas host<->device GB "
             "| replicas all-reduce GB | replicas step s | host swap: replicas / pipeline "
             "| (host + device) bytes: replicas / pipeline | step time: replicas / pipeline |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p, b = r["pipeline"], r["replicas"]
        ratio = f"{b['host_bytes'] / p['host_bytes']:.1f}x" if p["host_bytes"] else "no host swap"
        both = (b["host_bytes"] + b["device_bytes"]) / max(1, p["host_bytes"] + p["device_bytes"])
        lines.append(f"| {r['devices']} | {OBJECTIVE_WORDS[r['objective']]} | {r['micro_batches']} | "
                     f"{len(r['packs'])} ({r['cut']}) | {_gb(p['host_bytes'])} | {_gb(p['device_bytes'])} | "
                     f"{p['est_step_time_s']:.2f} | {_gb(b['host_bytes'])} | {_gb(b['device_bytes'])} | "
                     f"{b['est_step_time_s']:.2f} | {ratio} | {both:.1f}x | "
                     f"{b['est_step_time_s'] / p['est_step_time_s']:.2f}x |")
    lines.append("")
    lines.append("Per device (pipeline): peak bytes and whether its packs' weights stay resident or are swapped "
                 "per pack:")
    lines.append("")
    for r in rows:
        lines.append(f"- {r['devices']} devices, {OBJECTIVE_WORDS[r['objective']]}: " + "; ".join(
            f"device {d['device']} peak {d['peak_bytes'] / 1e9:.2f} GB, "
            + (f"weights of {d['homed_layers']} of {d['candidate_layers']} layers swapped" if d["weights_homed"]
               else "weights resident") for d in r["per_device"]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
