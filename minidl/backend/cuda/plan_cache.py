"""cuDNN execution plans on disk, so a later process skips the heuristics query and the plans' builds (where
cuDNN compiles its runtime-fused kernels: the bulk of a first step).

`CudnnGraphs` records each kept plan: its heuristic index (the `cudnn:f<i>` names), engine name, workspace,
`(engine_id, knobs)` and, where the frontend serializes it, the built plan with its tensors' uids. Rules:
- One file per graph, `<folder>/<env>/<digest>.json`, written through a temporary and a rename.
- The key is everything the plans depend on: GPU name and compute capability, cuDNN and frontend versions,
  the `GraphKey`, the plan limit and FORMAT; the file repeats it and is ignored unless it matches.
- An unreadable file is a miss, never an error. Deserializing loads machine code: only this user's folder.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "minidl-cudnn-plans/1"


@dataclass(slots=True, frozen=True)
class PlanEnv:
    """What a serialized plan is valid for besides its graph: the device and the libraries."""

    device: str            # cudaDeviceProp.name
    capability: str        # "9.0"
    cudnn: str             # cudnn.backend_version()
    frontend: str          # cudnn.__version__

    def folder_name(self) -> str:
        raw = f"{self.device}-sm{self.capability}-cudnn{self.cudnn}-fe{self.frontend}"
        return re.sub(r"[^A-Za-z0-9._-]+", "_", raw)


@dataclass(slots=True)
class PlanRecord:
    """One kept plan of a graph: what the planner sees (index, name, workspace) and how to get it back."""

    index: int
    name: str
    workspace_bytes: int
    engine_id: int | None = None
    knobs: list[tuple[str, int]] = field(default_factory=list)   # (knob_type member name, value)
    blob: bytes | None = None                                     # the serialized built plan
    uids: dict[str, int] = field(default_factory=dict)            # tensor name -> uid, for the blob's variant pack

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "workspace_bytes": self.workspace_bytes,
                "engine_id": self.engine_id, "knobs": [list(k) for k in self.knobs],
                "blob": None if self.blob is None else base64.b64encode(self.blob).decode("ascii"),
                "uids": self.uids}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "PlanRecord":
        blob = d.get("blob")
        return cls(int(d["index"]), str(d["name"]), int(d["workspace_bytes"]),
                   None if d.get("engine_id") is None else int(d["engine_id"]),
                   [(str(k), int(v)) for k, v in d.get("knobs", [])],
                   None if blob is None else base64.b64decode(blob),
                   {str(k): int(v) for k, v in d.get("uids", {}).items()})


@dataclass(slots=True)
class GraphEntry:
    """What is cached for one graph: its kept plans, and the numerical-note filters that had to be dropped."""

    plans: list[PlanRecord]
    relaxed: tuple[str, ...] = ()


class PlanStore:
    """The plan files of one device and library set under `folder` (the user cache folder's `cudnn`)."""

    def __init__(self, folder: str | os.PathLike, env: PlanEnv):
        self.env = env
        self.folder = Path(folder) / env.folder_name()

    def key_text(self, key: Any, max_plans: int) -> str:
        """The entry's identity as text: format, environment, the graph key's repr (the same in every
        process), plan limit."""
        return f"{FORMAT}|{self.env}|{key!r}|max_plans={int(max_plans)}"

    def path(self, key: Any, max_plans: int) -> Path:
        digest = hashlib.sha256(self.key_text(key, max_plans).encode()).hexdigest()[:32]
        return self.folder / f"{digest}.json"

    def load(self, key: Any, max_plans: int) -> GraphEntry | None:
        """The cached entry of graph `key`, or None (no file, another key, an unreadable file)."""
        p = self.path(key, max_plans)
        try:
            d = json.loads(p.read_text())
            if d.get("key") != self.key_text(key, max_plans):
                return None
            plans = [PlanRecord.from_json(r) for r in d["plans"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return GraphEntry(plans, tuple(d.get("relaxed", ()))) if plans else None

    def save(self, key: Any, max_plans: int, entry: GraphEntry) -> bool:
        """Write the entry of graph `key` (False where the folder cannot be written)."""
        p = self.path(key, max_plans)
        data = json.dumps({"format": FORMAT, "key": self.key_text(key, max_plans), "relaxed": list(entry.relaxed),
                           "plans": [r.to_json() for r in entry.plans]})
        tmp = None
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=p.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.replace(tmp, p)
        except OSError:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return False
        return True
