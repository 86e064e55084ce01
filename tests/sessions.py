"""Test helpers that build sessions take `Session`'s keywords and `RunConfig`'s fields alike, so that a test names
only what it varies (`train(..., debug=True)`); `session_kw` moves the fields into one `config`."""
from __future__ import annotations

from dataclasses import fields

from minidl.runtime.session import RunConfig

CONFIG_FIELDS = frozenset(f.name for f in fields(RunConfig))


def session_kw(kw: dict) -> dict:
    """`kw` with its RunConfig fields gathered into `config` (one given as `config=` already is kept)."""
    rest = {k: v for k, v in kw.items() if k not in CONFIG_FIELDS}
    picked = {k: v for k, v in kw.items() if k in CONFIG_FIELDS}
    if picked:
        if rest.get("config") is not None:
            raise TypeError(f"give {sorted(picked)} either as keywords or in config=, not both")
        rest["config"] = RunConfig(**picked)
    return rest
