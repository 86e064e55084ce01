"""Write docs/tour.md, its memory timelines (docs/tour/*.png) and its figures (docs/tour/figures.json).

    python docs/make_tour.py            # about a minute or two on a 2-core machine

Every figure in the tour is read from the output of the very commands the tour shows (run here as
subprocesses, with --json added to read their numbers), so nothing in it is typed by hand and a reader who runs
a command sees what the tour says. tests/docs/test_tour.py runs every command the tour shows (with fewer steps) and
re-plans every stage to check that the exact memory figures (bytes) still hold.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "docs" / "tour"
TOUR_MD = ROOT / "docs" / "tour.md"

NET = "resnet --depth 20 --batch 32 --image-size 8 --in-channels 1 --num-classes 10"
"""ResNet-20 shaped for the 8x8 digits (train infers these from --data digits; plan needs them spelled out)."""
TRAIN_STEPS = 30
FOLLOW = ("act:layer1.0.conv1", "act:layer1.0.relu1", "act:layer3.2.conv2")
"""The tensors whose story each stage tells: an early convolution's output (far from its backward use), the
ReLU after it (cheap to recompute), and the last block's convolution output (its backward use comes soon)."""
STORY_OF = "act:layer1.0.conv1"
"""The tensor whose every event (alloc, offload, prefetch, free...) each stage lists step by step."""


@dataclass(frozen=True, slots=True)
class Stage:
    policy: str
    budget: str | None
    idea: str  # what the stage teaches: prose, no figures

    @property
    def slug(self) -> str:
        return self.policy + (f"-{self.budget}" if self.budget else "")

    def memory_args(self) -> str:
        return f"--policy {self.policy}" + (f" --budget {self.budget}" if self.budget else "")

    def plan_command(self) -> str:
        return f"minidl plan {NET} --device cpu {self.memory_args()} --explain --plot {self.slug}.png"

    def train_command(self) -> str:
        return f"minidl train resnet --depth 20 --data digits --batch 32 --steps {TRAIN_STEPS} {self.memory_args()}"


STAGES = (
    Stage("none", None,
          "Every tensor is allocated before the first step and never freed: the baseline a framework without "
          "memory planning pays. Each activation stays resident from the start to the end of the step."),
    Stage("liveness", None,
          "Each tensor is allocated just before its first use and freed right after its last. An activation that "
          "backward does not read (a batch-norm output feeding a ReLU) is freed during the forward pass; the "
          "others live until their backward step."),
    Stage("recompute", None,
          "Cheap layers (ReLU, batch norm, pooling) drop their outputs after the forward pass; backward "
          "rebuilds them from the nearest kept convolution output. A little compute buys memory."),
    Stage("offload", "6MiB",
          "Under a budget below liveness' minimum, activations whose backward use is far away are copied to host "
          "memory after their forward use and prefetched before their backward use, on a transfer thread, so the "
          "copies can hide behind compute."),
    Stage("auto", "6MiB",
          "`auto` searches over liveness, recomputation, offload and per-step workspace sizes for the fastest plan "
          "that fits the budget. With some room to spare it may need no copies at all."),
    Stage("auto", "4MiB",
          "The README's first command: a tighter budget, so `auto` has to move tensors off the device."),
    Stage("auto", "3MiB",
          "Close to the smallest budget this network trains in: parameters, their gradients and the optimizer's "
          "momentum alone take a large share, and the busiest step's working set must fit beside them."),
)


def blas_kernel() -> str:
    """numpy's BLAS and the kernel it picked for this CPU (the commands run in this environment, so they get the
    same one). The kernel fixes how float32 sums are blocked and rounded: the losses and accuracies of the tour
    are those of this kernel (another CPU's, or another OPENBLAS_CORETYPE, gives others); the bytes are not."""
    import numpy  # noqa: F401 - threadpoolctl lists the libraries already loaded
    from threadpoolctl import threadpool_info

    for lib in threadpool_info():
        if lib.get("user_api") == "blas":
            kernel = f", {lib['architecture']} kernel" if lib.get("architecture") else ""
            return f"{lib.get('internal_api', 'BLAS')} {lib.get('version') or ''}{kernel}".replace(" ,", ",")
    return "BLAS unknown"


def run(command: str, cwd: Path) -> dict:
    """Run a shown command with --json added; its JSON object."""
    argv = [sys.executable, "-m", "minidl.cli", *shlex.split(command)[1:], "--json"]
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{command}\nfailed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _tensor_token(line: str, tensor: str) -> bool:
    return re.search(rf"(?<![\w:.]){re.escape(tensor)}(?![\w.])", line) is not None


def per_tensor_lines(explain: str, tensors: tuple[str, ...]) -> list[str]:
    """The plan's own one-line verdict for each followed tensor (the 'per tensor' section of --explain)."""
    section = explain.split("per tensor:", 1)
    if len(section) < 2:
        return []
    lines = []
    for tensor in tensors:
        lines += [ln.strip() for ln in section[1].splitlines() if _tensor_token(ln, tensor)][:1]
    return lines


def story(explain: str, tensor: str) -> list[str]:
    """Every event of `tensor` in the step-by-step part of --explain, each with its step."""
    out, step = [], ""
    for line in explain.split("per tensor:", 1)[0].splitlines():
        if line.startswith("step"):
            step = re.sub(r"\s+\[in use.*", "", line).strip()
        elif line.startswith("setup") and _tensor_token(line, tensor):
            out.append(line.strip())
        elif _tensor_token(line, tensor):
            event = re.sub(r"\s{2,}", "  ", line.strip())
            out.append(f"{step}: {event}")
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def stage_section(stage: Stage, plan: dict, train: dict) -> str:
    moved = plan["offloaded_bytes"] + plan["prefetched_bytes"]
    rows = [
        ("peak in use (plan)", f"{mib(plan['peak_bytes'])} ({plan['peak_bytes']:,} B)"),
        ("peak in use (measured pool, train)", f"{mib(train['pool_peak_bytes'])} ({train['pool_peak_bytes']:,} B)"),
        ("smallest budget for this plan", f"{mib(plan['min_budget_bytes'])} ({plan['min_budget_bytes']:,} B)"),
        ("bytes moved to/from the host per step", f"{mib(moved)} ({moved:,} B)"),
        ("recomputed share of compute", f"{plan['recompute_flops_share']:.1%}"),
        ("estimated step (simulator, cpu profile)", f"{plan['est_step_time_s'] * 1e3:.1f} ms"),
        ("measured step (median of the train run)", f"{train['step_time_s'] * 1e3:.1f} ms"),
    ]
    if moved:
        rows.append(("copy time hidden behind compute (measured)", f"{train['transfer_hidden_fraction']:.0%}"))
    if "accuracy" in train:
        rows.append((f"held-out accuracy after {TRAIN_STEPS} steps", f"{train['accuracy']:.1%}"))
    title = f"`{stage.policy}`" + (f" at {stage.budget}" if stage.budget else "")
    parts = [f"## {title}", "", stage.idea, "", "```bash", stage.plan_command(), stage.train_command(), "```", "",
             "| figure | value |", "|---|---:|", *[f"| {k} | {v} |" for k, v in rows], "",
             f"![memory timeline, {stage.slug}](tour/{stage.slug}.png)", ""]
    verdicts = per_tensor_lines(plan.get("explain", ""), FOLLOW)
    if verdicts:
        parts += ["What the plan decided for the tensors we follow (`--explain`, section *per tensor*):", "",
                  "```text", *verdicts, "```", ""]
    events = story(plan.get("explain", ""), STORY_OF)
    if events:
        parts += [f"Every event of `{STORY_OF}` in this plan (`--explain`, step by step):", "", "```text",
                  *events, "```", ""]
    return "\n".join(parts)


def summary_table(results: list[tuple[Stage, dict, dict]]) -> str:
    lines = ["| policy | budget | peak | moved per step | recomputed | estimated step | measured step |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for stage, plan, train in results:
        moved = plan["offloaded_bytes"] + plan["prefetched_bytes"]
        lines.append(f"| {stage.policy} | {stage.budget or '-'} | {mib(plan['peak_bytes'])} | {mib(moved)} | "
                     f"{plan['recompute_flops_share']:.1%} | {plan['est_step_time_s'] * 1e3:.1f} ms | "
                     f"{train['step_time_s'] * 1e3:.1f} ms |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default=f"{platform.machine()}, {platform.processor() or 'cpu'}",
                    help="how to describe the machine the times were measured on")
    args = ap.parse_args(argv)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    info = run(f"minidl info {NET}", OUT_DIR)
    results = []
    for stage in STAGES:
        print(f"{stage.slug}: planning and training ...", file=sys.stderr)
        plan = run(stage.plan_command(), OUT_DIR)
        train = run(stage.train_command(), OUT_DIR)
        if train["pool_peak_bytes"] != plan["peak_bytes"]:  # the tour says they are equal: hold it
            raise SystemExit(f"{stage.slug}: measured pool peak {train['pool_peak_bytes']} != planned "
                             f"{plan['peak_bytes']}")
        results.append((stage, plan, train))
    figures = {s.slug: {"command_plan": s.plan_command(), "command_train": s.train_command(),
                        "peak_bytes": p["peak_bytes"], "min_budget_bytes": p["min_budget_bytes"],
                        "pool_peak_bytes": t["pool_peak_bytes"], "offloaded_bytes": p["offloaded_bytes"],
                        "prefetched_bytes": p["prefetched_bytes"], "est_step_time_s": p["est_step_time_s"],
                        "step_time_s": t["step_time_s"], "accuracy": t.get("accuracy")}
               for s, p, t in results}
    (OUT_DIR / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    ratios = [t["step_time_s"] / p["est_step_time_s"] for _, p, t in results]
    today = datetime.date.today().isoformat()
    intro = f"""# A tour of minidl's memory planning: ResNet-20 on the 8x8 digits

*Generated by `python docs/make_tour.py` on {today} ({args.machine}; numpy's BLAS:
{blas_kernel()}); every figure below is read from the output of the commands
shown, so it is what you will see when you run them, with two exceptions: times vary with the machine, and
accuracies with the BLAS kernel your CPU gets (it changes float32 sums, and {TRAIN_STEPS} steps of training carry
the difference into the accuracy's first digits).
`tests/docs/test_tour.py` runs every command of this page and checks its memory figures, which are exact.*

One small network, ResNet-20 ({info['params']:,} parameters, {info['layers']} layers) at batch 32 on 8x8
images, planned and trained under each memory policy in turn. At each stage: the idea, the two commands
(`minidl plan ... --explain --plot` draws the memory timeline and explains every decision; `minidl train` runs
{TRAIN_STEPS} real steps), the figures, the memory timeline, and what the plan decided for three tensors we
follow:

- `act:layer1.0.conv1`, an early convolution's output: its backward use is far away, at the end of the step;
- `act:layer1.0.relu1`, the ReLU after it: cheap to recompute;
- `act:layer3.2.conv2`, the last block's convolution output: its backward use comes soon after.

Memory figures are bytes of the plan; the measured pool peak of the real run equals the plan's peak, byte for
byte (the simulator and the executor replay the same placement). Every policy trains to bit-identical parameters
(`--policy none` is the reference). Estimated step times come from the simulator's `cpu` profile; measured ones
are medians of the {TRAIN_STEPS}-step runs, on a machine shared with other jobs, so they are noisy. The `cpu`
profile's speeds are fixed figures, not measured on the machine at hand: here the measured steps were
{min(ratios):.1f}x to {max(ratios):.1f}x the estimates. Compare estimates with estimates and measurements with
measurements; the bytes are exact in both.

## The stages at a glance

{summary_table(results)}

"""
    body = "\n".join(stage_section(s, p, t) for s, p, t in results)
    outro = """## Where to go next

- `minidl plan ... --explain` on your own network: every allocation, free, copy and recomputation, with its reason.
- `docs/architecture.md`: where each mechanism lives in the code.
- README, *How memory planning works*: the route, liveness, the per-tensor decisions and the placement.
"""
    TOUR_MD.write_text(intro + body + outro)
    print(f"wrote {TOUR_MD.relative_to(ROOT)}, {OUT_DIR.relative_to(ROOT)}/*.png and figures.json", file=sys.stderr)


if __name__ == "__main__":
    main()
