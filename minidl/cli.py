"""The `minidl` command: info, plan, train, evaluate, predict, reproduce (with --json, each prints one JSON object).

    minidl info resnet --depth 50 --batch 32
    minidl plan resnet --depth 2500 --batch 16 --policy liveness --budget 12GB --device k40c
    minidl train resnet --depth 20 --data digits --batch 32 --steps 50 --policy liveness --budget 16MiB --save r.npz
    minidl evaluate resnet --depth 20 --data digits --checkpoint r.npz
    minidl reproduce out-of-core --quick
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .augment import parse_augment
from .cli_args import check_args
from .core.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, DivergenceError, MinidlError, OptionError, exit_status
from .memory.pool import format_bytes, parse_size
from .memory.simulate import PROFILES
from .optim.schedules import SCHEDULES


def _size(value: str) -> int:
    """argparse type for sizes: its error names the accepted forms, not this function."""
    try:
        return parse_size(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a memory size; use e.g. 512MiB, 12GiB (powers of 1024), 12GB (powers of 1000) "
            "or a plain number of bytes") from None


def _chunk(value: str) -> int | str:
    """argparse type for --paged's CHUNK: a size, or "auto" (the bare flag: chosen from the budget in `main`)."""
    return value if value == "auto" else _size(value)


def _augment(value: str):
    """argparse type for --augment: its error is parse_augment's, naming the accepted forms."""
    try:
        return parse_augment(value)
    except OptionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(value: str) -> int:
    """argparse type for counts that must be >= 1."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number")
    return n


def _count(value: str) -> int:
    """argparse type for counts that may be 0."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= 0")
    return n


class _Parser(argparse.ArgumentParser):
    """argparse's usage errors as the other errors: one line `minidl: error: ...`, status 2 (the usage is one
    `--help` away)."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"minidl: error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default after its help text (skipped where the default is None or False), and the
    epilog as written (the policies' table, one line each)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model name (lenet, alexnet, vgg16, resnet, densenet121, inception_v4, ...)")
    p.add_argument("--depth", type=_positive_int, default=None,
                   help="depth for resnet/vgg/densenet (default: the model's own, e.g. resnet 50)")
    p.add_argument("--batch", type=_positive_int, default=None,
                   help="batch size (default: the model's own; 32 for train)")
    p.add_argument("--image-size", type=_positive_int, default=None,
                   help="input height = width (default: the model's own, or the data set's for train)")
    p.add_argument("--num-classes", type=_positive_int, default=None,
                   help="classes of the last layer (default: the model's own, or the data set's for train)")
    p.add_argument("--in-channels", type=_positive_int, default=None,
                   help="input channels (default: the model's own, or the data set's for train)")
    p.add_argument("--size", "--config", dest="size", default=None,
                   help="gpt2: small | medium | large | xl; bert: base | large | 96 (Harmony's BERT-96)")
    for opt, what in (("layers", "transformer blocks"), ("heads", "attention heads"),
                      ("width", "channels per token"), ("seq", "tokens per sequence")):
        p.add_argument(f"--{opt}", type=_positive_int, default=None,
                       help=f"gpt2/bert: {what} (default: the size's own)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _memory_args(p: argparse.ArgumentParser, policy_default: str | None) -> None:
    from .memory.policies import available_policies

    p.add_argument("--policy", default=None, choices=available_policies(),
                   help="memory policy, each described in one line at the end of --help (default: auto when "
                        "--budget is given, else liveness)")
    p.add_argument("--no-cpu-winograd", dest="cpu_winograd", action="store_false", default=None,
                   help="CPU backend: run 3x3 stride-1 convolutions with >= 32 channels as the row-shift pair "
                        "instead of Winograd F(2x2, 3x3), which is the default (faster; other rounding, the same "
                        "guarantees); sets MINIDL_CPU_WINOGRAD=0")
    p.add_argument("--cpu-winograd", dest="cpu_winograd", action="store_true",
                   help="CPU backend: Winograd F(2x2, 3x3) for those convolutions (the default; sets "
                        "MINIDL_CPU_WINOGRAD=1, overriding the environment)")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="CPU backend: threads for the convolution lanes, compiled kernels and numpy's BLAS "
                        "(default: the usable cores, at most 8); sets MINIDL_CPU_THREADS. Results are the same bits "
                        "whatever N: every split is fixed by the shapes, and a step runs the BLAS on one thread a "
                        "call")
    p.add_argument("--lossy", action="store_true",
                   help="let --policy auto also weigh lossy compression of stored activations (auto-lossy); "
                        "results are then not bit-identical to policy none")
    p.add_argument("--budget", type=_size, default=None,
                   help="device memory budget, e.g. 512MiB, 12GB, 7.02MiB (a fraction of a byte is rounded up to a "
                        "multiple of 512 bytes, the pool's unit; default: no limit)")
    p.add_argument("--paged", nargs="?", const="auto", default=None, type=_chunk, metavar="CHUNK",
                   help="place tensors on a paged arena: physical chunks mapped behind contiguous virtual ranges, so "
                        "the arena needed is the peak of live chunks (no fragmentation). Without CHUNK: 20MiB, or "
                        "under a budget below 1.25 GiB the largest power of two within 1/64 of it (at least 64KiB; "
                        "2MiB on cuda)")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the memory timeline into this PNG file")
    p.add_argument("--trace", default=None, metavar="JSON",
                   help="write a Chrome/Perfetto trace (open in https://ui.perfetto.dev)")
    p.add_argument("--autotune", nargs="?", const="", default=None, metavar="CACHE.json",
                   help="rank convolution algorithms by measuring each once per shape on the backend (like "
                        "cudnnFind), instead of the fixed estimates; with a file, measurements are kept there and "
                        "reused, which makes later plans deterministic")
    p.add_argument("--fused-update", default="auto", choices=("auto", "on", "off"),
                   help="run each layer's optimizer update right after its backward, so a gradient lives only "
                        "between the two (auto: on for policy auto under a budget)")
    p.add_argument("--micro-batches", type=int, default=None, metavar="M",
                   help="split each batch into M micro-batches: policy packs runs them pack by pack (Harmony; it "
                        "chooses M when not given), the other policies accumulate (each micro-batch's forward, "
                        "then its backward)")


def _math_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--math", default="fp32", choices=("fp32", "tf32"),
                   help="float32 arithmetic (fp32) or TF32 tensor cores for convolutions and matrix products "
                        "(tf32, PyTorch's default for convolutions; --backend cuda only)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .memory.policies import policies_help

    ap = _Parser(prog="minidl", description=__doc__.splitlines()[0], formatter_class=_Formatter,
                 epilog=policies_help())
    ap.add_argument("--version", action="version", version=f"minidl {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="layer table of a model", formatter_class=_Formatter)
    _model_args(p)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p = sub.add_parser("plan", help="plan memory for a model (no compute)", formatter_class=_Formatter,
                       epilog=policies_help())
    _model_args(p)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    _memory_args(p, "liveness")
    p.add_argument("--weights-on-device", action="store_true",
                   help="keep weights and optimizer state on the device: auto does not home them on the host when "
                        "nothing else fits (SuperNeurons' and nnabla's setting; minidl reproduce plans this way)")
    p.add_argument("--device", default="k40c",
                   help=f"device profile for time estimates ({', '.join(PROFILES)}; measured: this GPU's "
                        "link measured first, with --backend cuda)")
    p.add_argument("--explain", nargs="?", const="", default=None, metavar="NAME",
                   help="say step by step what is allocated and freed, and why; with NAME (a layer or tensor name, "
                        "or a glob such as 'layer3.1*') only that one's steps and events. Plans of more than 600 "
                        "steps are summarized unless --explain-full")
    p.add_argument("--explain-steps", default=None, metavar="A:B", help="explain only route steps A to B-1")
    p.add_argument("--explain-full", action="store_true", help="explain every step, however long the plan")
    p.add_argument("--max-micro-batches", type=_positive_int, default=None, metavar="M",
                   help="the most micro-batches auto may split the batch into by itself when no single-batch plan "
                        "fits (default: any count dividing the batch; 1: never)")
    p.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="plan one rank of an N-rank data-parallel job: gradient buckets and their all-reduce events")
    p.add_argument("--bucket-size", type=_size, default=None, metavar="SIZE",
                   help="with --ranks: gradient bucket size (default 1MiB)")
    p.add_argument("--reduction", default="ring", choices=("ring", "gather"),
                   help="with --ranks: how buckets are reduced (both sum in rank order; see docs/multi-process.md)")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"),
                   help="whose state (momentum, Adam's moments) the plan holds")
    p.add_argument("--devices", type=_positive_int, default=None, metavar="N",
                   help="simulate Harmony's pipeline over N devices of --device's profile (layer packs on devices "
                        "round robin, activations passed device to device, --budget per device) against N "
                        "data-parallel replicas planned by auto (memory/schedulers/pipeline.py)")
    p.add_argument("--backend", default="cpu", choices=("cpu", "cuda"),
                   help="whose convolution algorithms (and workspace sizes) the plan chooses among; cuda asks "
                        "cuDNN and needs a GPU")
    _math_arg(p)
    p = sub.add_parser("train", help="train a model", formatter_class=_Formatter, epilog=policies_help())
    _model_args(p)
    _memory_args(p, "liveness")
    p.add_argument("--steps", type=_positive_int, default=20, help="training steps (one mini-batch each)")
    p.add_argument("--seed", type=int, default=0,
                   help="fixes initialization, data order, dropout and bert's masks: same seed, bit-identical "
                        "parameters")
    p.add_argument("--data", default="synthetic",
                   help="synthetic | digits | cifar10:DIR | mnist:DIR | npz:PATH.npz (arrays x, y; x_test, y_test "
                        "held out) | npy:IMAGES.npy,LABELS.npy | images:DIR (DIR/CLASS/*.png, or DIR/train/ and "
                        "DIR/test/); held out: the test part, else 20%% split by --seed. A sequence model (gpt2, "
                        "bert): stdlib (Python's own sources, the default for them) | text:PATH (a text file), as "
                        "bytes in --seq token sequences, the last 10%% held out; gpt2 predicts each next token, "
                        "bert the tokens masked (15%%, BERT's rule)")
    p.add_argument("--augment", type=_augment, default=None, metavar="crop,flip",
                   help="augment the training batches: crop (pad 4 pixels, crop back at a random offset), crop:N "
                        "(pad N), flip (mirror half the images); drawn from --seed and each batch's place in the "
                        "data order, so a resumed run augments as an uninterrupted one")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (the schedule's starting point)")
    p.add_argument("--lr-schedule", default="constant", choices=SCHEDULES,
                   help="constant; step: x --lr-gamma every --lr-step-size steps; cosine: down to --lr-min over "
                        "the steps after the warm-up (PyTorch's StepLR / CosineAnnealingLR). A schedule spans the "
                        "run from step 0 to its last step (with --resume: the checkpoint's step + --steps)")
    p.add_argument("--warmup-steps", type=_count, default=0,
                   help="linear warm-up from lr/3 over this many steps before the schedule (PyTorch's LinearLR)")
    p.add_argument("--lr-step-size", type=_positive_int, default=None,
                   help="steps between decays of --lr-schedule step (default: a third of the steps after warm-up)")
    p.add_argument("--lr-gamma", type=float, default=0.1, help="decay factor of --lr-schedule step")
    p.add_argument("--lr-min", type=float, default=0.0, help="final learning rate of --lr-schedule cosine")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"), help="the optimizer")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (ignored by adam)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="L2 weight decay")
    p.add_argument("--save", default=None, metavar="PATH.npz",
                   help="write a checkpoint (parameters, BN statistics, optimizer state, data position) at the end, "
                        "every --save-every steps, and on Ctrl-C (the last completed step)")
    p.add_argument("--save-every", type=_positive_int, default=None, metavar="N",
                   help="also write the --save checkpoint every N steps")
    p.add_argument("--early-stop", type=_positive_int, default=None, metavar="PATIENCE",
                   help="stop once PATIENCE evaluations of the held-out loss in a row have not improved on the best "
                        "(needs --data with a held-out part); with --save, the best state is also written to "
                        "PATH.best.npz each time the held-out loss improves")
    p.add_argument("--eval-every", type=_positive_int, default=None, metavar="N",
                   help="with --early-stop: evaluate the held-out loss every N steps (default: once per epoch)")
    p.add_argument("--log", default=None, metavar="PATH.csv",
                   help="write one CSV row per step as it ends: iteration, loss, lr, step time, images/s and the "
                        "step's host copies (bytes, copy time, the time the step waited for them)")
    p.add_argument("--resume", default=None, metavar="PATH.npz", help="resume from a checkpoint written by --save")
    p.add_argument("--resume-params-only", action="store_true",
                   help="with --resume: load only the parameters (fresh optimizer state, data order from the "
                        "start), e.g. to continue with another optimizer")
    p.add_argument("--backend", default="cpu", choices=("cpu", "cuda"), help="where the steps run")
    _math_arg(p)
    p.add_argument("--cuda-graph", default="on", choices=("on", "off"),
                   help="on CUDA, capture the compiled step once as CUDA graphs and replay them (off: launch every "
                        "kernel from Python each step); a plan that cannot be captured says why")
    p.add_argument("--device", default=None,
                   help="simulator profile the policy's timing decisions assume (default: the backend's own); "
                        "'measured' (--backend cuda): this GPU's host link, measured before planning "
                        "(memory/calibrate.py)")
    p.add_argument("--debug", action="store_true",
                   help="poison freed memory, check residency, and show the traceback of an error")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none anyway when stderr is not a terminal, or with --json)")
    p.add_argument("--host-limit", type=_size, default=None, metavar="SIZE",
                   help="host RAM for offloaded tensors; beyond it they spill to a memory-mapped file (disk tier; "
                        "default: no limit)")
    p.add_argument("--dist", default="auto", choices=("auto", "off", "mpi", "nccl"),
                   help="data parallel: auto = one rank per process under mpiexec (NCCL with --backend cuda), "
                        "else a single process; --batch is per rank")
    p.add_argument("--bucket-size", type=_size, default=None, metavar="SIZE",
                   help="data parallel: gradient bucket size for the overlapped all-reduce (default 1MiB)")
    p.add_argument("--reduction", default=None, choices=("ring", "gather"),
                   help="data parallel: reduce-scatter + all-gather (ring; the default beyond 2 ranks on MPI) or "
                        "an all-gather of whole rows (gather; up to 2 ranks, and NCCL's); both sum in rank order, "
                        "so both give the same bits")
    p.add_argument("--comm-timeout", type=float, default=300.0, metavar="S",
                   help="data parallel: seconds a rank waits for the others before stopping the job")
    _infer_parsers(sub)
    _reproduce_parser(sub)
    return ap


def _reproduce_parser(sub) -> None:
    from .reproduce import PAPERS

    p = sub.add_parser("reproduce", help="a paper's tables on its own setup, our figures beside the paper's",
                       formatter_class=_Formatter,
                       epilog="papers:\n" + "\n".join(f"  {k:<13} {v.title}" for k, v in PAPERS.items()))
    p.add_argument("paper", choices=tuple(PAPERS), metavar="PAPER", help=f"one of: {', '.join(PAPERS)}")
    p.add_argument("--quick", action="store_true",
                   help="only the rows a test re-runs (seconds to a minute); the full run takes minutes")
    p.add_argument("--out", default="benchmarks/results", metavar="DIR",
                   help="where PAPER.json and PAPER.md are written (created if missing)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")


def cmd_reproduce(args) -> dict:
    """Run one paper's reproduction; progress on stderr (a full run plans hundreds of networks)."""
    from .reproduce import reproduce

    report, written = reproduce(args.paper, args.quick, args.out,
                                log=lambda s: print(s, file=sys.stderr, flush=True))
    if not args.json:
        print(report.format_text())
        print("written: " + ", ".join(str(w) for w in written))
    return {**report.to_json(), "written": [str(w) for w in written]}


def _infer_parsers(sub) -> None:
    """`minidl evaluate` and `minidl predict`: a checkpoint written by `train --save`, on held-out data or images."""
    for name, what in (("evaluate", "mean loss and accuracy of a checkpoint on every held-out sample of --data (the "
                                    "training run's own evaluation)"),
                       ("predict", "predicted classes of a checkpoint for images (--input) or a data set (--data)")):
        p = sub.add_parser(name, help=what, formatter_class=_Formatter)
        _model_args(p)
        p.add_argument("--checkpoint", required=True, metavar="PATH.npz",
                       help="a checkpoint written by minidl train --save, of the network the model options build "
                            "(the same MODEL and options as the training run; --batch defaults to its batch)")
        p.add_argument("--seed", type=int, default=None,
                       help="the held-out split of --data digits, npz, npy or images without a test part (default: "
                            "the checkpoint's seed, so the held-out samples are the training run's)")
        p.add_argument("--backend", default="cpu", choices=("cpu", "cuda"), help="where the network runs")
        _math_arg(p)
        p.add_argument("--debug", action="store_true", help="show the traceback of an error")
        if name == "evaluate":
            p.add_argument("--data", required=True,
                           help="digits | cifar10:DIR | mnist:DIR | npz:PATH | npy:IMAGES,LABELS | images:DIR, or for "
                                "a sequence model stdlib | text:PATH: its held-out samples (bert: masked-token loss "
                                "and accuracy, on masks fixed whatever the seed)")
        else:
            p.add_argument("--data", default=None,
                           help="digits | cifar10:DIR | mnist:DIR | npz:PATH | npy:IMAGES,LABELS | images:DIR: its "
                                "held-out samples (else its training samples), with their labels (accuracy)")
            p.add_argument("--input", default=None, metavar="IMAGES.npy",
                           help="a float array of images (N, C, H, W), instead of --data")
            p.add_argument("--output", default=None, metavar="CLASSES.npy", help="write the classes (int64, N)")
            p.add_argument("--limit", type=_count, default=10, help="classes printed (0: all; --json lists all)")


def _build(args, image_shape=None, num_classes=None):
    from minidl.models import SEQUENCE_OPTIONS, build_model

    kw = dict(depth=args.depth, batch=args.batch, image_size=args.image_size, num_classes=args.num_classes,
              in_channels=args.in_channels)
    if image_shape is not None:
        kw["in_channels"] = kw["in_channels"] or image_shape[0]
        kw["image_size"] = kw["image_size"] or image_shape[1]
    if num_classes is not None:
        kw["num_classes"] = kw["num_classes"] or num_classes
    kw.update({k: getattr(args, k) for k in SEQUENCE_OPTIONS if getattr(args, k, None) is not None})
    return build_model(args.model, **kw)


def cmd_info(args) -> dict:
    from .graph.summary import summarize

    summary = summarize(_build(args), name=args.model)  # the same table as Network.summary()
    if not args.json:
        print(summary.format())
    return {"model": args.model, **summary.to_json()}


def _memory_json(plan) -> dict:
    from .memory.decisions.weights import moved_by_role
    from .memory.report import memory_report

    rep = memory_report(plan)
    return {"policy": plan.policy, "peak_bytes": plan.peak_bytes, "min_budget_bytes": plan.min_budget_bytes,
            "lower_bound_bytes": plan.lower_bound_bytes, "arena_bytes": plan.arena_bytes,
            "by_role": rep.by_role, "peak_at": rep.peak_at, "binding_step": rep.binding_step,
            "fragmentation": rep.fragmentation,
            "largest_at_peak": rep.to_json()["largest_at_peak"],
            "offloaded_bytes": plan.offloaded_bytes, "prefetched_bytes": plan.prefetched_bytes,
            "fused_update": plan.route.fused_update, "moved_bytes_by_role": moved_by_role(plan),
            "micro_batches": plan.route.micro_batches,
            "decision": plan.decision,
            "packs": (plan.route.packing.packs or None) if plan.route.packing is not None else None,  # none: accumulate
            **({"paged_chunk_bytes": plan.paged.chunk_bytes, "live_peak_bytes": plan.paged.live_peak_bytes}
               if plan.paged else {})}


def _costs(args, backend):
    """The cost table `--autotune` asks for (None: the algorithms' fixed estimates)."""
    if args.autotune is None:
        return None
    from .memory.workspace import CostTable

    return CostTable(autotune=True, path=args.autotune or None, backend=backend)


def _moved_line(moved: dict[str, int]) -> str:
    """Bytes copied between device and host per step, by role (weights, optimizer state, ...)."""
    from .memory.decisions.weights import moved_words
    from .memory.pool import format_bytes

    return "  moved per step: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}"
                                           for k, v in moved_words(moved).items())


def _fused(args) -> bool | None:
    """--fused-update on/off/auto -> True/False/None (None: the planner decides)."""
    return {"on": True, "off": False}.get(args.fused_update)


def cmd_plan(args) -> dict:
    from .memory.policies import plan_network
    from .memory.report import explain, memory_report, plot_timeline, write_trace
    from .memory.report.fit import check_fit
    from .memory.simulate import simulate
    from .optim import make_optimizer

    t = time.perf_counter()
    net = _build(args)
    opt = make_optimizer(args.optimizer, 0.01)
    if args.devices is not None:
        return _plan_devices(args, net, opt)
    backend = None
    if args.backend != "cpu":
        from .backend import get_backend

        backend = get_backend(args.backend, math=args.math)
    else:
        from .backend.mathmode import apply_math

        apply_math(None, args.math)  # the CPU computes in fp32 only: refuses tf32, naming --math
    dp = None
    if args.ranks is not None:
        from .memory.decisions.allreduce import DEFAULT_BUCKET_BYTES, DataParallel

        dp = DataParallel(args.ranks, args.bucket_size or DEFAULT_BUCKET_BYTES, args.reduction)
    costs, device = _costs(args, backend), args.device
    if device == "measured":   # this GPU's host link (and, with --autotune, efficiency) measured before planning
        if backend is None:
            raise OptionError("--device measured measures a GPU's host link: give --backend cuda")
        device = _measured_device(net, opt, backend, costs)
    elif costs is None and args.policy != "packs":
        # A GPU profile planned here sizes cuDNN's modeled workspaces (memory/cudnn_model.py); with --autotune the
        # menu stays that of the backend that measures, and policy packs plans its own routes on the CPU's menu.
        from .memory.cudnn_model import planning_backend

        backend = planning_backend(device, backend)
    what = (f"planning {args.model}{f'-{args.depth}' if args.depth else ''} ({len(net.layer_nodes)} layers), policy "
            f"{args.policy}" + (f", budget {format_bytes(args.budget)}" if args.budget is not None else ""))
    def plan_at(policy: str, budget: int | None):
        return plan_network(net, opt, policy, budget, device=device, backend=backend, costs=costs,
                            fused_update=_fused(args), paged=args.paged, data_parallel=dp,
                            micro_batches=args.micro_batches, max_micro_batches=args.max_micro_batches,
                            host_weights=not args.weights_on_device)

    with _ProgressLine(what, enabled=not args.json and sys.stderr.isatty()):
        plan = plan_at(args.policy, args.budget)
        sim = simulate(plan, device)
        fit = check_fit(plan, sim.device, args.budget, plan_at)   # and, if not on the device, what would
    out = {**_memory_json(plan), **fit.to_json()}
    if dp is not None:
        from .memory.decisions.allreduce import allreduce_timeline

        comm = allreduce_timeline(plan, device)
        out.update({"ranks": dp.world_size, "buckets": len(plan.buckets), "est_allreduce_s": comm.total_s,
                    "est_allreduce_exposed_s": comm.exposed_s,
                    "est_allreduce_hidden_fraction": comm.hidden_fraction, "interconnect_bw": comm.link.bw,
                    "est_step_time_with_allreduce_s": sim.est_step_time_s + comm.exposed_s})
    out.update({"model": args.model, "device": args.device, "backend": args.backend, "math": args.math,
                "est_step_time_s": sim.est_step_time_s,
                "fits_device": sim.fits_device, "planning_time_s": time.perf_counter() - t,
                "transfer_hidden_fraction": sim.transfer_hidden_fraction, "exposed_transfer_s": sim.exposed_transfer_s,
                "copy_bandwidth_bytes_per_s": sim.device.link_bw if sim.transfer_time_s else 0.0,
                "steps": len(plan.route.steps), "recompute_flops_share": sim.recompute_flops_share})
    if args.plot:
        plot_timeline(plan, args.plot, title=_plot_title(args, plan), budget=args.budget)
        out["plot"] = args.plot
    if args.trace:
        write_trace(args.trace, plan, device=device)
        out["trace"] = args.trace
    if args.explain is not None or args.explain_steps or args.explain_full:
        from .memory.report.explain import parse_steps

        rng = parse_steps(args.explain_steps) if args.explain_steps else None
        text = explain(plan, select=args.explain or None, steps=rng, full=True if args.explain_full else None)
        out["explain"] = text
        if not args.json:
            print(text)
    if not args.json:
        print(memory_report(plan).format())
        print(_moved_line(out["moved_bytes_by_role"]))
        print(f"  estimated step time on {args.device}: {sim.est_step_time_s * 1e3:.1f} ms "
              f"(planned in {out['planning_time_s']:.1f} s; math {args.math})")
        if sim.transfer_time_s:
            print(f"  host transfers   {sim.transfer_time_s:.3f} s on the link, {sim.exposed_transfer_s:.3f} s exposed "
                  f"(the step waits for them), {sim.transfer_hidden_fraction:.1%} hidden behind compute")
        if dp is not None:
            print(f"  all-reduce       {out['ranks']} ranks, {out['buckets']} buckets: {out['est_allreduce_s']:.4f} s "
                  f"at {out['interconnect_bw'] / 1e9:g} GB/s, {out['est_allreduce_exposed_s']:.4f} s exposed, "
                  f"{out['est_allreduce_hidden_fraction']:.1%} hidden behind backward")
        print(fit.format())
    _say_written(args, [("memory timeline", out.get("plot")), ("trace", out.get("trace"))])
    return out


def _plan_devices(args, net, opt) -> dict:
    """`minidl plan --devices N`: the pipeline and the replicas baseline (see memory/schedulers/pipeline.py)."""
    from .memory.schedulers.pipeline import (
        OBJECTIVES,
        comparison_lines,
        least_swap_lines,
        pipeline_json,
        plan_replicas,
        search_pipeline,
    )

    batch = net.input_nodes[0].shape[0]
    if batch % args.devices:
        raise OptionError(f"--devices {args.devices}: the batch of {batch} must divide among the replicas")
    slots = tuple(opt.slots)
    found = search_pipeline(net, args.devices, args.budget, args.device, slots, args.micro_batches)
    pipe, lean = (min(found, key=OBJECTIVES[o]) for o in ("time", "swap"))
    replica = _build(argparse.Namespace(**{**vars(args), "batch": batch // args.devices}))
    base = plan_replicas(replica, args.devices, args.budget, args.device, slots)
    out = {"model": args.model, "device": args.device, **pipeline_json(pipe, base),
           "least_swap": pipeline_json(lean, None)}
    if not args.json:
        print("\n".join(comparison_lines(pipe, base) + least_swap_lines(lean, pipe)))
    return out


class _ProgressLine:
    """On a terminal, a line on stderr that says what is being planned and for how long, once it has taken more
    than `AFTER_S` (ResNet-2500 takes seconds); erased when done. Never in --json output or a pipe."""

    AFTER_S = 1.0
    EVERY_S = 0.5

    def __init__(self, what: str, enabled: bool):
        import threading

        self.what, self.enabled = what, enabled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True) if enabled else None
        self._shown = False

    def _run(self) -> None:
        t0 = time.perf_counter()
        if self._stop.wait(self.AFTER_S):
            return
        while not self._stop.is_set():
            sys.stderr.write(f"\r{self.what}... {time.perf_counter() - t0:.1f} s")
            sys.stderr.flush()
            self._shown = True
            self._stop.wait(self.EVERY_S)

    def __enter__(self):
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            if self._shown:
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()


def _plot_title(args, plan) -> str:
    """Model, depth and batch: what a reader needs to tell two timelines apart (the plot adds budget and policy)."""
    batch = plan.route.network.input_nodes[0].shape[0]
    return f"{args.model}{f'-{args.depth}' if args.depth else ''}, batch {batch}"


def _say_written(args, written: list[tuple[str, object]]) -> None:
    """End the text output with what was written where (a user should never have to guess a file's path)."""
    if not args.json:
        for what, path in written:
            if path is not None:
                print(f"wrote {what}: {path}")


def _checkpoint_meta(args) -> dict:
    """The --checkpoint's metadata (its manifest verified, the arrays not read yet); --seed defaults to its seed,
    so the held-out split of --data digits is the training run's."""
    from .checkpoint import read_manifest

    if not Path(args.checkpoint).expanduser().is_file():
        raise OptionError(f"--checkpoint: no checkpoint file at {args.checkpoint}")
    meta = read_manifest(args.checkpoint).get("meta", {})
    if args.seed is None:
        args.seed = meta.get("seed", 0)
    return meta


def _checkpoint_session(args, meta: dict, image_shape, num_classes):
    """A session of the checkpoint's network with its parameters and BN statistics (parameters only: no optimizer
    state or data position is needed to infer), at the checkpoint's batch unless --batch says otherwise."""
    from minidl.models import is_sequence_model

    from .backend import get_backend
    from .optim import make_optimizer
    from .runtime.session import RunConfig, Session

    args.batch = args.batch or max(1, meta.get("batch", 32) // max(1, meta.get("ranks", 1)))
    saved = meta.get("data") or {}
    if is_sequence_model(args.model):  # the sequence length it trained on (its data's sample shape is (T,))
        if args.seq is None and len(saved.get("image_shape", ())) == 1:
            args.seq = int(saved["image_shape"][0])
        net = _build(args, None, num_classes or saved.get("num_classes"))
    else:
        net = _build(args, image_shape or tuple(saved.get("image_shape", ())) or None,
                     num_classes or saved.get("num_classes"))
    backend = get_backend(args.backend, math=args.math)
    sess = Session(net, make_optimizer("sgd", 0.0), policy="liveness", seed=args.seed, backend=backend, math=args.math,
                   config=RunConfig(debug=args.debug))
    sess.load(args.checkpoint, params_only=True)
    return sess


def cmd_evaluate(args) -> dict:
    """The held-out loss and accuracy, computed as `train` computes them at its end (Session.evaluate, every
    sample, the split of the checkpoint's seed), so a checkpoint's accuracy is the one its run printed."""
    from minidl.models import model_objective

    from .data import load_data
    from .data_text import MASKED, text_vocab

    meta = _checkpoint_meta(args)
    objective = model_objective(args.model)
    if objective is not None:  # the network first: its sequence length cuts the text
        sess = _checkpoint_session(args, meta, None, text_vocab(objective))
        _, heldout = load_data(args.data, seed=args.seed, seq=sess.net.input_nodes[0].shape[1], objective=objective)
    else:
        _, heldout = load_data(args.data, seed=args.seed)
    if heldout is None:
        raise OptionError(f"--data {args.data}: has no held-out samples to evaluate on (digits holds out 20%; "
                          f"cifar10:DIR and mnist:DIR need their test files in DIR)")
    if objective is None:
        sess = _checkpoint_session(args, meta, heldout.image_shape, heldout.num_classes)
    loss, acc = sess.evaluate(heldout)
    out = {"model": args.model, "checkpoint": args.checkpoint, "iteration": meta.get("iteration"),
           "data": args.data, "samples": len(heldout)}
    if objective == MASKED:
        out.update(_token_figures(objective, loss, acc, heldout))
        if not args.json:
            print(f"{args.checkpoint} (step {meta.get('iteration')}): held-out masked-token loss {loss:.4f}, "
                  f"masked-token accuracy {acc:.2%}, over the {out['masked_tokens']:,} masked tokens of "
                  f"{len(heldout)} sequences of --data {args.data}")
        return out
    if objective is not None:
        out.update(_token_figures(objective, loss, acc, heldout))
        if not args.json:
            print(f"{args.checkpoint} (step {meta.get('iteration')}): held-out loss {loss:.4f} per token "
                  f"(perplexity {out['perplexity']:.2f}), next-token accuracy {acc:.2%}, on {len(heldout)} "
                  f"sequences of --data {args.data}")
        return out
    out.update({"loss": loss, "accuracy": acc})
    if not args.json:
        print(f"{args.checkpoint} (step {meta.get('iteration')}): held-out accuracy {acc:.2%}, mean loss "
              f"{loss:.4f}, on {len(heldout)} samples of --data {args.data}")
    return out


def cmd_predict(args) -> dict:
    """Classes (argmax of the logits, in inference mode) for --input images or a --data set's samples."""
    import numpy as np

    from minidl.models import is_sequence_model

    from .data import load_data

    if is_sequence_model(args.model):
        raise OptionError(f"predict gives the classes of images; model '{args.model}' reads token sequences: "
                          f"minidl evaluate gives its held-out loss and accuracy")
    if (args.input is None) == (args.data is None):
        raise OptionError("predict: give either --input IMAGES.npy or --data SPEC")
    meta = _checkpoint_meta(args)
    labels = None
    if args.input is not None:
        try:
            x = np.load(Path(args.input).expanduser(), allow_pickle=False)
        except (OSError, ValueError) as e:
            raise OptionError(f"--input {args.input}: not a readable .npy array ({e})") from None
        if x.ndim != 4:
            raise OptionError(f"--input {args.input}: images must be an array (N, C, H, W), got shape {x.shape}")
        sess = _checkpoint_session(args, meta, tuple(x.shape[1:]), None)
    else:
        train, heldout = load_data(args.data, seed=args.seed)
        data = heldout if heldout is not None else train
        x, labels = data.x, data.y
        sess = _checkpoint_session(args, meta, data.image_shape, data.num_classes)
    classes = sess.predict_classes(x)
    out = {"model": args.model, "checkpoint": args.checkpoint, "iteration": meta.get("iteration"),
           "count": len(classes), "classes": classes.tolist()}
    if labels is not None:
        out["accuracy"] = float((classes == labels).mean()) if len(classes) else None
    if args.output:
        np.save(args.output, classes)
        out["output"] = args.output
    if not args.json:
        shown = classes if args.limit == 0 else classes[:args.limit]
        print(f"{len(classes)} predictions" + (f", accuracy {out['accuracy']:.2%}" if labels is not None else "")
              + f"; the first {len(shown)}: " + " ".join(map(str, shown.tolist())))
    _say_written(args, [("classes", args.output)])
    return out


def cmd_train(args) -> dict:
    from .backend import get_backend
    from .dist.launch import communicator, guarded, with_nccl

    comm = communicator(args.dist, args.comm_timeout)  # None: one plain process (not under mpiexec)
    backend = get_backend(args.backend, device=comm.local_rank if comm is not None else 0, math=args.math)
    comm = with_nccl(comm, backend, args.dist)
    return guarded(comm, lambda: _train(args, backend, comm))


def _measured_device(net, opt, backend, costs):
    """`--device measured`: the host link measured on the GPU; with --autotune, the convolutions measured first
    (the plan then reuses the cache) and the roofline's efficiency fitted to them (memory/calibrate.py)."""
    from .memory.calibrate import measured_profile
    from .memory.workspace import workspace_choices

    route = None
    if costs is not None and costs.autotune:
        route = net.route(True, tuple(opt.slots), backend=backend)
        workspace_choices(route, costs)
    return measured_profile(backend, costs=costs, route=route)


@dataclass(slots=True)
class _TrainInputs:
    """What `_train_inputs` checked and built before any session exists: the network, the optimizer, the data
    (`heldout` None when the source has no held-out part) and the device profile and cost table to plan with."""

    net: object
    opt: object
    train: object
    heldout: object
    device: object
    costs: object


def _train(args, backend, comm) -> dict:
    """`minidl train`: inputs checked, then the run, then what it reports (three steps, so an option added to
    one of them does not have to be read among the other two)."""
    inputs = _train_inputs(args, backend)
    sess, res, log = _train_run(args, inputs, backend, comm)
    return _train_report(args, sess, res, log, inputs.heldout, comm, inputs.train)


def _train_inputs(args, backend) -> _TrainInputs:
    """Validate the options against the data and build what the session is made of, so that every user error
    (a batch larger than the data, a missing --resume file, --save-every without --save) comes before planning."""
    from minidl.models import is_sequence_model

    from .data import load_data
    from .optim import make_optimizer

    batch = args.batch or 32
    args.batch = batch
    if is_sequence_model(args.model):
        train, heldout, net = _sequence_inputs(args)
    elif args.data != "synthetic":
        train, heldout = load_data(args.data, seed=args.seed, augment=args.augment)
        net = _build(args, train.image_shape, train.num_classes)
    else:
        net = _build(args)
        shape = net.input_nodes[0].shape[1:]
        k = net.logits_node.shape[1]
        train, heldout = load_data("synthetic", seed=args.seed, image_shape=shape, num_classes=k,
                                   num_samples=max(4 * batch, 256), augment=args.augment)
    if len(train) < batch:
        raise OptionError(f"--batch {batch} exceeds the {len(train)} training samples of --data {args.data}; "
                          f"lower --batch")
    if args.resume and not Path(args.resume).expanduser().is_file():
        raise OptionError(f"--resume: no checkpoint file at {args.resume}")
    if args.save_every and not args.save:
        raise OptionError("--save-every needs --save PATH.npz: the path the checkpoints are written to")
    if args.eval_every and not args.early_stop:
        raise OptionError("--eval-every sets how often --early-stop evaluates: give --early-stop PATIENCE too")
    if args.early_stop and heldout is None:
        raise OptionError(f"--early-stop watches the held-out loss, but --data {args.data} has no held-out part "
                          f"(digits, npz, npy and images have one; cifar10:DIR and mnist:DIR need their test files)")
    opt = make_optimizer(args.optimizer, args.lr, args.momentum, args.weight_decay)
    device, costs = args.device, _costs(args, backend)
    if device == "measured":   # the simulator's link figures (and, with --autotune, efficiency) from this GPU
        device = _measured_device(net, opt, backend, costs)
    return _TrainInputs(net, opt, train, heldout, device, costs)


def _sequence_inputs(args):
    """A language model's data: byte-level text (`--data stdlib`, the default, or `text:PATH`) in sequences of the
    network's length, with the targets of the model's objective (gpt2: next tokens, bert: masked tokens), and the
    network with that objective's vocabulary (256 bytes; bert's adds [MASK])."""
    from minidl.models import model_objective

    from .data import load_data
    from .data_text import text_vocab

    if args.data == "synthetic":
        args.data = "stdlib"
    if args.data.partition(":")[0].strip().lower() not in ("stdlib", "text"):
        raise OptionError(f"--data {args.data}: model '{args.model}' reads token sequences; give --data stdlib "
                          f"(Python's own sources) or --data text:PATH")
    objective = model_objective(args.model)
    vocab = text_vocab(objective)
    if args.num_classes not in (None, vocab):
        raise OptionError(f"--num-classes {args.num_classes}: --data {args.data} is byte-level text, a vocabulary "
                          f"of {vocab} for {objective} targets" + (" (256 bytes and [MASK])" if vocab > 256 else ""))
    net = _build(args, num_classes=vocab)
    train, heldout = load_data(args.data, seed=args.seed, augment=args.augment, seq=net.input_nodes[0].shape[1],
                               objective=objective)
    return train, heldout, net


def _token_figures(objective: str, loss: float, accuracy: float, heldout, train=None, held: str = "") -> dict:
    """A language model's held-out figures, named for what they measure: next-token loss, perplexity and accuracy
    over every token; or masked-token loss and accuracy over the masked tokens alone (no perplexity: the masked
    tokens are not a text's likelihood). `train`: with the unigram model's loss; `held`: the prefix of the losses."""
    from .data_text import MASKED, perplexity, unigram_loss
    from .layers import IGNORE_INDEX

    if objective == MASKED:
        out = {"objective": objective, f"{held}masked_token_loss": loss, f"{held}masked_token_accuracy": accuracy,
               "masked_tokens": int((heldout.y != IGNORE_INDEX).sum())}
        if train is not None:
            out["unigram_masked_token_loss"] = unigram_loss(train, heldout)
        return out
    out = {"objective": objective, f"{held}loss": loss, "accuracy": accuracy, "perplexity": perplexity(loss)}
    if train is not None:
        out["unigram_loss"] = unigram_loss(train, heldout)
    return out


def _best_path(save: str) -> Path:
    """Where --early-stop keeps the best state beside --save: r.npz -> r.best.npz."""
    p = Path(save)
    return p.with_name(f"{p.stem}.best{p.suffix or '.npz'}")


def _train_run(args, inputs: _TrainInputs, backend, comm):
    """Plan and train: the session, fit's result and the step log (None without --log, or on a rank other than
    0). On divergence the last good state is saved when --save is given, and the error says where."""
    import numpy as np

    from .optim.schedules import make_schedule
    from .runtime.session import RunConfig, Session
    from .runtime.steplog import StepLog

    config = RunConfig(debug=args.debug, trace=bool(args.trace), host_limit_bytes=args.host_limit,
                       costs=inputs.costs, fused_update=_fused(args), paged=args.paged,
                       bucket_bytes=args.bucket_size, reduction=args.reduction, graphs=args.cuda_graph == "on")
    sess = Session(inputs.net, inputs.opt, policy=args.policy, budget=args.budget, seed=args.seed, backend=backend,
                   device=inputs.device, comm=comm, micro_batches=args.micro_batches, math=args.math, config=config)
    lead = comm is None or comm.rank == 0  # under mpiexec, rank 0 alone reports, plots and traces
    args.quiet = not lead
    if args.resume:
        sess.load(args.resume, params_only=args.resume_params_only)
    # The schedule spans the whole run, from step 0 to this invocation's last step: a run stopped at step k and
    # resumed with --steps (N - k) and the same options follows the schedule of the uninterrupted N steps.
    sess.lr_schedule = make_schedule(args.lr_schedule, sess.iteration + args.steps, args.warmup_steps,
                                     args.lr_step_size, args.lr_gamma, args.lr_min)
    log = StepLog(args.log, sess) if args.log and lead else None
    early = None
    if args.early_stop:
        from .runtime.earlystop import EarlyStop

        early = EarlyStop(args.early_stop, args.eval_every, best_path=_best_path(args.save) if args.save else None)
    try:  # numpy's overflow warnings would say less than the divergence guard, and say it many times
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            res = sess.fit(inputs.train, args.steps, progress=lead and not args.no_progress and not args.json
                           and sys.stderr.isatty(), on_step=log,
                           save_every=args.save_every, save_path=args.save, heldout=inputs.heldout,
                           early_stop=early)
    except DivergenceError as e:  # the update was not applied: what is saved is the last good state
        if args.save:
            e.args = (f"{e}; the last good state (after step {e.iteration - 1}) is saved in "
                      f"{sess.save(args.save)}",)
        raise
    finally:
        if log is not None:
            log.close()
    return sess, res, log


def _train_report(args, sess, res, log, heldout, comm, train=None) -> dict:
    """The run's JSON fields, the files written at its end (checkpoint, plot, trace) and, without --json, the
    text summary; ranks other than 0 return their fields without writing or printing (`args.quiet`)."""
    from minidl.models import model_objective

    from .data_text import SequenceDataset
    from .memory.host import transfer_json
    from .memory.report import plot_timeline, write_trace
    from .memory.report.fit import check_fit
    from .memory.simulate import get_profile, simulate

    out = {"model": args.model, "data": args.data, "batch": args.batch, "steps": args.steps,
           "steps_done": res.steps, "interrupted": res.interrupted, "backend": args.backend, "math": sess.math,
           "final_loss": res.final_loss, "step_time_s": res.median_step_time, "images_per_s": res.images_per_s,
           "iteration": sess.executor.iteration, "pool_peak_bytes": sess.executor.pool.peak,
           "step_runner": sess.executor.step_runner, "graph_fallback": sess.executor.graph_fallback,
           "device_profile": getattr(sess.device, "note", sess.device)}
    out.update(_memory_json(sess.plan))
    # The verdict `minidl plan` gives, against the budget and the memory of the device profile the plan was made
    # for: a run under a budget too small never gets here (planning refuses it), so this says by how much it fits.
    device = get_profile(sess.device) if isinstance(sess.device, str) else sess.device
    fit = check_fit(sess.plan, device, args.budget)
    out.update(fit.to_json())
    out["recompute_flops_share"] = simulate(sess.plan, "cpu").recompute_flops_share
    out.update(transfer_json(sess.executor.host, max(res.steps, 1)))  # measured by the transfer engine
    if heldout is not None and not res.interrupted:
        loss, acc = sess.evaluate(heldout)
        if isinstance(heldout, SequenceDataset):  # a language model: its objective's figures, and the bar to clear
            out.update(_token_figures(model_objective(args.model), loss, acc, heldout, train, held="heldout_"))
        else:
            out["accuracy"] = acc
            out["heldout_loss"] = loss
    if comm is not None:
        from .dist.report import dist_json

        out.update(dist_json(sess, res))
    written = []  # (what, path), said in the text output
    if args.save:
        # fit already wrote the last completed step when interrupted or when --save-every fell on it
        already = res.saved and (res.interrupted or (args.save_every and sess.iteration % args.save_every == 0))
        path = res.saved[-1] if already else sess.save(args.save)
        out["saved"] = str(path)
        written.append((f"checkpoint (step {sess.iteration})", path))
    if res.early_stop is not None:
        out["stopped_early"] = res.stopped_early
        out["early_stop"] = res.early_stop.to_json()
        if res.best_saved is not None:
            out["best_saved"] = str(res.best_saved)
            written.append((f"best checkpoint (step {res.early_stop.best_iteration})", res.best_saved))
    if log is not None:
        out["log"] = str(log.path)
        written.append(("step log", log.path))
    if args.quiet:
        return out
    if args.plot:
        plot_timeline(sess.plan, args.plot, title=_plot_title(args, sess.plan), budget=args.budget)
        out["plot"] = args.plot
        written.append(("memory timeline", args.plot))
    if args.trace:
        write_trace(args.trace, sess.plan, sess.executor.trace)
        out["trace"] = args.trace
        written.append(("trace", args.trace))
    if not args.json:
        _print_train_summary(args, sess, res, out, comm, fit)
    _say_written(args, written)
    return out


def _print_train_summary(args, sess, res, out: dict, comm, fit) -> None:
    """The text `minidl train` ends with: the memory report and whether the plan fits (`fit`), the bytes moved,
    loss and speed, what the copies cost, how the steps ran (on a GPU), the ranks' figures, and an interruption."""
    from .memory.host import copies_line

    print(sess.report().format())
    print(fit.format())
    print(_moved_line(out["moved_bytes_by_role"]))
    line = (f"final loss {res.final_loss:.4f}, median step {res.median_step_time * 1e3:.1f} ms "
            f"({sess.math}), {res.images_per_s:.1f} images/s")
    if "perplexity" in out:
        line += (f", held-out loss {out['heldout_loss']:.4f} (perplexity {out['perplexity']:.2f}; a unigram model's "
                 f"{out['unigram_loss']:.4f}), next-token accuracy {out['accuracy']:.2%}")
    elif "heldout_masked_token_loss" in out:
        line += (f", held-out masked-token loss {out['heldout_masked_token_loss']:.4f} (a unigram model's "
                 f"{out['unigram_masked_token_loss']:.4f}), masked-token accuracy "
                 f"{out['heldout_masked_token_accuracy']:.2%} ({out['masked_tokens']:,} masked tokens)")
    elif "accuracy" in out:
        line += f", held-out accuracy {out['accuracy']:.2%}"
    print(line)
    if out["offloaded_bytes"]:   # what the copies cost this run, not only how fast they were
        print("  " + copies_line(out, sum(res.step_times) / len(res.step_times)))   # the waits' mean: a mean
    if args.backend != "cpu":   # how the steps ran: as CUDA graphs, or why not
        gs = sess.executor.graph_step
        print(f"  steps: {gs.describe()}" if gs is not None else
              f"  steps: {sess.executor.step_runner}, no CUDA graph: {sess.executor.graph_fallback}")
    if comm is not None:
        from .dist.report import dist_line

        print(dist_line(out))
    if res.early_stop is not None:
        print(_early_stop_line(res, args.steps))
    if res.interrupted:
        print(f"interrupted after {res.steps} of {args.steps} steps (Ctrl-C)"
              + ("" if args.save else "; nothing saved: give --save PATH.npz to keep the progress"))


def _early_stop_line(res, steps: int) -> str:
    """What early stopping did: when it stopped (or that it did not), and the best held-out loss and its step."""
    w = res.early_stop
    best = (f"best held-out loss {w.best_loss:.4f} at step {w.best_iteration}" if w.best_iteration is not None
            else "no finite held-out loss")
    if res.stopped_early:
        return (f"early stop after {res.steps} of {steps} steps: the held-out loss did not improve in "
                f"{w.rule.patience} evaluations (every {w.every} steps); {best}")
    return f"early stopping watched {len(w.evaluations)} evaluations (every {w.every} steps), no stop; {best}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "cpu_winograd", None) is not None:  # read by cpu_winograd.enabled() when layers are planned
        os.environ["MINIDL_CPU_WINOGRAD"] = "1" if args.cpu_winograd else "0"
    if getattr(args, "threads", None):
        os.environ["MINIDL_CPU_THREADS"] = str(args.threads)  # read by cpu_lanes.count() at every convolution
        import numpy  # noqa: F401 - threadpoolctl limits the libraries already loaded
        from threadpoolctl import threadpool_limits
        threadpool_limits(args.threads, user_api="blas")
    if getattr(args, "cmd", None) in ("plan", "train") and args.policy is None:
        args.policy = "auto" if args.budget is not None else "liveness"  # --budget alone means auto
    if getattr(args, "paged", None) == "auto":   # bare --paged: a chunk the budget can hold many of
        from .memory.paged import chunk_for_budget

        args.paged = chunk_for_budget(args.budget, args.backend)
    if getattr(args, "lossy", False):   # opt-in only: auto weighs compression when asked to
        if args.policy not in ("auto", "auto-lossy"):
            build_parser().error(f"--lossy applies to --policy auto, not {args.policy!r}")
        args.policy = "auto-lossy"
    try:
        check_args(args)
        out = {"info": cmd_info, "plan": cmd_plan, "train": cmd_train, "evaluate": cmd_evaluate,
               "predict": cmd_predict, "reproduce": cmd_reproduce}[args.cmd](args)
    except (MinidlError, ValueError, OSError) as e:  # user errors: one line (a bug keeps its traceback)
        if getattr(args, "debug", False):
            raise
        if getattr(args, "json", False):
            err = {"error": type(e).__name__, "message": str(e)}
            if getattr(e, "min_budget_bytes", None) is not None:
                err["min_budget_bytes"] = e.min_budget_bytes
            print(json.dumps(err))
        else:
            print(f"minidl: error: {' '.join(str(e).split())}", file=sys.stderr)
        return exit_status(e)
    except KeyboardInterrupt:  # outside a training step (planning, evaluating), or a second Ctrl-C in one
        print("\nminidl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.json and not getattr(args, "quiet", False):
        print(json.dumps(out, default=float))
    return EXIT_INTERRUPTED if out.get("interrupted") else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
