"""What the divergence guard costs per training step: the same session with `executor.check_finite` on and off,
steps interleaved (on, off, on, off, ...) so a shared machine's load hits both alike; medians reported.

    python benchmarks/guard_overhead.py [--model resnet --depth 20 --batch 32 --steps 30]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from minidl.data import digits
from minidl.models import build_model
from minidl.optim import SGD
from minidl.runtime.session import Session


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--depth", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    data = digits(seed=0)
    net = build_model(a.model, depth=a.depth, batch=a.batch, image_size=8, num_classes=10, in_channels=1)
    sess = Session(net, SGD(0.05, momentum=0.9), policy="liveness")
    ex = sess.executor
    x, y = data.x[:a.batch], data.y[:a.batch]
    for _ in range(3):
        ex.train_step(x, y)  # warm-up (and the compiled program's lowering)
    times = {True: [], False: []}
    for _ in range(a.steps):
        for on in (True, False):
            ex.check_finite = on
            t = time.perf_counter()
            ex.train_step(x, y)
            times[on].append(time.perf_counter() - t)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    params = sum(int(np.prod(s.shape)) for n in net.layer_nodes for s in n.params.values() if s.trainable)
    print(f"{a.model}-{a.depth} batch {a.batch} ({params:,} parameters), {a.steps} interleaved steps each: "
          f"guard on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms, overhead {(on / off - 1) * 100:+.1f}% "
          f"(median step; {'compiled' if ex.program is not None else 'interpreted'})")


if __name__ == "__main__":
    main()
