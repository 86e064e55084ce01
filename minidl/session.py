"""A training session: plan once, then run steps, evaluate, checkpoint and resume.

    sess = Session(net, SGD(lr=0.1, momentum=0.9), policy="liveness", budget=parse_size("64MiB"), seed=0)
    result = sess.fit(train_set, steps=100)
    print(sess.report().format())
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from .checkpoint import load_checkpoint, save_checkpoint
from .data import BatchIterator, Dataset
from .executor import Executor
from .graph import Network
from .memory.policies import plan_network
from .memory.pool import as_size
from .memory.report import memory_report
from .optim import Optimizer


@dataclass(slots=True)
class TrainResult:
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    batch: int = 0

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else float("nan")

    @property
    def median_step_time(self) -> float:
        return statistics.median(self.step_times) if self.step_times else float("nan")

    @property
    def images_per_s(self) -> float:
        t = self.median_step_time
        return self.batch / t if t and t == t else float("nan")


class Session:
    def __init__(self, net: Network, optimizer: Optimizer, policy: str = "liveness",
                 budget: int | str | None = None, seed: int = 0, backend=None, debug: bool = False,
                 trace: bool = False, host_limit_bytes: int | str | None = None, device: str | None = None,
                 costs=None):
        """`backend` runs the steps (default: the CPU); the plan chooses among its convolution algorithms.
        `device` is the simulator profile whose speeds the policy's timing decisions (when to prefetch, what
        to offload) assume; by default the backend's own (`backend.profile`: 'cpu', or the GPU's nearest).
        `costs` (a `memory.workspace.CostTable`) ranks the convolution algorithms; None: the menu's estimates."""
        budget = as_size(budget, "budget")
        host_limit_bytes = as_size(host_limit_bytes, "host_limit_bytes")
        self.net, self.optimizer, self.seed = net, optimizer, int(seed)
        if backend is None:
            from .backend.cpu import CPUBackend

            backend = CPUBackend()
        self.device = device or getattr(backend, "profile", "cpu")
        self.plan = plan_network(net, optimizer, policy, budget, device=self.device, backend=backend, costs=costs)
        self.executor = Executor(net, self.plan, optimizer, backend=backend, seed=seed, debug=debug, trace=trace,
                                 host_limit_bytes=host_limit_bytes)
        self.batch = net.input_nodes[0].shape[0]
        self._iterator: BatchIterator | None = None
        self._data_fingerprint: tuple | None = None
        self.batches_consumed = 0

    def _batches(self, data: Dataset) -> BatchIterator:
        fp = (id(data), len(data))
        if self._iterator is None or self._data_fingerprint != fp:
            self._iterator = BatchIterator(data, self.batch, seed=self.seed, shuffle=True, drop_last=True)
            self._data_fingerprint = fp
            for _ in range(self.batches_consumed):  # resume: replay the data order without copying data
                self._iterator._take_indices()
        return self._iterator

    def fit(self, data: Dataset, steps: int, progress: bool = False, on_step=None) -> TrainResult:
        if tuple(data.image_shape) != tuple(self.net.input_nodes[0].shape[1:]):
            raise ValueError(f"data images are {data.image_shape}, but the network's input is "
                             f"{self.net.input_nodes[0].shape[1:]}")
        it = self._batches(data)
        result = TrainResult(batch=self.batch)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=steps, unit="step", dynamic_ncols=True, leave=True)
        for k in range(steps):
            x, y = it.next_batch()
            t = time.perf_counter()
            loss = self.executor.train_step(x, y)
            dt = time.perf_counter() - t
            self.batches_consumed += 1
            result.losses.append(loss)
            result.step_times.append(dt)
            if not np.isfinite(loss):
                if bar:
                    bar.close()
                raise FloatingPointError(f"loss became {loss} at step {self.executor.iteration}; lower the "
                                         f"learning rate")
            if bar:
                bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{self.batch / dt:.1f}")
                bar.update(1)
            if on_step:
                on_step(k, loss, dt)
        if bar:
            bar.close()
        return result

    def evaluate(self, data: Dataset) -> tuple[float, float]:
        """(mean loss, accuracy) over every full batch of `data`, in inference mode."""
        n = (len(data) // self.batch) * self.batch
        if n == 0:
            raise ValueError(f"held-out set has {len(data)} samples, fewer than one batch of {self.batch}")
        losses, correct = [], 0
        for i in range(0, n, self.batch):
            loss, logits = self.executor.evaluate(data.x[i:i + self.batch], data.y[i:i + self.batch])
            losses.append(loss)
            correct += int((logits.argmax(axis=1) == data.y[i:i + self.batch]).sum())
        return float(np.mean(losses)), correct / n

    def report(self):
        return memory_report(self.plan)

    # -- persistence ------------------------------------------------------------------------------------------
    def save(self, path, with_optimizer: bool = True):
        meta = {"iteration": self.executor.iteration, "seed": self.seed, "batches_consumed": self.batches_consumed,
                "network": self.net.name, "optimizer": self.optimizer.config()}
        opt = self.executor.optimizer_state() if with_optimizer else None
        return save_checkpoint(path, self.executor.state_dict(), opt, meta)

    def load(self, path) -> dict:
        params, opt, meta = load_checkpoint(path)
        self.executor.load_state_dict(params, opt or None)
        self.executor.iteration = int(meta.get("iteration", 0))
        self.batches_consumed = int(meta.get("batches_consumed", 0))
        self._iterator = None
        return meta
