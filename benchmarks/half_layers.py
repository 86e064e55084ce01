"""What half storage costs the CPU backend: a network's layers, forward and backward, in float32 and in bf16/fp16.

    python benchmarks/half_layers.py --model resnet20 --batch 32
    python benchmarks/half_layers.py --model gpt2 --size small --seq 128 --batch 4 --math fp16
    python benchmarks/half_layers.py --model resnet56 --batch 32 --only bf16 --steps 5   # one mode a process

Every layer of the network runs its forward then (in reverse order) its backward on arrays of its own shapes,
stored as `minidl.backend.precision` says for each mode (float32; or half activations, deltas and weight copies
with float32 masters and gradients), the weight copies refreshed from their masters once a step (what a half plan
adds after the update). Inputs are random: the kernels' times do not depend on the values. No plan runs here (the
executor is not in it, nor its fusions), so the figure is the kernels' cost: the sum of the layers' times, the
median of --steps, the modes alternating step by step so a shared machine slows both alike; per layer type too.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import numpy as np

from minidl.backend.cpu import lanes
from minidl.backend.cpu.backend import CPUBackend
from minidl.backend.precision import precision
from minidl.core.tensors import Role
from minidl.layers.base import LayerContext
from minidl.models import build_model, is_sequence_model

_SHARED = [np.empty(0, np.uint8)]   # one workspace all layers share (they run one at a time): `share_workspace`


def share_workspace(net) -> None:
    """Allocate the shared workspace: the largest fastest-algorithm workspace of any layer."""
    most = max((opts[0].workspace_bytes for n in net.layer_nodes for ph in ("fwd", "bwd")
                if (opts := n.layer.workspace_options(ph, [net.nodes[i].shape for i in n.inputs], n.shape, 4))),
               default=0)
    _SHARED[0] = np.zeros(most, np.uint8)


def _workspace(nbytes: int) -> np.ndarray:
    return _SHARED[0][:nbytes]


class LayerArrays:
    """One layer's arrays in one mode, allocated once."""

    def __init__(self, node, in_nodes, prec, be, rng):
        layer = self.layer = node.layer
        self.in_shapes = [n.shape for n in in_nodes]
        self.inputs = []
        for n in in_nodes:
            if np.issubdtype(n.dtype, np.integer):
                high = layer.num_embeddings if layer.type_name == "embedding" else in_nodes[0].shape[-1]
                self.inputs.append(rng.integers(0, high, n.shape).astype(n.dtype))
            else:
                self.inputs.append(self._stored(be, rng.standard_normal(n.shape), prec, Role.ACTIVATION))
        specs = layer.param_specs(self.in_shapes)
        self.masters = {p: (rng.standard_normal(s.shape) * 0.05).astype(np.float32) for p, s in specs.items()}
        self.masters |= {p: np.abs(a) + 1 for p, a in self.masters.items() if p == "running_var"}
        self.copies = {p: np.empty(self.masters[p].shape, prec.dtype(Role.WEIGHT_COPY)) for p in layer.half_params
                       if prec.half is not None and p in self.masters}
        self.params = self.masters | self.copies
        self.grads = {p: np.empty(s.shape, np.float32) for p, s in specs.items() if s.trainable}
        out_dtype = prec.dtype(Role.ACTIVATION, layer=layer) if prec.half else np.float32
        self.out = np.empty(node.shape, out_dtype)
        self.aux = {k: np.empty(s, prec.dtype(Role.AUX, layer=layer, aux=k) if prec.half else np.float32)
                    for k, s in layer.aux_specs(self.in_shapes).items()}
        self.dout = self._stored(be, rng.standard_normal(node.shape), prec, Role.DELTA, layer)
        self.dinputs = [None if k in layer.nondiff_inputs or np.issubdtype(x.dtype, np.integer) else np.empty_like(x)
                        for k, x in enumerate(self.inputs)]
        self.ctx = {ph: self._context(ph, node.shape) for ph in ("fwd", "bwd")}

    @staticmethod
    def _stored(be, values, prec, role, layer=None):
        dtype = prec.dtype(role, layer=layer) if prec.half else np.float32
        out = np.empty(np.shape(values), dtype)
        be.copy(out, np.asarray(values, np.float32))
        return out

    def _context(self, phase, out_shape):
        opts = self.layer.workspace_options(phase, self.in_shapes, out_shape, 4)
        ws = _workspace(opts[0].workspace_bytes) if opts and opts[0].workspace_bytes else None
        return LayerContext(training=True, aux=self.aux, workspace=ws, algo=opts[0].algo if opts else None)

    def forward(self, be):
        self.layer.forward(be, self.inputs, self.out, self.params, self.ctx["fwd"])

    def backward(self, be):
        lay = self.layer
        saved = [x if k in lay.needs_inputs else None for k, x in enumerate(self.inputs)]
        lay.backward(be, saved, self.out if lay.needs_output else None, self.dout, self.dinputs, self.grads,
                     self.params, self.ctx["bwd"])

    def refresh(self, be):
        for p, c in self.copies.items():
            be.copy(c, self.masters[p])


def step(be, layers, times):
    """One pass over the layers (refresh, forward, reverse backward), each layer's time added to `times`."""
    start = time.perf_counter()
    for a in layers:
        a.refresh(be)
    times["weight copies"] += time.perf_counter() - start
    for a in layers:
        t = time.perf_counter()
        a.forward(be)
        times[a.layer.type_name] += time.perf_counter() - t
    for a in reversed(layers):
        t = time.perf_counter()
        a.backward(be)
        times[a.layer.type_name] += time.perf_counter() - t
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet20")
    ap.add_argument("--depth", type=int, default=None, help="a resnet's depth (resnet20, resnet56: CIFAR's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", default=None)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--math", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--only", default=None, choices=("fp32", "bf16", "fp16"), help="run one mode (for --vs timing)")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="lanes of the CPU kernels (default: the cores)")
    args = ap.parse_args()
    if args.threads:
        lanes._threads.append(args.threads)   # lanes.using(args.threads) for the rest of the process
    if is_sequence_model(args.model):
        kw = {"size": args.size} if args.size else {}
        net = build_model(args.model, batch=args.batch, seq=args.seq, dropout=0.0, **kw)
    else:
        net = build_model(args.model, depth=args.depth, batch=args.batch)
    be = CPUBackend()
    rng = np.random.default_rng(0)
    share_workspace(net)
    modes = [args.only] if args.only else ["fp32", args.math]
    arrays = {m: [LayerArrays(n, [net.nodes[i] for i in n.inputs], precision(m), be, rng) for n in net.layer_nodes]
              for m in modes}
    steps = {m: [] for m in modes}
    times = {m: collections.defaultdict(float) for m in modes}
    with be.step_scope():
        for m in modes:   # warm-up: compilation, first touches
            step(be, arrays[m], collections.defaultdict(float))
        for _ in range(args.steps):
            for m in modes:
                steps[m].append(step(be, arrays[m], times[m]))
    med = {m: statistics.median(steps[m]) for m in modes}
    print(f"{args.model}{' ' + args.size if args.size else ''} batch {args.batch}: median of {args.steps} steps (ms): "
          + ", ".join(f"{m} {med[m] * 1e3:.1f}" for m in modes)
          + (f"; {modes[1]}/fp32 {med[modes[1]] / med['fp32']:.3f}" if len(modes) == 2 else ""))
    kinds = sorted(set().union(*(times[m] for m in modes)), key=lambda k: -times[modes[0]].get(k, 0))
    print(f"{'layer type':<14}" + "".join(f"{m + ' ms':>10}" for m in modes))
    for k in kinds:
        print(f"{k:<14}" + "".join(f"{times[m].get(k, 0) / args.steps * 1e3:>10.2f}" for m in modes))


if __name__ == "__main__":
    main()
