"""The `minidl` argument parser: every command's options, their types and help. Building it imports no planner,
backend, data or numpy code: only the tables its choices list (policies, device profiles, papers, schedules, math
modes); an option's type imports what it parses with when the option is given."""
from __future__ import annotations

import argparse

from ..core.errors import EXIT_USER_ERROR, OptionError
from ..core.options import MATH_MODES
from ..memory.policy_table import available_policies, policies_help
from ..memory.profiles import PROFILES
from ..optim.schedules import SCHEDULES
from ..reproduce.registry import PAPERS


def _size(value: str) -> int:
    """argparse type for sizes: its error names the accepted forms, not this function."""
    from ..memory.pool import parse_size

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
    from ..data.augment import parse_augment

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


def _model_args(p: argparse.ArgumentParser, from_checkpoint: bool = False) -> None:
    if from_checkpoint:
        p.add_argument("model", nargs="?", default=None,
                       help="model name (default: the checkpoint's, with the options it was trained with; options "
                            "given here override them, and must build the checkpoint's network)")
    else:
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
    p.add_argument("--keep-scores", choices=("on", "off"), default=None,
                   help="gpt2/bert: keep attention's probabilities (B, H, T, T) for backward (on, the default; a plan "
                        "may still drop and rebuild them) or keep them in no plan (off: backward rebuilds them; on "
                        "CUDA in bf16/fp16 attention then runs cuDNN's fused SDPA)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _memory_args(p: argparse.ArgumentParser, policy_default: str | None) -> None:
    p.add_argument("--policy", default=None, choices=available_policies(),
                   help="memory policy, each described in one line at the end of --help (default: auto when "
                        "--budget is given, else liveness)")
    p.add_argument("--no-cpu-winograd", dest="cpu_winograd", action="store_false", default=None,
                   help="CPU backend: run 3x3 stride-1 convolutions with >= 32 channels as the row-shift pair "
                        "instead of Winograd F(2x2, 3x3), which is the default (faster; other rounding, the same "
                        "guarantees)")
    p.add_argument("--cpu-winograd", dest="cpu_winograd", action="store_true",
                   help="CPU backend: Winograd F(2x2, 3x3) for those convolutions (the default)")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="CPU backend: threads for the convolution lanes, compiled kernels and numpy's BLAS "
                        "(default: the usable cores, at most 8). Results are the same bits whatever N: every split "
                        "is fixed by the shapes, and a step runs the BLAS on one thread a call")
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
                        "reused, which makes later plans deterministic (on a GPU, without a file: in the user cache "
                        "folder, per GPU and math mode)")
    p.add_argument("--fused-update", default="auto", choices=("auto", "on", "off"),
                   help="run each layer's optimizer update right after its backward, so a gradient lives only "
                        "between the two (auto: on for policy auto under a budget)")
    p.add_argument("--micro-batches", type=int, default=None, metavar="M",
                   help="split each batch into M micro-batches: policy packs runs them pack by pack (Harmony; it "
                        "chooses M when not given), the other policies accumulate (each micro-batch's forward, "
                        "then its backward)")


def _math_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--math", default=MATH_MODES[0], choices=MATH_MODES,
                   help="float32 arithmetic (fp32); TF32 tensor cores for convolutions and matrix products "
                        "(tf32, PyTorch's default for convolutions; --backend cuda only); or mixed precision "
                        "(bf16, fp16: half activations, deltas and weight copies, float32 masters, gradients and "
                        "optimizer state; fp16 with a dynamic loss scale)")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

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
    p.add_argument("--device", default=None,
                   help=f"device profile the plan is for: its speeds for time estimates, its memory for the fit "
                        f"({', '.join(PROFILES)}, or NAME:SIZE; measured: this GPU's link measured first, with "
                        f"--backend cuda; default: where train would run, the backend's own: cpu for --backend cpu)")
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
    p.add_argument("--data", default=None,
                   help="synthetic (the default: random images, said on stderr) | digits | cifar10:DIR | mnist:DIR "
                        "| npz:PATH.npz (arrays x, y; x_test, y_test "
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
                   help="write one CSV row per step as it ends: iteration, loss, lr, step time, images/s (tokens/s "
                        "for a language model) and the "
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


def _infer_parsers(sub) -> None:
    """`minidl evaluate` and `minidl predict`: a checkpoint written by `train --save`, on held-out data or images."""
    for name, what in (("evaluate", "mean loss and accuracy of a checkpoint on every held-out sample of --data (the "
                                    "training run's own evaluation)"),
                       ("predict", "predicted classes of a checkpoint for images (--input) or a data set (--data)")):
        p = sub.add_parser(name, help=what, formatter_class=_Formatter)
        _model_args(p, from_checkpoint=True)
        p.add_argument("--checkpoint", required=True, metavar="PATH.npz",
                       help="a checkpoint written by minidl train --save: it records its model and options, its "
                            "data and how that data was scaled (--batch defaults to its batch)")
        p.add_argument("--seed", type=int, default=None,
                       help="the held-out split of --data digits, npz, npy or images without a test part (default: "
                            "the checkpoint's seed, so the held-out samples are the training run's)")
        p.add_argument("--backend", default="cpu", choices=("cpu", "cuda"), help="where the network runs")
        _math_arg(p)
        p.add_argument("--debug", action="store_true", help="show the traceback of an error")
        if name == "evaluate":
            p.add_argument("--data", default=None,
                           help="digits | cifar10:DIR | mnist:DIR | npz:PATH | npy:IMAGES,LABELS | images:DIR, or for "
                                "a sequence model stdlib | text:PATH: its held-out samples (bert: masked-token loss "
                                "and accuracy, on masks fixed whatever the seed); default: the checkpoint's data")
        else:
            p.add_argument("--data", default=None,
                           help="digits | cifar10:DIR | mnist:DIR | npz:PATH | npy:IMAGES,LABELS | images:DIR: its "
                                "held-out samples (else its training samples), with their labels (accuracy); "
                                "default, without --input: the checkpoint's data")
            p.add_argument("--input", default=None, metavar="IMAGES.npy",
                           help="an array of images (N, C, H, W), instead of --data, stored as the training data "
                                "was (uint8 or uint16 pixels are scaled and standardized as the training run did)")
            p.add_argument("--output", default=None, metavar="CLASSES.npy", help="write the classes (int64, N)")
            p.add_argument("--limit", type=_count, default=10, help="classes printed (0: all; --json lists all)")
