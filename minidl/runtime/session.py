"""A training session: plan once, then run steps, evaluate, predict, checkpoint and resume.

    import minidl as dl
    sess = dl.Session(net, dl.SGD(lr=0.1, momentum=0.9), policy="auto", budget="64MiB", seed=0)
    result = sess.fit(train_set, steps=100, save_every=50, save_path="run.npz")
    loss, accuracy = sess.evaluate(heldout_set)
    classes = sess.predict_classes(images)
    print(sess.report().format())

Ctrl-C during `fit` finishes the step under way (half a step is a state no run had), saves, and returns.
"""
from __future__ import annotations

import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..backend.mathmode import apply_math
from ..core import startup
from ..core.errors import CheckpointError, DataError, DivergenceError, OptionError
from ..core.guards import check_finite_data, check_images
from ..core.tensors import param_id
from ..data import BatchIterator, Dataset
from ..data.text import SequenceDataset
from ..dist.agree import check_same
from ..dist.checkpoint import check_resume, save_on_rank0
from ..graph.network import Network
from ..layers import IGNORE_INDEX, args
from ..memory.decisions.allreduce import DEFAULT_BUCKET_BYTES, DataParallel
from ..memory.host import TransferStats
from ..memory.policies import plan_network
from ..memory.pool import as_size
from ..memory.report import memory_report
from ..memory.request import PlanRequest, Target
from ..optim import Optimizer
from ..optim.loss_scale import LossScaler
from ..optim.schedules import Constant, LRSchedule
from .checkpoint import (
    check_data_position,
    check_positions,
    compare_data,
    compare_networks,
    load_checkpoint,
    network_fingerprint,
    resume_problems,
    save_checkpoint,
)
from .earlystop import EarlyStop, EarlyStopWatch
from .executor import Executor
from .progress import StepProgress


@dataclass(slots=True)
class TrainResult:
    """What `Session.fit` did: each step's loss and wall time, whether Ctrl-C stopped it, the paths it saved."""

    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    batch: int = 0
    unit: str = "images"     # or "tokens" for a language model
    per_sample: int = 1      # units per sample (a sequence's tokens)
    transfers_after_first: TransferStats | None = None
    interrupted: bool = False
    saved: list[Path] = field(default_factory=list)
    early_stop: EarlyStopWatch | None = None
    best_saved: Path | None = None              # the checkpoint of the best held-out loss

    @property
    def stopped_early(self) -> bool:
        """Whether the held-out loss stopped fit early."""
        return self.early_stop is not None and self.early_stop.stop

    @property
    def steps(self) -> int:
        """Steps completed by this call."""
        return len(self.losses)

    @property
    def final_loss(self) -> float:
        """NaN if no step ran."""
        return self.losses[-1] if self.losses else float("nan")

    @property
    def median_step_time(self) -> float:
        """Seconds (the median: a slow first step does not skew it)."""
        return statistics.median(self.step_times) if self.step_times else float("nan")

    @property
    def throughput(self) -> float:
        """`unit` per second over the median step time."""
        t = self.median_step_time
        return self.batch * self.per_sample / t if t and t == t else float("nan")

    @property
    def warm_step_times(self) -> list[float]:
        """The step times after the first (which compiles), or the one step."""
        return self.step_times[1:] or self.step_times


class _StopOnSigint:
    """In the main thread, a first SIGINT sets `requested` so the step completes; a second one raises."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> _StopOnSigint:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nminidl: interrupted; finishing the current step, then stopping (Ctrl-C again to abort at once)",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


@dataclass(frozen=True, slots=True)
class RunConfig:
    """How a plan runs, never what is trained (`Session(..., config=RunConfig(debug=True))`). `debug`: poison freed
    memory, check residency; `trace`: record every event; `compiled`: replay one step's recorded calls; `graphs`: as
    CUDA graphs; `fused_update`: each update right after its layer's backward (None: the policy's rule); `paged`: a
    paged arena's chunk size; `host_limit_bytes`: host RAM for offloads, beyond it a file; `costs`: a `CostTable`
    ranking convolution algorithms; `bucket_bytes`, `reduction`: the all-reduce. Bad sizes are refused here."""

    debug: bool = False
    trace: bool = False
    compiled: bool = True
    graphs: bool = True
    fused_update: bool | None = None
    paged: int | str | None = None
    host_limit_bytes: int | str | None = None
    costs: object = None
    bucket_bytes: int | None = None
    reduction: str | None = None

    def __post_init__(self) -> None:
        for name in ("paged", "host_limit_bytes", "bucket_bytes"):
            object.__setattr__(self, name, as_size(getattr(self, name), name))


class Session:
    """Trains one network under one memory plan, made once, here, before any array exists.

    `policy` (none, liveness, offload, recompute, auto, ...; None: `auto` under a budget, else `liveness`, as on
    the command line) and `budget` (bytes or a size string such as "16MiB"; None: no limit) choose the plan
    (`PlanRequest.from_options`); a budget below the plan's minimum raises `BudgetError` naming the smallest
    budget that works. `seed` fixes initialization, data order and dropout masks: same seed, same parameters,
    bit for bit, whatever the policy. `lr_schedule` (`minidl.optim.schedules`) sets the optimizer's learning
    rate before each step from its initial one.

    `backend` runs the steps (default: the CPU); the plan chooses among its convolution algorithms.
    `device` is the simulator profile whose speeds the policy's timing decisions (when to prefetch, what
    to offload) assume; by default the backend's own (`backend.profile`: 'cpu', or the GPU's nearest).
    `micro_batches`: Harmony's micro-batches (`packs.py`): policy `packs` chooses when None.
    `math` ('fp32', 'tf32', 'bf16' or 'fp16'; None: the backend's own, fp32 unless it was built otherwise) puts
    the backend in that math mode before planning (`backend/mathmode.py`); the CPU backend refuses tf32. bf16 and
    fp16 train with half activations and float32 master weights (`backend/precision.py`); fp16 scales the loss
    (`optim/loss_scale.py`). `self.math` is the mode, and checkpoints record it, with fp16's loss scale (resuming
    in another mode is allowed: only the arithmetic of later steps differs).

    `comm` (a `dist.comm.Communicator`): data parallel, this process is one rank of `comm.size`. The network's
    batch is per rank: rank r trains on the r-th slice of the global batch of size x batch that one process
    would take; gradients are all-reduced in buckets (`memory/decisions/allreduce.py`); rank 0 writes
    checkpoints and every rank reads them.

    `config` (a `RunConfig`): the options most runs leave at their defaults (diagnostics, the step runner, the
    arena, the host limit, the cost table, the all-reduce buckets), in one value so that this signature stays
    the short list of what a run is about.
    """

    def __init__(self, net: Network, optimizer: Optimizer, policy: str | None = None,
                 budget: int | str | None = None, seed: int = 0, backend=None, device: str | None = None,
                 lr_schedule: LRSchedule | None = None, micro_batches: int | None = None, math: str | None = None,
                 comm=None, config: RunConfig | None = None):
        if config is not None and not isinstance(config, RunConfig):
            raise OptionError(f"Session: config must be a RunConfig, got {type(config).__name__} (options such as "
                              f"debug or paged go in RunConfig(...))")
        config = config or RunConfig()
        seed = args.integer("Session", None, "seed", seed, 0)
        self.net, self.optimizer, self.seed, self.config = net, optimizer, seed, config
        self.lr_schedule = lr_schedule or Constant()
        self.base_lr = float(getattr(optimizer, "lr", 0.0))
        if backend is None:
            from ..backend.cpu.backend import CPUBackend

            backend = CPUBackend()
        self.math = apply_math(backend, math)
        self.comm = comm
        dp = (DataParallel(comm.size, config.bucket_bytes or DEFAULT_BUCKET_BYTES,
                           config.reduction or comm.reduction) if comm is not None else None)
        self.request = PlanRequest.from_options(policy, budget, fused_update=config.fused_update,
                                                micro_batches=micro_batches, math=self.math, data_parallel=dp,
                                                paged=config.paged)
        self.target = Target.for_run(device, backend, config.costs)
        self.policy, self.device = self.request.policy, device or backend.profile
        with startup.phase("planning"):
            self.plan = plan_network(net, optimizer.slots, self.request, self.target)
        net.freeze("a Session")
        self.executor = Executor(net, self.plan, optimizer, backend=backend, seed=seed, debug=config.debug,
                                 trace=config.trace, host_limit_bytes=config.host_limit_bytes,
                                 compiled=config.compiled, comm=comm, graphs=config.graphs)
        self.batch = net.input_nodes[0].shape[0]
        self.ranks = comm.size if comm is not None else 1
        self._iterator: BatchIterator | None = None
        self._data_desc: dict | None = None  # the data set fit() last trained on
        self._resume_data: dict | None = None  # a loaded checkpoint's data set, checked by fit
        self._data_fingerprint: tuple | None = None
        self.batches_consumed = 0
        self._resume_position: dict | None = None
        self._agreed: dict | None = None  # data parallel: the run record the ranks were checked to share

    @property
    def throughput_unit(self) -> tuple[str, int]:
        """("tokens", sequence length) for a network of integer tokens, else ("images", 1)."""
        node = self.net.input_nodes[0]
        if np.issubdtype(node.dtype, np.integer):
            return "tokens", int(np.prod(node.shape[1:]))
        return "images", 1

    @property
    def iteration(self) -> int:
        """Steps completed since initialization, the loaded ones included."""
        return self.executor.iteration

    def _batches(self, data: Dataset) -> BatchIterator:
        fp = (id(data), len(data))
        if self._iterator is None or self._data_fingerprint != fp:
            it = BatchIterator(data, self.batch * self.ranks, seed=self.seed, shuffle=True,
                               drop_last=True)  # data parallel: the global batch, sliced per rank
            old, self._iterator, self._data_fingerprint = self._iterator, it, fp
            if self._resume_position is not None:
                it.seek(self._resume_position)
                self._resume_position = None
            elif old is not None and len(old.dataset) == len(data):  # another data set of the same size
                it.seek(old.position())
            elif self.batches_consumed:  # a position known only as a count (bounded by check_data_position)
                it.skip(self.batches_consumed)
        return self._iterator

    def fit(self, data: Dataset, steps: int, progress: bool | None = None, on_step=None,
            save_every: int | None = None, save_path: str | Path | None = None, heldout: Dataset | None = None,
            early_stop: EarlyStop | None = None) -> TrainResult:
        """Run `steps` training steps on mini-batches of `data`, in an order fixed by the seed (a resume continues
        it); returns a `TrainResult`. `early_stop` evaluates `heldout` without changing a training step. Checkpoints
        go to `save_path` every `save_every` iterations and on Ctrl-C. A non-finite loss, gradient or BN statistic
        raises `DivergenceError` before that step's update."""
        steps = args.integer("Session.fit", None, "steps", steps, 0)
        if tuple(data.sample_shape) != tuple(self.net.input_nodes[0].shape[1:]):
            raise DataError(f"Session.fit: data set {data.name!r} has samples of shape {data.sample_shape}, but the "
                            f"network's input '{self.net.input_nodes[0].name}' takes "
                            f"{self.net.input_nodes[0].shape[1:]}")
        if save_every is not None:
            save_every = args.integer("Session.fit", None, "save_every", save_every, 1)
            if save_path is None:
                raise OptionError(f"Session.fit: save_every={save_every} needs save_path (where to save)")
        if early_stop is not None:
            if not isinstance(early_stop, EarlyStop):
                raise OptionError(f"Session.fit: early_stop must be an EarlyStop, got {type(early_stop).__name__}")
            if heldout is None:
                raise OptionError("Session.fit: early_stop needs heldout (the data set whose loss it watches)")
            if tuple(heldout.sample_shape) != tuple(data.sample_shape):
                raise DataError(f"Session.fit: the held-out set {heldout.name!r} has samples of shape "
                                f"{heldout.sample_shape}, the training set {data.sample_shape}")
        desc = {"samples": len(data), "image_shape": list(data.sample_shape), "num_classes": data.num_classes,
                "source": data.source, "transform": data.transform.to_json() if data.transform is not None else None}
        diff = compare_data(self._resume_data, desc)
        if diff:
            raise CheckpointError(f"the data set differs from the one the resumed checkpoint was trained on "
                                  f"({'; '.join(diff)}): its data order would not continue")
        self._resume_data, self._data_desc = None, desc
        if self.ranks > 1:
            self._check_ranks_agree(steps, save_every)
        it = self._batches(data)
        unit, per_sample = self.throughput_unit
        result = TrainResult(batch=self.batch, unit=unit, per_sample=per_sample)
        if early_stop is not None:
            result.early_stop = EarlyStopWatch(early_stop, early_stop.every or it.batches_per_epoch)
        mode = "bar" if progress or (progress is None and sys.stderr.isatty()) else (
            "lines" if progress is None else None)
        with _StopOnSigint() as stop, StepProgress(steps, mode, result.unit,
                                                   self.batch * result.per_sample) as shown:
            for k in range(steps):
                loss, dt = self._train_one(it)
                result.losses.append(loss)
                result.step_times.append(dt)
                if k == 0 and self.executor.host is not None and steps > 1:
                    result.transfers_after_first = self.executor.host.stats()
                shown.step(loss, dt)
                if on_step:
                    on_step(k, loss, dt)
                if result.early_stop is not None and result.early_stop.due(self.iteration):
                    self._watch(heldout, result)
                    if result.stopped_early:
                        break
                if self._stop_requested(stop.requested):
                    result.interrupted = True
                    break
                if save_every and self.iteration % save_every == 0:
                    result.saved.append(self.save(save_path))
        if result.interrupted and save_path is not None:
            result.saved.append(self.save(save_path))
        return result

    def _watch(self, heldout: Dataset, result: TrainResult) -> None:
        loss, _ = self.evaluate(heldout)
        watch = result.early_stop
        if watch.observe(self.iteration, loss) and watch.rule.best_path is not None:
            result.best_saved = self.save(watch.rule.best_path)

    def _check_ranks_agree(self, steps: int, save_every: int | None) -> None:
        """Every rank must run the same training, else each raises a `DistError` naming what differs."""
        record = self._run_record(steps, save_every)
        if record != self._agreed:
            check_same(self.comm, record)
            self._agreed = record

    def _run_record(self, steps: int, save_every: int | None) -> dict:
        """What the ranks of one data-parallel run must share, as a flat record of plain values."""
        record = {"network": self.net.name, "seed": self.seed, "batch": self.batch, "policy": self.policy,
                  "math": self.math, "lr schedule": repr(self.lr_schedule), "data": self._data_desc,
                  "iteration": self.iteration, "batches_consumed": self.batches_consumed, "steps": steps,
                  "save_every": save_every}
        record.update({f"optimizer {k}": v for k, v in self.optimizer.config().items()})
        record.update({f"parameter {k}": f"{tuple(shape)} {dtype}" for k, shape, dtype in self._fingerprint()})
        tensors = self.plan.route.tensors
        record["gradient buckets"] = [[b, list(tensors[b].shape)] for b in self.plan.buckets]
        return record

    def _stop_requested(self, here: bool) -> bool:
        """Stop after this step if any rank got Ctrl-C, so that none waits for the others' all-reduce."""
        return self.comm.any(here) if self.ranks > 1 else here

    def _train_one(self, it: BatchIterator) -> tuple[float, float]:
        """One step on the next batch: (loss, seconds)."""
        if hasattr(self.optimizer, "lr"):
            self.optimizer.lr = self.lr_schedule.lr(self.base_lr, self.iteration)
        before = it.position()
        x, y = it.next_batch()
        if self.ranks > 1:  # this rank's slice of the global batch
            r, b = self.comm.rank, self.batch
            x, y = x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]
        t = time.perf_counter()
        try:
            loss = self.executor.train_step(x, y)
        except BaseException:  # the step did not count: its batch comes next
            it.seek(before)
            raise
        if self.ranks > 1:
            loss = self.comm.mean(loss)  # the global batch's loss
        dt = time.perf_counter() - t
        self.batches_consumed += 1
        if not np.isfinite(loss):  # the executor's guard off, or another rank's
            raise DivergenceError(f"step {self.iteration - 1}: the loss is {loss} and the update was applied (the "
                                  f"divergence guard is off)", self.iteration - 1)
        return loss, dt

    def _forward(self, x: np.ndarray, y: np.ndarray | None = None):
        """Inference in batches of the plan's size, the last padded (its padding dropped): yields (logits,
        labels or None)."""
        node = self.net.input_nodes[0]
        x = check_images(x, f"input '{node.name}'", (None, *node.shape[1:]))
        with np.errstate(over="ignore"):   # out-of-range float64 becomes inf, refused below
            x = x.astype(self.net.dtype, copy=False)
        check_finite_data(x, f"input '{node.name}'")
        b = self.batch
        for i in range(0, len(x), b):
            xb = x[i:i + b]
            n = len(xb)
            yb = np.zeros(n, np.int64) if y is None else np.asarray(y[i:i + b], np.int64)
            if n < b:
                pad = np.arange(b) % n
                xb, yb_full = xb[pad], yb[pad]
            else:
                yb_full = yb
            _, logits = self.executor.evaluate(np.ascontiguousarray(xb), np.ascontiguousarray(yb_full))
            yield np.asarray(logits[:n], np.float64), yb

    def evaluate(self, data: Dataset) -> tuple[float, float]:
        """(mean loss, accuracy) over every sample of `data` in inference mode, the loss in float64. A
        `SequenceDataset` counts every target token but `IGNORE_INDEX`, a masked set on masks drawn once."""
        if isinstance(data, SequenceDataset):
            return self._evaluate_tokens(data)
        total_loss, correct = 0.0, 0
        for logits, y in self._forward(data.x, data.y):
            shifted = logits - logits.max(axis=1, keepdims=True)
            logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            total_loss -= float(logp[np.arange(len(y)), y].sum())
            correct += int((logits.argmax(axis=1) == y).sum())
        return total_loss / len(data), correct / len(data)

    def _evaluate_tokens(self, data: SequenceDataset) -> tuple[float, float]:
        node = self.net.input_nodes[0]
        if tuple(data.sample_shape) != tuple(node.shape[1:]):
            raise DataError(f"Session.evaluate: data set {data.name!r} has sequences of shape {data.sample_shape}, "
                            f"but the network's input '{node.name}' takes {node.shape[1:]}")
        if data.masking is not None:
            data = data.masking.fixed(data)
        total_loss, correct, targets, b = 0.0, 0, 0, self.batch
        for i in range(0, len(data), b):
            xb, yb = data.x[i:i + b], data.y[i:i + b]
            n = len(xb)
            pad = np.arange(b) % n  # padding repeats sequences; their outputs are dropped
            _, logits = self.executor.evaluate(np.ascontiguousarray(xb[pad]), np.ascontiguousarray(yb[pad]))
            logits = np.asarray(logits[:n], np.float64).reshape(-1, logits.shape[-1])
            y = yb.reshape(-1)
            rows = np.flatnonzero(y != IGNORE_INDEX)
            if len(rows) < len(y):
                logits, y = logits[rows], y[rows]
            shifted = logits - logits.max(axis=1, keepdims=True)
            logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            total_loss -= float(logp[np.arange(len(y)), y].sum())
            correct += int((logits.argmax(axis=1) == y).sum())
            targets += len(y)
        if targets == 0:  # no mean (PyTorch gives NaN too)
            return float("nan"), float("nan")
        return total_loss / targets, correct / targets

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits (N, classes), float64, in inference mode."""
        parts = [logits for logits, _ in self._forward(x)]
        return np.concatenate(parts) if parts else np.zeros((0, self.net.logits_node.shape[1]))

    def predict_classes(self, x: np.ndarray) -> np.ndarray:
        """The argmax class of each sample, int64 (N,)."""
        return self.predict(x).argmax(axis=1).astype(np.int64)

    def report(self):
        """The plan's memory report (`.format()` text, `.to_json()` numbers)."""
        return memory_report(self.plan)

    # -- persistence
    def save(self, path, with_optimizer: bool = True) -> Path:
        """Write a checkpoint at exactly `path`, atomically, with what `load` checks and what rebuilds the run."""
        meta = {"iteration": self.executor.iteration, "seed": self.seed, "batches_consumed": self.batches_consumed,
                "network": self.net.name, "optimizer": self.optimizer.config(), "batch": self.batch * self.ranks,
                "optimizer_slots": list(self.optimizer.slots), "fingerprint": self._fingerprint(),
                "data": self._data_desc, "global_batch": self.batch * self.ranks, "ranks": self.ranks,
                "math": self.math, "data_position": self._data_position(), "recipe": self.net.recipe}
        if self.executor.scaler is not None:   # fp16: the loss scale and its counters, so a resume is exact
            meta["loss_scale"] = self.executor.scaler.state_dict()
        if self.ranks > 1:  # every replica holds the same state: rank 0 writes it, the others wait for it
            return save_on_rank0(self.comm, lambda: self._save(path, meta, with_optimizer), path)
        return self._save(path, meta, with_optimizer)

    def _data_position(self) -> dict | None:
        """Where the data order stands, so a resume restores it at once; None before the first fit."""
        if self._iterator is not None:
            return self._iterator.position()
        return self._resume_position

    def _save(self, path, meta: dict, with_optimizer: bool) -> Path:
        opt = self.executor.optimizer_state() if with_optimizer else None
        return save_checkpoint(path, self.executor.state_dict(), opt, meta)

    def _fingerprint(self) -> list:
        tensors = self.executor.route.tensors
        return network_fingerprint({f"{n.name}.{p}": (spec.shape, tensors[param_id(n.name, p)].dtype)
                                    for n in self.net.layer_nodes for p, spec in n.params.items()})

    def load(self, path, strict: bool = True, params_only: bool = False) -> dict:
        """Resume from a checkpoint, verified whole first. `strict`: network, optimizer, seed, batch and the next
        fit's data must match, and training continues exactly; else whatever matches (`not_loaded` lists the rest)."""
        params, opt, meta = load_checkpoint(path)
        iteration, consumed = check_positions(meta, path)
        here = self._fingerprint()
        if params_only:
            diff = compare_networks(meta.get("fingerprint", []), here)
            if diff:
                raise CheckpointError(f"{path} does not fit this network: {'; '.join(diff)}")
            self.executor.load_state_dict(params, None)
            return meta
        check_resume(meta, self.batch, self.ranks, path)
        problems = resume_problems(meta, fingerprint=here, optimizer=self.optimizer.config(),
                                   slots=list(self.optimizer.slots), seed=self.seed, batch=self.batch * self.ranks)
        if problems and strict:
            raise CheckpointError(f"cannot resume from {path}: {'; '.join(problems)}. To load the parameters "
                                  f"alone use --resume-params-only (Session.load(path, params_only=True)); for a "
                                  f"partial load, Session.load(path, strict=False)")
        position_ok = meta.get("seed") == self.seed and meta.get("batch") == self.batch * self.ranks
        position = check_data_position(meta, consumed, path) if position_ok else None
        mine = {k: (tuple(s), d) for k, s, d in here}
        usable = {k: v for k, v in params.items() if mine.get(k) == (tuple(v.shape), str(v.dtype))}
        opt_ok = not any(p.startswith(("optimizer", "the checkpoint has no optimizer")) for p in problems)
        opt = {k: v for k, v in opt.items() if k.rsplit(".", 1)[0] in usable} if opt_ok else {}
        self.executor.load_state_dict(usable, opt or None, strict=False)
        if position_ok:
            self.executor.iteration, self.batches_consumed = iteration, consumed
            self._resume_data = self._data_desc = meta.get("data")
            if self.executor.scaler is not None and meta.get("loss_scale") is not None:
                self.executor.scaler = LossScaler.from_state(meta["loss_scale"])
        self._iterator, self._resume_position = None, position
        meta["not_loaded"] = sorted(set(mine) - set(usable)) + ([] if opt_ok else ["optimizer state"]) + (
            [] if position_ok else ["iteration and data position"])
        return meta
