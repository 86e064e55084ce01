"""What several commands share: the network, the plan's JSON and lines, the planning progress line, the outputs."""
from __future__ import annotations

import sys
import time

from ..core.errors import OptionError


def build_net(args, image_shape=None, num_classes=None, recipe: dict | None = None):
    """The network of MODEL and its options; unset ones come from `recipe` (a checkpoint's), then the data's."""
    from minidl.models import SEQUENCE_OPTIONS, build_model

    kw = dict(recipe["options"]) if recipe else {}
    for k in ("depth", "batch", "image_size", "num_classes", "in_channels", *SEQUENCE_OPTIONS):
        if getattr(args, k, None) is not None:
            kw[k] = getattr(args, k) == "on" if k == "keep_scores" else getattr(args, k)
    if image_shape is not None:
        kw.setdefault("in_channels", image_shape[0])
        kw.setdefault("image_size", image_shape[1])
    if num_classes is not None:
        kw.setdefault("num_classes", num_classes)
    return build_model(args.model, **kw)


def check_data_kind(model: str, data: str) -> None:
    """Images for an image model, text for a sequence model."""
    from minidl.models import is_sequence_model

    from ..data.load import is_text

    if is_text(data) and not is_sequence_model(model):
        raise OptionError(f"--data {data} is text (token sequences), but model '{model}' reads images: give it image "
                          f"data (digits, npz:, npy:, images: ...), or train a sequence model (gpt2, bert) on the text")
    if not is_text(data) and is_sequence_model(model):
        raise OptionError(f"--data {data}: model '{model}' reads token sequences; give --data stdlib (Python's own "
                          f"sources) or --data text:PATH")


def token_figures(objective: str, loss: float, accuracy: float, heldout, train=None, held: str = "") -> dict:
    """A language model's held-out figures: next-token (with perplexity) or masked-token (none: not a text's
    likelihood); `train` adds the unigram loss; `held` prefixes the names."""
    from ..data.text import MASKED, perplexity, unigram_loss
    from ..layers import IGNORE_INDEX

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


def memory_json(plan) -> dict:
    from ..memory.decisions.weights import moved_by_role
    from ..memory.report import memory_report

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
            "packs": (plan.route.packing.packs or None) if plan.route.packing is not None else None,  # None: accumulate
            **({"paged_chunk_bytes": plan.paged.chunk_bytes, "live_peak_bytes": plan.paged.live_peak_bytes}
               if plan.paged else {})}


def cost_table(args, backend):
    """The cost table `--autotune` asks for (None: fixed estimates); a GPU's is kept in the user cache folder, the
    CPU's never (it depends on the load of the moment)."""
    if args.autotune is None:
        return None
    from ..backend import backend_name
    from ..memory.workspace import CostTable

    path = args.autotune or (backend.autotune_path() if backend_name(backend) == "cuda" else None)
    return CostTable(autotune=True, path=path, backend=backend)


def moved_line(moved: dict[str, int]) -> str:
    """Bytes copied between device and host per step, by role."""
    from ..memory.decisions.weights import moved_words
    from ..memory.pool import format_bytes

    return "  moved per step: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}"
                                           for k, v in moved_words(moved).items())


def fused_update_option(args) -> bool | None:
    """--fused-update on/off/auto -> True/False/None (the planner decides)."""
    return {"on": True, "off": False}.get(args.fused_update)


def plan_request(args):
    """The request `plan` and `train` describe, by `Session`'s rules."""
    from ..memory.request import PlanRequest

    dp = None
    if getattr(args, "ranks", None) is not None:
        from ..memory.decisions.allreduce import DEFAULT_BUCKET_BYTES, DataParallel

        dp = DataParallel(args.ranks, args.bucket_size or DEFAULT_BUCKET_BYTES, args.reduction)
    return PlanRequest.from_options(args.policy, args.budget, lossy=args.lossy, fused_update=fused_update_option(args),
                                    micro_batches=args.micro_batches,
                                    max_micro_batches=getattr(args, "max_micro_batches", None), math=args.math,
                                    data_parallel=dp, paged=args.paged,
                                    host_weights=not getattr(args, "weights_on_device", False), backend=args.backend)


def cpu_menu(args):
    """The CPU's menu --no-cpu-winograd and --threads describe."""
    from ..backend.cpu.menu import CPUMenu

    return CPUMenu(winograd=args.cpu_winograd is not False, threads=args.threads)


class ProgressLine:
    """On a terminal only, a stderr line saying what is being planned once it takes over `AFTER_S`; erased after."""

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


def plot_title(args, plan) -> str:
    """Model, depth and batch (the plot adds budget and policy)."""
    batch = plan.route.network.input_nodes[0].shape[0]
    return f"{args.model}{f'-{args.depth}' if args.depth else ''}, batch {batch}"


def say_written(args, written: list[tuple[str, object]]) -> None:
    """End the text output with what was written where."""
    if not args.json:
        for what, path in written:
            if path is not None:
                print(f"wrote {what}: {path}")


def measured_device(net, opt, backend, costs):
    """`--device measured`: the host link measured on the GPU; with --autotune the roofline is fitted to the
    measured convolutions (memory/calibrate.py)."""
    from ..backend import menu_of
    from ..memory.calibrate import measured_profile
    from ..memory.workspace import workspace_choices

    route = None
    if costs is not None and costs.autotune:
        route = net.route(True, tuple(opt.slots), menu=menu_of(backend))
        workspace_choices(route, costs)
    return measured_profile(backend, costs=costs, route=route)
