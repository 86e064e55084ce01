"""Generate the figures of docs/reproductions.md and docs/performance.md from `benchmarks/results/`: the tables the
benchmark scripts wrote (`*.md`, included as they are) and tables rendered here from their JSON results. The
pages' prose is written by hand around these regions and holds no figure of its own.

    python docs/make_results.py [--check]

Each benchmark script says how to re-run it; re-running one rewrites its results file, and this script then
rewrites the pages (tests/docs/test_docs.py fails until it has).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generated import ROOT, fill, main, table  # noqa: E402
from make_readme import kernel_figures  # noqa: E402

SCRIPT = "docs/make_results.py"
RESULTS = ROOT / "benchmarks" / "results"
REPRODUCTIONS = ROOT / "docs" / "reproductions.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
NOT_RECORDED = "(the results file records no machine or date)"


def _json(name: str):
    return json.loads((RESULTS / name).read_text())


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def included(name: str) -> str:
    """A table a benchmark script wrote, as it is (its headings below this page's)."""
    lines = [("#### " + ln.lstrip("# ")) if ln.startswith("#") else ln
             for ln in (RESULTS / name).read_text().strip("\n").splitlines()]
    return f"From `benchmarks/results/{name}`:\n\n" + "\n".join(lines) + "\n"


def compression() -> str:
    d = _json("compression.json")
    head = (f"From `benchmarks/results/compression.json` ({d['date']}, {d['machine']}; "
            "`python benchmarks/compression.py`).\n\n")
    err = table(["target rho*", "median layer", "worst layer", "all layers", "compression ratio"],
                [[f"{r['target']:g}", f"{r['median_layer_rel_err']:.4f}", f"{r['max_layer_rel_err']:.4f}",
                  f"{r['total_rel_err']:.4f}", f"{r['ratio']:.1f}x"] for r in d["gradient_error"]], "rrrrr")
    seeds = d["accuracy_seeds"]
    acc_rows = [[s["seed"], f"{s['none']:.4f}", f"{s['compress']:.4f}",
                 f"{100 * (s['compress'] - s['none']):+.2f} points"] for s in seeds]
    mean_none = sum(s["none"] for s in seeds) / len(seeds)
    mean_comp = sum(s["compress"] for s in seeds) / len(seeds)
    acc_rows.append(["mean", f"{mean_none:.4f}", f"{mean_comp:.4f}", f"{100 * (mean_comp - mean_none):+.2f} points"])
    acc = table(["seed", "`none`", "`compress`", "difference"], acc_rows, "rrrr")
    a = d["accuracy"]
    nets = table(["net (input)", "peak `none`", "`liveness`", "`compress`", "stored for backward", "spills"],
                 [[f"{n['net']} ({'x'.join(map(str, n['shape']))})", _mb(n["peak_none"]), _mb(n["peak_liveness"]),
                   _mb(n["peak_compress"]), f"{_mb(n['stored_raw'])} -> {_mb(n['stored_stream'])} "
                   f"({n['stored_raw'] / n['stored_stream']:.1f}x)", n["spills"]] for n in d["nets"]], "lrrrrr")
    codec = ""
    if d.get("codec_step"):
        rows = [[r["code"], r["entropy"], f"{r['compress_s']:.2f} s", f"{r['decompress_s']:.2f} s",
                 f"{r['step_s']:.2f} s", f"{r['stored_raw'] / r['stored_stream']:.2f}x"] for r in d["codec_step"]]
        codec = ("\nThe codec's time in one ResNet-20 training step (CIFAR shape, batch "
                 f"{d['codec_step'][-1]['batch']}; `--codec`), per version of the code measured (the error bound's "
                 "statistics included in encode):\n\n"
                 + table(["code", "entropy stage", "encode", "decode", "step", "stored"], rows, "llrrrr"))
    if d.get("codec_variants"):
        codec += ("\nEach entropy stage on that step's stored activations (bytes stored, time per MB of "
                  "activations):\n\n"
                  + table(["entropy stage", "ratio", "encode", "decode"],
                          [[r["entropy"], f"{r['ratio']:.2f}x", f"{r['encode_ms_per_mb']:.1f} ms/MB",
                            f"{r['decode_ms_per_mb']:.1f} ms/MB"] for r in d["codec_variants"]], "lrrr"))
    return (head + "Relative weight-gradient error of one step against the exact step from the same state (ResNet-20, "
            "CIFAR shape, batch 2):\n\n" + err +
            f"\nHeld-out accuracy, ResNet-20 on the digits, {a['steps']} steps at batch {a['batch']}, target "
            f"{a['target']:g}, the same seed and steps for both:\n\n" + acc +
            "\nPeak memory per network (one step, on a plan reserved from the ratios its first step measured):\n\n"
            + nets + codec)


def scaling() -> str:
    d = _json("scaling.json")
    rows = [[r["ranks"], r["global_batch"], _ms(r["step_time_s"]),
             f"{r['images_per_s']:.0f} ({r['images_per_s_range'][0]:.0f}-{r['images_per_s_range'][1]:.0f})",
             r["buckets"], f"{100 * r['hidden_behind_backward']:.0f}%" if r["ranks"] > 1 else "-"]
            for r in d["rows"]]
    acc = d["accuracy"]
    return (f"From `benchmarks/results/scaling.json` ({d['machine']}; ResNet-20 on the digits, "
            f"{d['batch_per_rank']} images per rank, {d['bucket_size']} buckets, {d['blas_threads']} BLAS thread per "
            "rank; `python benchmarks/scaling.py`):\n\n" +
            table(["ranks", "global batch", "step (median)", "images/s (range)", "buckets",
                   "all-reduce hidden behind backward"], rows, "rrrrrr") +
            f"\nHeld-out accuracy after {acc['steps']} steps: one process {100 * acc['one_process']:.2f}%, two ranks "
            f"{100 * acc['two_ranks']:.2f}%.\n")


def dispatch() -> str:
    d = _json("dispatch_resnet1202_b1.json")
    rows = [[k, _ms(d[k]["step_s"]), _ms(d[k]["kernels_s"]), _ms(d[k]["dispatch_s"]),
             f"{d[k]['dispatch_us_per_step']:.2f} us"] for k in ("interpreted", "compiled")]
    return (f"From `benchmarks/results/dispatch_resnet1202_b1.json` {NOT_RECORDED}: {d['model']}, batch "
            f"{d['batch']}, {d['route_steps']:,} route steps, policy `{d['policy']}`; dispatch is the step's wall "
            "time minus its kernels' (`python benchmarks/dispatch.py`).\n\n" +
            table(["executor", "step", "kernels", "dispatch", "dispatch per route step"], rows, "lrrrr") +
            f"\nParameters bit-identical between the two: {d['bit_identical']}.\n")


def autotune() -> str:
    d = _json("autotune.json")
    rows = [[k, ", ".join(f"{a} {n}" for a, n in p["algorithms"].items()), f"{p['peak_bytes']:,} B",
             f"{p['step_s']:.3f} s"] for k, p in d["plans"].items()]
    return (f"From `benchmarks/results/autotune.json` {NOT_RECORDED}: {d['model']}, batch {d['batch']}, "
            f"{d['image_size']} px, policy `{d['policy']}`; measuring took {d['autotune_s']:.1f} s "
            f"({d['measurements']} measurements of {d['distinct_shapes']} distinct shapes) "
            "(`python benchmarks/autotune.py`).\n\n" +
            table(["ranking", "algorithms chosen (forward + backward steps)", "planned peak", "step (median)"],
                  rows, "llrr") + f"\nParameters bit-identical: {d['bit_identical']}.\n")


def first_command() -> str:
    d = _json("first_command.json")
    m = d["machine"]
    rows = [["first (empty kernel cache)", f"{d['cold']['wall_s']:.1f} s", d["cold"]["load_average_before"]]]
    rows += [[f"cached, run {i + 1}", f"{w['wall_s']:.1f} s", w["load_average_before"]]
             for i, w in enumerate(d["warm"])]
    return (f"From `benchmarks/results/first_command.json` ({d['date']}; {m['cpu']}, {m['cores']} cores, "
            f"{m['blas']}, Python {m['python']}; `python benchmarks/first_command.py`): `{d['command']}`\n\n" +
            table(["run", "wall time", "load average before"], rows, "lrr") +
            f"\nHeld-out accuracy and final loss by OpenBLAS kernel ({d['figures']['date']}, numpy "
            f"{d['figures']['numpy']}):\n\n" + kernel_figures())


def step_vs_torch(name: str) -> str:
    d = _json(f"{name}.json")
    m = d["machine"]
    rows = [[kind, f"{t['minidl']:.1f} ms", f"{t['torch']:.1f} ms",
             f"{t['minidl'] / t['torch']:.2f}x" if t["torch"] else "-"]
            for kind, t in sorted(d["per_type_ms"].items(), key=lambda kv: -kv[1]["minidl"])]
    rows.append(["whole step (median)", _ms(d["minidl_median_s"]), _ms(d["torch_median_s"]),
                 f"{d['minidl_median_s'] / d['torch_median_s']:.2f}x"])
    return (f"From `benchmarks/results/{name}.json` ({d['date']}; {m['cpu']}, {m['cores']} cores, Python "
            f"{m['python']}, torch {m['torch']}; load average {m['load_average_after']:.2f} after): {d['shape']}, "
            f"{d['threads']} threads, policy `{d['policy']}`, {d['runner']} step; `{d['command']}`. Steps "
            "alternate between the two; per layer type, minidl's times come from its trace and PyTorch's from its "
            "profiler's self CPU time of the mapped aten ops (an approximate mapping: the aten ops a layer decomposes "
            "into may land under another type, such as a mean under `gap`, or under `other`; the whole step is the "
            "figure to compare).\n\n" +
            table(["layer type", "minidl", "PyTorch", "minidl / PyTorch"], rows, "lrrr"))


def gpu_runs(results: Path = RESULTS) -> str:
    """The figures of GPU runs recorded as they were measured (`gpu_run_*.json`: device, date, commit, versions,
    one row per figure), newest first."""
    out = []
    for p in sorted(results.glob("gpu_run_*.json"), reverse=True):
        d = json.loads(p.read_text())
        v = ", ".join(f"{k} {x}" for k, x in d["versions"].items())
        rows = [[r["what"], r["how"], _seconds(r.get("minidl_s")), _seconds(r.get("torch_s")), r.get("note", "")]
                for r in d["rows"]]
        out.append(f"From `benchmarks/results/{p.name}` ({d['device']}, {d['date']}, project at {d['commit']}; "
                   f"{v}): {d['source']}.\n\n" +
                   table(["what", "how", "minidl", "PyTorch", "note"], rows, "llrrl"))
    return "\n".join(out)


def _seconds(s) -> str:
    if s is None:
        return ""
    return f"{s:.0f} s" if s >= 10 else f"{s * 1e3:.1f} ms"


def gpu_profiles(results: Path = RESULTS) -> str:
    """Every per-layer GPU profile benchmarks/gpu_profile.py wrote (`gpu_profile_*.md`), newest first; or that
    none has been measured yet."""
    found = sorted(results.glob("gpu_profile_*.json"), key=lambda p: (json.loads(p.read_text())["date"], p.name),
                   reverse=True)
    if not found:
        return ("No per-layer GPU profile has been measured yet: `python benchmarks/gpu_profile.py` on a GPU writes "
                "one (`benchmarks/gpu_check.py` runs it).\n")
    parts = []
    for p in found:
        lines = [("#### " + ln.lstrip("# ")) if ln.startswith("#") else ln
                 for ln in p.with_suffix(".md").read_text().strip("\n").splitlines()]
        parts.append(f"From `benchmarks/results/{p.with_suffix('.md').name}`:\n\n" + "\n".join(lines) + "\n")
    return "\n".join(parts)


def pages() -> dict[Path, str]:
    repro = {"superneurons": included("superneurons.md"), "memory-table": included("memory_table.md"),
             "out-of-core": included("out_of_core.md"), "weights-swap": included("weights_swap.md"),
             "weights-vgg16": included("weights_vgg16.md"), "harmony": included("harmony.md"),
             "compression": compression(), "comet": included("comet.md")}
    perf = {"first-command": first_command(), "dispatch": dispatch(), "autotune": autotune(), "scaling": scaling(),
            "compiled-runner": included("compiled_runner.md"),
            "step-vs-torch-gpt2": step_vs_torch("step_vs_torch_gpt2"), "half-step": included("half_step.md"),
            "half-accuracy": included("half_accuracy.md"), "gpu-vs-torch": included("gpu_vs_torch.md"),
            "gpu-runs": gpu_runs(), "gpu-profile": gpu_profiles()}
    return {REPRODUCTIONS: fill(REPRODUCTIONS.read_text(), SCRIPT, repro, "docs/reproductions.md"),
            PERFORMANCE: fill(PERFORMANCE.read_text(), SCRIPT, perf, "docs/performance.md")}


if __name__ == "__main__":
    main(SCRIPT, pages)
