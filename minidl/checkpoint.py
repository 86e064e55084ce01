"""Checkpoints: written atomically, resumed exactly.

A checkpoint is one `.npz` holding every parameter and buffer under its layer-qualified name, the optimizer state
under `optim/<layer>.<param>.<slot>`, and a small JSON record (iteration, seed, data position, configuration). It
is written to a temporary file in the target directory, flushed to disk, then renamed over the target: a crash
mid-write leaves the previous checkpoint intact, never a truncated one.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

META_KEY = "__meta__"
OPT_PREFIX = "optim/"


def atomic_savez(path: str | Path, arrays: dict[str, np.ndarray]) -> Path:
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def save_checkpoint(path: str | Path, params: dict[str, np.ndarray], optimizer_state: dict[str, np.ndarray] | None,
                    meta: dict) -> Path:
    arrays = dict(params)
    for k, v in (optimizer_state or {}).items():
        arrays[OPT_PREFIX + k] = v
    arrays[META_KEY] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    return atomic_savez(path, arrays)


def load_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    with np.load(path, allow_pickle=False) as z:
        params, opt, meta = {}, {}, {}
        for k in z.files:
            if k == META_KEY:
                meta = json.loads(bytes(z[k]).decode())
            elif k.startswith(OPT_PREFIX):
                opt[k[len(OPT_PREFIX):]] = z[k]
            else:
                params[k] = z[k]
    return params, opt, meta
