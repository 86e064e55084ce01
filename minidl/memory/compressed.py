"""The moving half of the compress decision: encodes tensors into their reserved blocks and decodes them back.
Rule: a stream larger than its block spills to host memory, so the pool never holds more than the plan placed."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..codec import sz
from .errorbound import ErrorBoundRule, Reader


@dataclass(slots=True)
class TensorFigures:
    """The last compression of one tensor."""

    raw_bytes: int = 0
    stream_bytes: int = 0
    reserved_bytes: int = 0
    eb: float = 0.0
    spills: int = 0          # iterations whose stream missed its block

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stream_bytes if self.stream_bytes else float("nan")


class CompressedStore:
    def __init__(self, readers: dict[str, list[Reader]], rule: ErrorBoundRule | None = None, backend=None,
                 entropy: str = "huffman"):
        self.readers = readers
        self.rule = rule or ErrorBoundRule()
        self.be = backend
        self.entropy = entropy
        self.spilled: dict[str, bytes] = {}
        self.figures: dict[str, TensorFigures] = {t: TensorFigures() for t in readers}
        self.bilinear_nodes = {r.node for rs in readers.values() for r in rs if r.kind.value == "bilinear"}
        self.compress_s = 0.0
        self.decompress_s = 0.0

    def _host(self, view) -> np.ndarray:
        return np.asarray(self.be.to_host(view)) if self.be is not None else np.asarray(view)

    def compress(self, tid: str, src, block) -> None:
        """Encode `tid` (device view `src`) into the uint8 `block` the plan reserved."""
        t = time.perf_counter()
        x = self._host(src)
        eb = self.rule.bound(x, self.readers[tid])
        stream = sz.compress(x, eb, self.entropy)
        f = self.figures[tid]
        f.raw_bytes, f.stream_bytes, f.reserved_bytes, f.eb = x.nbytes, len(stream), block.nbytes, eb
        if len(stream) <= block.nbytes:
            data = np.frombuffer(stream, np.uint8)
            if self.be is not None:
                self.be.copy_in(block[:len(stream)], data)
            else:
                block[:len(stream)] = data
        else:
            self.spilled[tid] = stream
            f.spills += 1
        self.compress_s += time.perf_counter() - t

    def decompress(self, tid: str, dst, block) -> None:
        """Decode `tid` into `dst` from `block` or the spill."""
        t = time.perf_counter()
        stream = self.spilled.pop(tid, None)
        if stream is None:
            stream = self._host(block)
        y = sz.decompress(stream, dst.shape)
        if self.be is not None:
            self.be.copy_in(dst, y)
        else:
            dst[...] = y
        self.decompress_s += time.perf_counter() - t

    def observe(self, node: str, grads: dict, delta) -> None:
        """After `node`'s backward: feed rule B its weight gradient and output delta."""
        if node in self.bilinear_nodes and "weight" in grads:
            self.rule.observe(node, self._host(grads["weight"]), self._host(delta))

    def ratios(self) -> dict[str, float]:
        """Measured raw / compressed bytes per tensor, for `plan_compress(ratios=...)`."""
        return {t: f.ratio for t, f in self.figures.items() if f.stream_bytes}

    @property
    def spill_count(self) -> int:
        return sum(f.spills for f in self.figures.values())
