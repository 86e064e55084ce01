"""The GPU check: what matters most about minidl on a GPU, in one run of at most 8 minutes on an H100, setup
included, each part under its own time cap, its results written as it goes.

    python3 benchmarks/gpu_check.py --out "$OUT"        # on the GPU machine: the one command (docs/gpu.md)
    python benchmarks/gpu_check.py --out /tmp/c --fake  # every part on the CPU (tests/benchmarks/test_gpu_check.py)

Setup (in this process): the cuDNN frontend from the carried `.whl/` folder where `import cudnn` fails, and minidl
installed (editable) where `minidl.models` does not import. Then the parts, in order of value, each a process of
its own under its cap (killed with everything it started when the cap is reached; what it wrote stays):

  correctness   pytest -m gpu: conformance (convolution, batch norm, dense), CUDA-graph replay bit-identical to
                the eager loop (a dense layer between the graphs), every exact policy (recompute included)
                bit-identical to `none` under CUDA graphs; fp32, small nets; the half forms of kernels/*.cu in
                bf16 and fp16 against the CPU's half kernels; cuDNN's SDPA against the CPU's half attention
  startup       `minidl train resnet --depth 50 --batch 64 --image-size 224 --backend cuda`, twice: cold (an empty
                user cache folder) and warm; startup_s, its parts, what the caches held (goal: 10 s, then 3 s)
  speed         benchmarks/gpu_vs_torch.py's ResNet-50 rows, fp32 and tf32, against PyTorch on the same GPU
  half          its bf16 rows (ResNet-50 b32 and b64, GPT-2 small with SDPA, then with kept scores) against PyTorch
                AMP (bf16 autocast, channels_last)
  memory        ResNet-50 b64 under `--budget 3GB` (auto): the pool's peak, the device's own reading
                (cudaMemGetInfo), beside the same network in PyTorch (max_memory_allocated and the device's reading)
  superneurons  SuperNeurons' headline on the device: ResNet-2500 at batch 16 planned in 12 GB (`window`: its plan
                takes seconds, `auto`'s minutes), trained 2 steps, the device's reading (the deepest depth is
                searched on the host, where each plan may take minutes)
  profile       benchmarks/gpu_profile.py: minidl's step per layer kind and phase beside PyTorch's kernels

Files in --out (9): summary.json (setup and each part: status, seconds, cap, headline figures; rewritten after each
part), log.txt (everything every part printed), startup.json, speed.json, half.json, memory.json, superneurons.json
and the profile's gpu_profile_*.json and .md (benchmarks/results/ takes them as they are). Scratch (caches, the
speed rows' autotune file) goes to --work. --fake runs every part on the CPU backend and PyTorch's CPU with tiny
networks, so that the script, its parts and its files are tested without a GPU; its figures are not GPU figures.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
EXIT_SKIPPED = 3          # a part that cannot run here (no GPU for the speed rows in --fake): not a failure
BUDGET_S = 450            # the parts' share of the 8 minutes: setup, and the machine's own start, take the rest
MIN_PART_S = 20           # a part is not started with less time than this left


@dataclass(slots=True)
class Part:
    name: str
    cap_s: int
    what: str


PARTS = [
    Part("correctness", 80, "pytest -m gpu: conformance, graph replay, exact policies under CUDA graphs"),
    Part("startup", 85, "minidl train ResNet-50 b64 224, cold then warm: startup_s and its parts"),
    Part("speed", 85, "gpu_vs_torch.py ResNet-50 rows, fp32 and tf32"),
    Part("half", 60, "gpu_vs_torch.py bf16 rows: ResNet-50 b32/b64, GPT-2 small (SDPA, kept) against PyTorch AMP"),
    Part("memory", 40, "ResNet-50 b64 --budget 3GB: pool peak and the device's reading beside PyTorch's"),
    Part("superneurons", 55, "ResNet-2500 b16 in 12 GB (`window`) on the device, 2 steps"),
    Part("profile", 45, "gpu_profile.py: per layer kind and phase, minidl beside PyTorch"),
]


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", type=Path, required=True, help="the results folder (9 files at most)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--fake", action="store_true", help="every part on the CPU, tiny (the tests' mode)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for all parts together")
    ap.add_argument("--only", nargs="*", choices=[p.name for p in PARTS], help="these parts only")
    ap.add_argument("--part", choices=[p.name for p in PARTS], help=argparse.SUPPRESS)   # a part's own process
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------
# The parent: setup, then each part in a process of its own under its cap
# ---------------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Summary:
    fake: bool
    started: str
    budget_s: float
    setup: dict = field(default_factory=dict)
    parts: list[dict] = field(default_factory=list)

    def write(self, out: Path) -> None:
        _write_json(out / "summary.json", asdict(self))


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def setup(work: Path, fake: bool, log) -> tuple[dict, dict]:
    """The environment the parts run in: the cuDNN frontend from `.whl/` where it is missing (installed into the
    work folder, put on PYTHONPATH), minidl installed where `minidl.models` does not import. Returns (what was
    done, the parts' environment)."""
    t = time.perf_counter()
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if not fake:   # the parts share a user cache folder of their own (fake: the numba kernels stay where they are)
        env["MINIDL_CACHE_DIR"] = str(work / "cache")
    done = {}
    if not fake and importlib.util.find_spec("cudnn") is None:
        wheels = sorted((ROOT / ".whl").glob("nvidia_cudnn_frontend-*.whl"))
        if not wheels:
            done["cudnn_frontend"] = "missing: no `import cudnn` and no .whl/nvidia_cudnn_frontend-*.whl (docs/gpu.md)"
        else:
            site = work / "site"
            r = _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                      str(wheels[-1])], log)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH", "")]))
            done["cudnn_frontend"] = f"installed {wheels[-1].name} into {site} (pip exit {r})"
    else:
        done["cudnn_frontend"] = "importable" if not fake else "not needed (--fake)"
    if importlib.util.find_spec("minidl") is None or not _imports("minidl.models", env):
        r = _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                  "-e", str(ROOT)], log)
        done["minidl"] = f"pip install -e . (exit {r})"
    else:
        done["minidl"] = "importable"
    done["seconds"] = time.perf_counter() - t
    return done, env


def _imports(module: str, env: dict) -> bool:
    r = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, timeout=120)
    return r.returncode == 0


def _run(cmd: list[str], log) -> int:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=300).returncode


def run_part(part: Part, cap_s: float, args, env: dict, log, cmd: list[str] | None = None) -> dict:
    """`part` in a process of its own (this script with `--part`, or `cmd`) and a process group of its own, killed
    whole at the cap; its result file in the work folder gives the headline figures."""
    cmd = cmd or [sys.executable, str(Path(__file__).resolve()), "--part", part.name, "--out", str(args.out),
                  "--work", str(args.work)] + (["--fake"] if args.fake else [])
    log.write(f"\n===== {part.name}: {part.what} (cap {cap_s:.0f} s) =====\n")
    log.flush()
    result_file = args.work / f"{part.name}.result.json"
    result_file.unlink(missing_ok=True)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=cap_s)
        status = {0: "passed", EXIT_SKIPPED: "skipped"}.get(rc, f"failed (exit {rc})")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status = "timeout"
    out = {"part": part.name, "status": status, "seconds": round(time.perf_counter() - t, 1), "cap_s": cap_s}
    if result_file.exists():
        out["result"] = json.loads(result_file.read_text())
    collected = COLLECT[part.name](args) if part.name in COLLECT else None
    if collected is not None:
        out["result"] = collected
    log.write(f"===== {part.name}: {status} in {out['seconds']} s =====\n")
    log.flush()
    return out


def check(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = args.work or Path(tempfile.mkdtemp(prefix="minidl-gpu-check-"))
    args.work.mkdir(parents=True, exist_ok=True)
    summary = Summary(args.fake, time.strftime("%Y-%m-%d %H:%M:%S"), args.budget_s)
    start = time.perf_counter()
    with open(args.out / "log.txt", "a") as log:
        summary.setup, env = setup(args.work, args.fake, log)
        summary.write(args.out)
        for part in PARTS:
            if args.only and part.name not in args.only:
                continue
            left = args.budget_s - (time.perf_counter() - start)
            if left < MIN_PART_S:
                summary.parts.append({"part": part.name, "status": "not started: the budget is spent", "seconds": 0,
                                      "cap_s": 0})
            else:
                summary.parts.append(run_part(part, min(part.cap_s, left), args, env, log))
            summary.write(args.out)
    failed = [p["part"] for p in summary.parts if p["status"].startswith("failed")]
    print(json.dumps({"out": str(args.out), "parts": {p["part"]: p["status"] for p in summary.parts}}))
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------
# The parts (each in its own process: `--part NAME`)
# ---------------------------------------------------------------------------------------------------------

def _result(args, data: dict) -> None:
    """The part's headline figures, for the summary (written as they come: a capped part keeps what it had)."""
    _write_json(args.work / f"{args.part}.result.json", data)


def _script(name: str):
    """benchmarks/NAME.py as a module (the benchmarks folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# -- correctness ------------------------------------------------------------------------------------------------
# in order of value where the cap cuts: fp32 conformance and graphs, then SDPA's 6, then the ~90 half kernels
CORRECTNESS = ["tests/backend/test_conformance.py", "tests/backend/test_capture_gpu.py",
               "tests/backend/test_cuda_sdpa.py", "tests/backend/test_cuda_half_kernels.py", "-m", "gpu", "-k",
               "(test_conformance and (conv2d or batchnorm or linear)) or (test_capture_gpu and not tf32) "
               "or test_cuda_half_kernels or test_cuda_sdpa"]
CORRECTNESS_FAKE = ["tests/backend/test_cuda_plan_cache.py", "-k", "second_process or batch_norm"]


class _Counts:
    """A pytest plugin counting outcomes, one per test (its call's, or an error or skip outside it), handing the
    counts to `report` after each test (a capped run keeps what it had)."""

    def __init__(self, report):
        self.counts: dict[str, int] = {}
        self.failed: list[str] = []
        self._report = report

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            key = report.outcome
        elif report.failed:
            key = "error"
        elif report.skipped and report.when == "setup":
            key = "skipped"
        else:
            return
        self.counts[key] = self.counts.get(key, 0) + 1
        if key in ("failed", "error"):
            self.failed.append(report.nodeid)
        self._report(self)


def part_correctness(args) -> int:
    import pytest

    t = time.perf_counter()

    def report(c: _Counts, rc=None) -> None:
        _result(args, {"exit": rc, "counts": c.counts, "failed": c.failed[:20], "seconds": time.perf_counter() - t})
    counts = _Counts(report)
    rc = pytest.main(["-v", "-p", "no:cacheprovider", "-rfE", *(CORRECTNESS_FAKE if args.fake else CORRECTNESS)],
                     plugins=[counts])
    report(counts, int(rc))
    return 0 if rc == 0 else 1


# -- startup ------------------------------------------------------------------------------------------------------
TRAIN = ["train", "resnet", "--depth", "50", "--batch", "64", "--image-size", "224", "--backend", "cuda",
         "--steps", "3", "--json", "--no-progress"]
TRAIN_FAKE = ["train", "lenet", "--batch", "8", "--steps", "2", "--json", "--no-progress"]
GOALS_S = {"cold": 10.0, "warm": 3.0}     # the issue's: the first step within 10 s, within 3 s on the second run
STARTUP_KEYS = ("startup_s", "startup_parts", "startup_after_first_step", "startup_caches", "step_time_s",
                "step_runner", "graph_fallback", "final_loss")


def part_startup(args) -> int:
    argv = TRAIN_FAKE if args.fake else TRAIN
    env = dict(os.environ)
    if not args.fake:   # cold: the parts' user cache folder emptied (the later parts then start warm)
        shutil.rmtree(env["MINIDL_CACHE_DIR"], ignore_errors=True)
        env.pop("CUPY_CACHE_DIR", None)
    runs = {}
    for run in ("cold", "warm"):
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "minidl.cli", *argv], capture_output=True, text=True, env=env,
                           cwd=ROOT)
        sys.stderr.write(r.stderr[-4000:])
        wall = time.perf_counter() - t
        rec = {"exit": r.returncode, "wall_s": wall, "goal_s": GOALS_S[run]}
        try:
            out = json.loads(r.stdout.strip().splitlines()[-1])
            rec.update({k: out.get(k) for k in STARTUP_KEYS})
            rec["met_goal"] = out.get("startup_s") is not None and out["startup_s"] <= GOALS_S[run]
        except (ValueError, IndexError):
            rec["stdout_tail"] = r.stdout[-2000:]
        runs[run] = rec
        _write_json(args.out / "startup.json", {"command": "python -m minidl.cli " + " ".join(argv),
                                                "fake": args.fake, "runs": runs})
        _result(args, {k: {"startup_s": v.get("startup_s"), "wall_s": round(v["wall_s"], 2),
                           "met_goal": v.get("met_goal")} for k, v in runs.items()})
    return 0 if all(v["exit"] == 0 for v in runs.values()) else 1


# -- speed --------------------------------------------------------------------------------------------------------
#: part -> gpu_vs_torch.py's arguments for its rows (fp32/tf32 against plain PyTorch, bf16 against AMP)
SPEED_ROWS = {"speed": ["--only", "resnet50", "--math", "fp32", "tf32"],
              "half": ["--only", "resnet50", "gpt2", "gpt2_kept", "--math", "bf16"]}


def _speed_rows(args, part: str) -> int:
    """gpu_vs_torch.py's rows of `part` into the work folder (it rewrites its JSON after each row; the parent
    copies it to PART.json when the part ends, capped or not: `_collect_rows`)."""
    bench = _script("gpu_vs_torch")
    rc = bench.main(SPEED_ROWS[part] + ["--steps", "5", "--warmup", "2", "--out", str(args.work / part)])
    if rc == bench.EXIT_NO_GPU:
        _result(args, {"skipped": "gpu_vs_torch.py found no GPU (its message is in log.txt)"})
        return EXIT_SKIPPED
    return rc


def part_speed(args) -> int:
    return _speed_rows(args, "speed")


def part_half(args) -> int:
    return _speed_rows(args, "half")


def _collect_rows(args, part: str) -> dict | None:
    """PART.json from the rows gpu_vs_torch.py wrote so far, and their headline figures."""
    src = args.work / part / "gpu_vs_torch.json"
    if not src.exists():
        return None
    shutil.copyfile(src, args.out / f"{part}.json")
    keys = ("workload", "batch", "math", "minidl", "minidl_s", "torch_s", "ratio")
    return {"rows": [{k: r[k] for k in keys} | {k: v for k, v in r.get("extra", {}).items() if k == "attention"}
                     for r in json.loads(src.read_text())]}


# -- memory -------------------------------------------------------------------------------------------------------
def _device_used(on_gpu: bool) -> int | None:
    """Bytes in use on the device by every process, as the device reports it (cudaMemGetInfo); None on the CPU."""
    if not on_gpu:
        return None
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    return int(total - free)


def _workload(fake: bool, sn: bool = False):
    from minidl.models import build_model

    if sn:
        return build_model("resnet", depth=20 if fake else 2500, batch=2 if fake else 16,
                           image_size=16 if fake else 224)
    return build_model("resnet", depth=8 if fake else 50, batch=4 if fake else 64, image_size=16 if fake else 224)


def _minidl_run(net, policy: str, budget: str, steps: int, fake: bool, out: dict, write) -> dict:
    """Plan `net` under `policy` and `budget` on the device, train `steps` steps; into `out`: plan time, step
    times, the pool's peak, the backend's memory outside the arena, and the device's reading before and after.
    Returns the initial parameters (for PyTorch's twin)."""
    import numpy as np

    from minidl.backend import get_backend
    from minidl.optim import SGD
    from minidl.runtime.session import Session

    on_gpu = not fake
    out["device_used_before_bytes"] = _device_used(on_gpu)
    be = get_backend("cpu" if fake else "cuda")
    out["device_used_with_backend_bytes"] = _device_used(on_gpu)
    t = time.perf_counter()
    sess = Session(net, SGD(lr=1e-4, momentum=0.9), policy=policy, budget=budget, seed=0, backend=be)
    out.update(plan_s=time.perf_counter() - t, plan_peak_bytes=sess.plan.peak_bytes, decision=sess.plan.decision)
    state = {k: np.array(v, copy=True) for k, v in sess.executor.state_dict().items()}
    write()
    rng = np.random.default_rng(0)
    shape = net.input_nodes[0].shape
    x = rng.standard_normal(shape).astype(np.float32)
    y = rng.integers(0, net.logits_node.shape[1], shape[0])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        sess.executor.train_step(x, y)
        times.append(time.perf_counter() - t)
        out.update(step_s=times, pool_peak_bytes=int(sess.executor.pool.peak),
                   outside_arena=be.memory_report() if not fake else None,
                   device_used_after_bytes=_device_used(on_gpu), step_runner=sess.executor.step_runner)
        write()
    if on_gpu:
        be.close()
    return state


def part_memory(args) -> int:
    res: dict = {"budget": "1600KiB" if args.fake else "3GB", "minidl": {}, "torch": {}}

    def write():
        _write_json(args.out / "memory.json", res)
        m, t = res["minidl"], res["torch"]
        _result(args, {"pool_peak_bytes": m.get("pool_peak_bytes"), "device_used_after_bytes":
                       m.get("device_used_after_bytes"), "torch_max_allocated_bytes": t.get("max_allocated_bytes")})
    state = _minidl_run(_workload(args.fake), "auto", res["budget"], 3, args.fake, res["minidl"], write)
    gc.collect()
    _torch_memory(args.fake, state, res["torch"], write)
    return 0


def _torch_memory(fake: bool, state: dict, out: dict, write) -> None:
    """The same network in PyTorch (the twin with minidl's initial weights, SGD with momentum), 3 steps: its
    allocator's peak and the device's reading (cudaMemGetInfo through torch), beside minidl's."""
    import numpy as np
    import torch

    from minidl.testing.torch_twin import TorchTwin

    on_gpu = not fake
    dev = torch.device("cuda" if on_gpu else "cpu")
    net = _workload(fake)
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free0, total = torch.cuda.mem_get_info()
        out["device_used_before_bytes"] = int(total - free0)
    twin = TorchTwin(_workload(fake), state)
    for ps in twin.params.values():
        for k, t in ps.items():
            ps[k] = t.detach().to(dev).requires_grad_(t.requires_grad)
    opt = torch.optim.SGD([t for ps in twin.params.values() for t in ps.values() if t.requires_grad], lr=1e-4,
                          momentum=0.9)
    rng = np.random.default_rng(0)
    shape = net.input_nodes[0].shape
    x = torch.tensor(rng.standard_normal(shape).astype(np.float32), device=dev)
    y = torch.tensor(rng.integers(0, net.logits_node.shape[1], shape[0]), device=dev)
    for _ in range(3):
        loss, _ = twin.forward(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if on_gpu:
        torch.cuda.synchronize()
        free1, total = torch.cuda.mem_get_info()
        out.update(max_allocated_bytes=int(torch.cuda.max_memory_allocated()),
                   max_reserved_bytes=int(torch.cuda.max_memory_reserved()), device_used_after_bytes=int(total - free1))
    else:
        out["max_allocated_bytes"] = None
    out["torch"] = torch.__version__
    write()


# -- superneurons -------------------------------------------------------------------------------------------------
def part_superneurons(args) -> int:
    res: dict = {"network": "resnet-20 b2 16 px (fake)" if args.fake else "resnet-2500, batch 16, 224 px",
                 "budget": "3600KiB" if args.fake else "12GB", "policy": "window", "minidl": {},
                 "note": "ResNet-2500, the paper's headline network; policy `window` plans it in 12 GB in ~25 s "
                         "on a 2-core host, `auto` in ~200 s: the deepest depth is searched on the host "
                         "(`minidl reproduce superneurons`), not here"}

    def write():
        _write_json(args.out / "superneurons.json", res)
        m = res["minidl"]
        _result(args, {"plan_s": m.get("plan_s"), "step_s": m.get("step_s"), "pool_peak_bytes":
                       m.get("pool_peak_bytes"), "device_used_after_bytes": m.get("device_used_after_bytes")})
    _minidl_run(_workload(args.fake, sn=True), "window", res["budget"], 2, args.fake, res["minidl"], write)
    return 0


# -- profile ------------------------------------------------------------------------------------------------------
def part_profile(args) -> int:
    bench = _script("gpu_profile")
    argv = ["--out", str(args.out), "--steps", "3", "--warmup", "2"]
    if args.fake:
        argv = ["--fake", "--out", str(args.out), "--depth", "8", "--batch", "2", "--image-size", "8", "--steps",
                "1", "--warmup", "1"]
    rc = bench.main(argv)
    found = sorted(args.out.glob("gpu_profile_*.json"))
    if found:
        d = json.loads(found[-1].read_text())
        _result(args, {"file": found[-1].name, "largest": [
            {k: r[k] for k in ("kind", "phase", "seconds", "torch_s")} for r in d["rows"][:5]]})
    return rc


#: what the parent gathers after a part, capped or not
COLLECT = {part: (lambda args, part=part: _collect_rows(args, part)) for part in SPEED_ROWS}
PART_FUNCTIONS = {"correctness": part_correctness, "startup": part_startup, "speed": part_speed, "half": part_half,
                  "memory": part_memory, "superneurons": part_superneurons, "profile": part_profile}


def main(argv=None) -> int:
    args = parse(argv)
    if args.part is None:
        return check(args)
    return PART_FUNCTIONS[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
