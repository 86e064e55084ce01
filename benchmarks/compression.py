"""COMET-style compression of stored activations: ratios, memory, codec time, gradient error, accuracy.

    .venv/bin/python benchmarks/compression.py                 # everything (a few minutes on 2 shared cores)
    .venv/bin/python benchmarks/compression.py --skip-accuracy --nets resnet20

For each net (CIFAR shapes; ImageNet ResNet-50 at 64x64; VGG-11 at 224x224, the
only size the zoo's VGG takes): one step with policy `compress` planned with the default
ratio, the measured ratios handed to a second plan (`plan_compress(ratios=...)`), a second step on it. Reported:
compression ratio of the stored activations per producing layer type, bytes stored for backward (the compressed
tensors raw vs their streams), peak memory of `none`, `liveness` and `compress` (plan peak = pool peak), codec
time against the step time, spills. Then, on ResNet-20: the relative weight-gradient error of one step against
the exact one, per target rho* of the adaptive bound (errorbound.py), after a few steps of adaptation. Then the
accuracy run: ResNet-20 on digits with `none` and with `compress`, same seed and steps (SGD 0.05, momentum
0.9, cosine decay to 0); held-out accuracy and
the loss curves side by side (benchmarks/results/compression_loss.png). Results: benchmarks/results/compression.json.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from minidl.data import BatchIterator, digits
from minidl.memory.compressed import CompressedStore
from minidl.memory.decisions.compress import backward_readers, compressed_tensors, plan_compress
from minidl.memory.errorbound import ErrorBoundRule
from minidl.memory.policies import plan_network
from minidl.memory.request import PlanRequest, Target
from minidl.memory.simulate import get_profile
from minidl.models import build_model
from minidl.optim import SGD
from minidl.optim.schedules import Cosine
from minidl.runtime.executor import Executor

CPU = Target.for_run()   # the CPU profile and menu every plan here is for, but the budget sweep's devices

RESULTS = Path(__file__).resolve().parent / "results"

NETS = {
    "resnet20": dict(name="resnet", depth=20, batch=2, image_size=32, num_classes=10),
    "resnet56": dict(name="resnet", depth=56, batch=2, image_size=32, num_classes=10),
    "vgg11": dict(name="vgg11", batch=1, image_size=224, num_classes=10),   # the zoo's VGG is ImageNet-shaped
    "resnet50": dict(name="resnet", depth=50, batch=2, image_size=64, num_classes=100, variant="imagenet"),
}


def _batch(net, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(net.input_nodes[0].shape).astype(np.float32)
    y = rng.integers(0, 10, net.input_nodes[1].shape)
    return x, y


def _store(ex, target):
    readers = {t: r for t, r in backward_readers(ex.route).items() if r}
    ex.compressed = CompressedStore(readers, ErrorBoundRule(target), backend=ex.be)
    return ex.compressed


def net_figures(key: str, target: float) -> dict:
    net = build_model(**NETS[key])
    opt = SGD(lr=0.01, momentum=0.9)
    x, y = _batch(net)
    out: dict = {"net": key, "shape": list(net.input_nodes[0].shape)}
    for pol in ("none", "liveness"):
        plan = plan_network(net, opt.slots, PlanRequest(pol), CPU)
        out[f"peak_{pol}"] = plan.peak_bytes
    live = plan_network(net, opt.slots, PlanRequest("liveness"), CPU)
    ex = Executor(net, live, opt, seed=0)
    t = time.perf_counter()
    ex.train_step(x, y)
    out["step_s_liveness"] = time.perf_counter() - t

    first = plan_network(net, opt.slots, PlanRequest("compress"), CPU)
    ex = Executor(net, first, opt, seed=0)
    store = _store(ex, target)
    ex.train_step(x, y)
    ratios = store.ratios()
    plan = plan_compress(first.route, None, ratios=ratios)
    ex = Executor(net, plan, opt, seed=0)
    store = _store(ex, target)
    ex.train_step(x, y)                       # bound rule B0 (no measurement yet)
    store.compress_s = store.decompress_s = 0.0
    t = time.perf_counter()
    ex.train_step(x, y)                       # rule B, adapted from the first step
    out["step_s_compress"] = time.perf_counter() - t
    out["compress_s"], out["decompress_s"] = store.compress_s, store.decompress_s
    out["peak_compress"] = plan.peak_bytes
    out["pool_peak_compress"] = ex.pool.peak
    out["spills"] = store.spill_count
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for tid in compressed_tensors(plan):
        f = store.figures[tid]
        node = net.node(tid.split(":", 1)[1])
        kind = type(node.layer).__name__ if hasattr(node, "layer") and node.layer is not None else "Input"
        by_type[kind][0] += f.raw_bytes
        by_type[kind][1] += f.stream_bytes
        by_type[kind][2] += 1
    out["by_layer_type"] = {k: {"raw": v[0], "stream": v[1], "tensors": v[2], "ratio": v[0] / max(v[1], 1)}
                            for k, v in sorted(by_type.items())}
    out["stored_raw"] = sum(v[0] for v in by_type.values())
    out["stored_stream"] = sum(v[1] for v in by_type.values())
    out["compressed_tensors"] = len(compressed_tensors(plan))
    return out


def _code_version() -> str:
    """The commit of the minidl being measured (run this script with PYTHONPATH=<another checkout> to measure
    that code: the codec time before and after a change, side by side in the results)."""
    import subprocess

    import minidl

    root = Path(minidl.__file__).resolve().parent
    r = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    return r.stdout.strip()[:72] or "unknown"


def codec_step(batch: int = 64, steps: int = 3, target: float = 0.01) -> tuple[dict, list]:
    """ResNet-20 (CIFAR shape) at `batch`, policy `compress`: the codec's share of the last of `steps` training
    steps (the first compiles kernels and measures the adaptive bound). Also returns what that step compressed
    (tensor, array, bound) for `codec_variants`."""
    net = build_model("resnet", depth=20, batch=batch, image_size=32, num_classes=10)
    opt = SGD(lr=0.01, momentum=0.9)
    ex = Executor(net, plan_network(net, opt.slots, PlanRequest("compress"), CPU), opt, seed=0)
    store = _store(ex, target)
    x, y = _batch(net)
    seen: list = []
    encode = store.compress

    def recording(tid, src, block):   # installed before the first step: a compiled step records this call
        encode(tid, src, block)
        seen.append((tid, np.array(store._host(src)), store.figures[tid].eb))

    store.compress = recording
    for _ in range(steps - 1):
        ex.train_step(x, y)
    seen.clear()
    store.compress_s = store.decompress_s = 0.0
    t = time.perf_counter()
    ex.train_step(x, y)
    step = time.perf_counter() - t
    figs = store.figures.values()
    row = {"code": _code_version(), "net": "resnet20", "batch": batch, "entropy": getattr(store, "entropy", "none"),
           "step_s": step, "compress_s": store.compress_s, "decompress_s": store.decompress_s,
           "stored_raw": sum(f.raw_bytes for f in figs), "stored_stream": sum(f.stream_bytes for f in figs)}
    return row, seen


def codec_variants(seen: list, reps: int = 3) -> list[dict]:
    """Each entropy stage on the same stored activations (one ResNet-20 step's): bytes stored and time per
    MB to encode and to decode (the best of `reps`), with Zstandard over the fixed-length blocks as the
    alternative to Huffman where the `zstandard` package is installed."""
    from minidl.codec import sz

    raw = sum(x.nbytes for _, x, _ in seen)
    variants = {e: (lambda x, eb, e=e: sz.compress(x, eb, e), sz.decompress) for e in sz.ENTROPY}
    try:
        import zstandard

        variants["zstd over blocks"] = (
            lambda x, eb: zstandard.ZstdCompressor(level=3).compress(sz.compress(x, eb, "none")),
            lambda s, shape: sz.decompress(zstandard.ZstdDecompressor().decompress(s), shape))
    except ImportError:
        pass
    rows = []
    for name, (enc, dec) in variants.items():
        best_e = best_d = float("inf")
        for _ in range(reps):
            te = td = 0.0
            stored = 0
            for _, x, eb in seen:
                t = time.perf_counter()
                s = enc(x, eb)
                te += time.perf_counter() - t
                stored += len(s)
                t = time.perf_counter()
                y = dec(s, x.shape)
                td += time.perf_counter() - t
                assert np.all(np.abs(y.astype(np.float64) - x) <= eb), name
            best_e, best_d = min(best_e, te), min(best_d, td)
        rows.append({"entropy": name, "ratio": raw / stored, "encode_ms_per_mb": best_e / raw * 1e9,
                     "decode_ms_per_mb": best_d / raw * 1e9})
    return rows


def gradient_error(targets, steps=2) -> list[dict]:
    """ResNet-20 (CIFAR shape, batch 2): train `steps` steps with compress (the rule adapts), then one step from
    the same state with and without compression; plain SGD, so the update is -lr * gradient."""
    net = build_model("resnet", depth=20, batch=2, image_size=32, num_classes=10)
    rows = []
    for target in targets:
        opt = SGD(lr=0.01)
        plan = plan_network(net, opt.slots, PlanRequest("compress"), CPU)
        ex = Executor(net, plan, opt, seed=0)
        store = _store(ex, target)
        for s in range(steps):
            ex.train_step(*_batch(net, s))
        state = ex.state_dict()
        ref = Executor(net, plan_network(net, opt.slots, PlanRequest("none"), CPU), opt, seed=0)
        ref.load_state_dict(state)
        x, y = _batch(net, 99)
        ex.train_step(x, y)
        ref.train_step(x, y)
        errs, num, den = [], 0.0, 0.0
        for k, v in ref.state_dict().items():
            if not k.endswith("weight") or "bn" in k:
                continue
            dn = v.astype(np.float64) - state[k]
            dc = ex.state_dict()[k].astype(np.float64) - state[k]
            e, n = np.linalg.norm(dc - dn), np.linalg.norm(dn)
            num, den = num + e * e, den + n * n
            if n > 0:
                errs.append(e / n)
        raw = sum(f.raw_bytes for f in store.figures.values())
        stream = sum(f.stream_bytes for f in store.figures.values() if f.stream_bytes)
        rows.append({"target": target, "median_layer_rel_err": float(np.median(errs)),
                     "max_layer_rel_err": float(np.max(errs)), "total_rel_err": float(np.sqrt(num / den)),
                     "ratio": raw / max(stream, 1)})
    return rows


def accuracy(steps: int, batch: int, target: float, seed: int = 0) -> dict:
    data = digits(seed=0)
    train, held = data.split(0.2, seed=0)
    out = {"steps": steps, "batch": batch, "target": target, "seed": seed}
    for pol in ("none", "compress"):
        net = build_model("resnet", depth=20, batch=batch, image_size=8, in_channels=1, num_classes=10)
        opt = SGD(lr=0.05, momentum=0.9)
        ex = Executor(net, plan_network(net, opt.slots, PlanRequest(pol), CPU), opt, seed=seed)
        if pol == "compress":
            _store(ex, target)
        it = BatchIterator(train, batch, seed=seed, shuffle=True, drop_last=True)
        losses = []
        sched = Cosine(steps)   # decayed to 0: the held-out accuracy is that of a settled model, not of a spike
        t = time.perf_counter()
        for k in range(steps):
            opt.lr = sched.lr(0.05, k)
            losses.append(ex.train_step(*it.next_batch()))
        dt = time.perf_counter() - t
        n = (len(held) // batch) * batch
        correct = 0
        for i in range(0, n, batch):
            _, logits = ex.evaluate(held.x[i:i + batch].astype(np.float32), held.y[i:i + batch])
            correct += int((logits.argmax(axis=1) == held.y[i:i + batch]).sum())
        out[pol] = {"losses": [float(v) for v in losses], "heldout_acc": correct / n, "train_s": dt,
                    "peak": ex.plan.peak_bytes}
        if pol == "compress":
            out[pol]["spills"] = ex.compressed.spill_count
    return out


def auto_vs_lossy(fractions=(0.7, 0.5, 0.3, 0.22), devices=("cpu", "k40c")) -> list[str]:
    """ResNet-20, CIFAR shape, batch 32: what `auto` and `auto-lossy` choose at budgets below liveness' minimum
    (planning only: the simulator's estimated step time on each device profile)."""
    from minidl.core.errors import BudgetError
    from minidl.memory.simulate import simulate

    net = build_model("resnet", depth=20, batch=32, image_size=32, num_classes=10)
    opt = SGD(lr=0.01, momentum=0.9)
    live = plan_network(net, opt.slots, PlanRequest("liveness"), CPU).min_budget_bytes
    least = plan_network(net, opt.slots, PlanRequest("compress"), CPU).min_budget_bytes
    rows = [f"liveness min {live}, compress min {least}"]
    for dev in devices:
        for f in fractions:
            b = int(live * f)
            for pol in ("auto", "auto-lossy"):
                try:
                    p = plan_network(net, opt.slots, PlanRequest.from_options(pol, b), Target(get_profile(dev)))
                    rows.append(f"{dev} {f} {b} {pol} peak {p.peak_bytes} est "
                                f"{simulate(p, dev).est_step_time_s * 1e3:.3f} ms compressed "
                                f"{len(compressed_tensors(p))} offloaded {p.offloaded_bytes}")
                except BudgetError as e:
                    rows.append(f"{dev} {f} {b} {pol} min {e.min_budget_bytes}")
    return rows


def plot(acc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, pol in zip(axes, ("none", "compress")):
        ax.plot(acc[pol]["losses"], lw=1)
        ax.set_title(f"{pol}: held-out acc {acc[pol]['heldout_acc']:.3f}")
        ax.set_xlabel("step")
    axes[0].set_ylabel("training loss")
    fig.suptitle(f"ResNet-20 on digits, batch {acc['batch']}, {acc['steps']} steps, seed {acc['seed']} "
                 f"(rho* = {acc['target']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nets", nargs="*", default=list(NETS))
    ap.add_argument("--target", type=float, default=0.01, help="rho*: relative weight-gradient error aimed at")
    ap.add_argument("--targets", type=float, nargs="*", default=[0.001, 0.01, 0.1])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0], help="accuracy runs, one per seed")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--auto", action="store_true", help="also compare auto and auto-lossy under budgets (planning)")
    ap.add_argument("--codec", action="store_true", help="the codec's time in a ResNet-20 step at --codec-batch, "
                    "and each entropy stage's ratio and speed on that step's activations")
    ap.add_argument("--codec-batch", type=int, default=64)
    ap.add_argument("--codec-label", help="the row's name in the codec table (default: the commit measured)")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "compression.json"
    res: dict = json.loads(path.read_text()) if path.exists() else {}   # a partial run updates what it measured
    res.update({"date": time.strftime("%Y-%m-%d"), "machine": "2 cores shared with 7 other jobs"})
    res.setdefault("nets", [])
    if not args.skip_accuracy:
        runs = []
        for seed in args.seeds:
            acc = accuracy(args.steps, args.batch, args.target, seed)
            runs.append(acc)
            print(f"digits ResNet-20 {args.steps} steps, seed {seed}: held-out acc none "
                  f"{acc['none']['heldout_acc']:.4f}, compress {acc['compress']['heldout_acc']:.4f} (spills "
                  f"{acc['compress']['spills']}); train time {acc['none']['train_s']:.1f} s vs "
                  f"{acc['compress']['train_s']:.1f} s", flush=True)
        res["accuracy"] = runs[0]
        res["accuracy_seeds"] = [{"seed": r["seed"], "none": r["none"]["heldout_acc"],
                                  "compress": r["compress"]["heldout_acc"]} for r in runs]
        plot(runs[0], RESULTS / "compression_loss.png")
        if len(runs) > 1:
            print(f"mean over seeds {args.seeds}: none {np.mean([r['none']['heldout_acc'] for r in runs]):.4f}, "
                  f"compress {np.mean([r['compress']['heldout_acc'] for r in runs]):.4f}")
        path.write_text(json.dumps(res, indent=1))
    for key in args.nets:
        f = net_figures(key, args.target)
        res["nets"] = [n for n in res["nets"] if n["net"] != key] + [f]
        path.write_text(json.dumps(res, indent=1))
        print(f"{key} {f['shape']}: peak none {f['peak_none'] / 2**20:.1f} MiB, liveness "
              f"{f['peak_liveness'] / 2**20:.1f} MiB, compress {f['peak_compress'] / 2**20:.1f} MiB "
              f"(x{f['peak_none'] / f['peak_compress']:.2f} vs none, x{f['peak_liveness'] / f['peak_compress']:.2f} "
              f"vs liveness); stored for backward {f['stored_raw'] / 2**20:.1f} -> {f['stored_stream'] / 2**20:.2f} "
              f"MiB (x{f['stored_raw'] / max(f['stored_stream'], 1):.1f}); codec {f['compress_s']:.2f}+"
              f"{f['decompress_s']:.2f} s of a {f['step_s_compress']:.2f} s step (liveness step "
              f"{f['step_s_liveness']:.2f} s); spills {f['spills']}", flush=True)
        for k, v in f["by_layer_type"].items():
            print(f"    {k:<12} {v['tensors']:>3} tensors  {v['raw'] / 2**20:8.2f} MiB -> x{v['ratio']:.1f}")
    if args.targets:
        res["gradient_error"] = gradient_error(args.targets)
    for r in res.get("gradient_error", []) if args.targets else []:
        print(f"rho* {r['target']:g}: relative weight-gradient error median {r['median_layer_rel_err']:.4f} "
              f"(max {r['max_layer_rel_err']:.4f}, all layers {r['total_rel_err']:.4f}), ratio x{r['ratio']:.1f}",
              flush=True)
    if args.codec:
        row, seen = codec_step(args.codec_batch, target=args.target)
        row["code"] = args.codec_label or row["code"]
        res["codec_step"] = [r for r in res.get("codec_step", []) if r["code"] != row["code"]] + [row]
        print(f"codec in a ResNet-20 b{row['batch']} step ({row['code']}): {row['compress_s']:.2f} + "
              f"{row['decompress_s']:.2f} s of {row['step_s']:.2f} s, stored x"
              f"{row['stored_raw'] / max(row['stored_stream'], 1):.2f}", flush=True)
        from minidl.codec import sz

        if hasattr(sz, "ENTROPY"):   # older code measured for its step time has one encoding only
            res["codec_variants"] = codec_variants(seen)
            for r in res["codec_variants"]:
                print(f"    {r['entropy']:<18} x{r['ratio']:.2f}  encode {r['encode_ms_per_mb']:.2f} ms/MB  "
                      f"decode {r['decode_ms_per_mb']:.2f} ms/MB", flush=True)
        path.write_text(json.dumps(res, indent=1))
    if args.auto:
        res["auto_vs_lossy"] = auto_vs_lossy()
        for r in res["auto_vs_lossy"]:
            print(r, flush=True)
    path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
