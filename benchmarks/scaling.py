"""Data-parallel scaling on this machine: images/s for 1 and 2 MPI ranks, and how much of the all-reduce hid.

    python benchmarks/scaling.py --model resnet --depth 20 --batch 32 --steps 20 --bucket-size 256KiB
    python benchmarks/scaling.py --accuracy-steps 150     # also: held-out accuracy, 2 ranks vs 1 process

Weak scaling: every rank keeps `--batch` samples, so N ranks train on N x batch per step. Each configuration is
`mpiexec -n N python -m minidl.cli train ... --trace` (the mpich wheel's mpiexec beside this interpreter, else
the one on PATH); one BLAS thread per rank (`--blas-threads`), so 2 ranks use the 2 cores one rank x 2 threads
would. images/s = N x batch / rank 0's median step time. The configurations alternate `--repeats` times (machine
noise then hits each alike) and the table shows the run with the median images/s of each, with the range.

Hidden share, from rank 0's trace: each bucket's all-reduce is a span on the `allreduce` track (from its start
after its ready step until a test or the wait saw it complete); the share of those spans' time that overlaps
the `compute` track's backward steps is the all-reduce time hidden behind backward. The reducer's own figure
(1 - time the update waited / time in flight) is reported beside it.

Accuracy (`--accuracy-steps`): ResNet-20 on digits, one process at batch 2 x B against 2 ranks at batch B, the
same samples per step; held-out accuracy of each (rank 0's replica and BN statistics for the 2-rank run).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    exe = str(here) if here.exists() else shutil.which("mpiexec")
    if exe is None:
        sys.exit("no mpiexec: pip install -e '.[mpi]'")
    return exe


def run(ranks: int, train_args: list[str], blas_threads: int, trace: Path | None = None) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(blas_threads), OMP_NUM_THREADS=str(blas_threads),
               MKL_NUM_THREADS=str(blas_threads))
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "minidl.cli", "train", *train_args, "--json",
           "--no-progress"]
    if trace is not None:
        cmd += ["--trace", str(trace)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def hidden_from_trace(path: Path) -> tuple[float, float]:
    """(all-reduce seconds in flight, share of them overlapping backward compute), from a `--trace` file."""
    events = json.loads(path.read_text())["traceEvents"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("tid") == 3]
    bwd = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("ph") == "X" and e.get("tid") == 1 and e["name"].startswith("bwd "))
    total = sum(b - a for a, b in spans)
    overlap = 0.0
    for a, b in spans:
        for c, d in bwd:
            if d <= a:
                continue
            if c >= b:
                break
            overlap += min(b, d) - max(a, c)
    return total / 1e6, (overlap / total if total else 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--depth", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bucket-size", default="256KiB")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--blas-threads", type=int, default=1)
    ap.add_argument("--accuracy-steps", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()

    model = [args.model] + (["--depth", str(args.depth)] if args.depth else [])
    ranks = [int(x) for x in args.ranks.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in ranks}
    with tempfile.TemporaryDirectory() as tmp:
        for rep, n in [(r, n) for r in range(args.repeats) for n in ranks]:
            trace = Path(tmp) / f"trace{n}.{rep}.json"
            out = run(n, [*model, "--data", "digits", "--batch", str(args.batch), "--steps", str(args.steps),
                          "--bucket-size", args.bucket_size], args.blas_threads, trace)
            inflight, hidden = hidden_from_trace(trace)
            runs[n].append({"ranks": n, "global_batch": out["global_batch"], "step_time_s": out["step_time_s"],
                         "images_per_s": out["images_per_s"], "buckets": out["allreduce_buckets"] // args.steps,
                         "allreduce_bytes_per_step": out["allreduce_bytes_per_step"],
                         "allreduce_inflight_s_per_step": inflight / args.steps,
                         "hidden_behind_backward": hidden,
                         "reducer_hidden_fraction": out["allreduce_hidden_fraction"],
                         "peak_bytes": out["peak_bytes"], "bucket_bytes_at_peak": out["by_role"].get("bucket", 0)})
    rows = []
    for n in ranks:
        by_speed = sorted(runs[n], key=lambda r: r["images_per_s"])
        row = dict(by_speed[len(by_speed) // 2])
        row["images_per_s_range"] = [by_speed[0]["images_per_s"], by_speed[-1]["images_per_s"]]
        rows.append(row)
    base = rows[0]["images_per_s"]
    print(f"{' '.join(model)}, digits, batch {args.batch} per rank, {args.steps} steps, buckets "
          f"{args.bucket_size}, {args.blas_threads} BLAS thread(s) per rank; median of {args.repeats} runs")
    print("| ranks | global batch | step | images/s (range) | speedup | buckets | all-reduce spans/step "
          "| hidden behind backward (trace) | reducer's hidden share |")  # spans summed over buckets
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['ranks']} | {r['global_batch']} | {r['step_time_s'] * 1e3:.1f} ms | {r['images_per_s']:.0f} "
              f"({r['images_per_s_range'][0]:.0f}-{r['images_per_s_range'][1]:.0f}) | "
              f"{r['images_per_s'] / base:.2f}x | {r['buckets']} | {r['allreduce_inflight_s_per_step'] * 1e3:.1f} ms "
              + (f"| {r['hidden_behind_backward']:.0%} | {r['reducer_hidden_fraction']:.0%} |" if r["ranks"] > 1
                 else "| - | - |"))  # one rank: the all-gather is a no-op, nothing to hide
    result = {"model": model, "batch_per_rank": args.batch, "steps": args.steps, "bucket_size": args.bucket_size,
              "blas_threads": args.blas_threads, "rows": rows, "runs": runs}
    if args.accuracy_steps:
        common = ["resnet", "--depth", "20", "--data", "digits", "--steps", str(args.accuracy_steps),
                  "--bucket-size", args.bucket_size]
        one = run(1, [*common, "--batch", str(2 * args.batch), "--dist", "off"], args.blas_threads)
        two = run(2, [*common, "--batch", str(args.batch)], args.blas_threads)
        result["accuracy"] = {"one_process": one["accuracy"], "two_ranks": two["accuracy"],
                              "final_loss_one": one["final_loss"], "final_loss_two": two["final_loss"]}
        print(f"held-out accuracy after {args.accuracy_steps} steps (ResNet-20, digits, global batch "
              f"{2 * args.batch}): 1 process {one['accuracy']:.2%}, 2 ranks {two['accuracy']:.2%} "
              f"(difference {abs(one['accuracy'] - two['accuracy']) * 100:.2f} points); final loss "
              f"{one['final_loss']:.4f} vs {two['final_loss']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
