"""Checkpoints that cannot lie: written atomically, verified on load, matched against the run that resumes.

Format: one `.npz` of parameters and buffers by qualified name, optimizer state under `optim/<layer>.<param>.<slot>`,
`__manifest__` (JSON: the caller's metadata; each array's shape, dtype, SHA-256) and `__manifest_sha256__`.
Rules (tests/runtime/test_checkpoint.py):
1. The file on disk is always complete, old or new, whenever the writer dies: temp file beside it, fsync, rename,
   fsync of the directory. The next save to the path removes dead writers' temporaries.
2. The path written is the path given: no `.npz` appended, no directory created.
3. Every load verifies the whole file; damage or a foreign file is one `CheckpointError`, never a zip/pickle
   traceback. Only real-number arrays, nothing cast.
4. Whether a checkpoint fits the resuming run is decided from the manifest (`resume_problems`, `compare_data`).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
from pathlib import Path

import numpy as np

from ..core.errors import CheckpointError

MANIFEST_KEY = "__manifest__"
MANIFEST_HASH_KEY = "__manifest_sha256__"
OPT_PREFIX = "optim/"
FORMAT = "minidl-checkpoint"
VERSION = 2
_TMP_SUFFIX = ".tmp"

# test hooks, called with the temporary path around the rename (the crash test kills the writer there)
_before_rename = None
_after_rename = None


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).view(np.uint8).reshape(-1) if arr.size else b"").hexdigest()


def _check_dtype(name: str, arr: np.ndarray, path) -> None:
    dt = np.asarray(arr).dtype
    if not (np.issubdtype(dt, np.floating) or np.issubdtype(dt, np.integer)):
        raise CheckpointError(f"{path}: array {name!r} has dtype {dt}; a checkpoint holds real numbers only "
                              f"(float or integer), nothing is cast")


def _target(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"cannot save a checkpoint to {path}: it is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise CheckpointError(f"cannot save a checkpoint to {path}: directory {parent} does not exist (it is not "
                              f"created for you)")
    return path


def _tmp_prefix(path: Path) -> str:
    return f".{path.name}."


def clean_stale_temps(path: str | Path) -> list[Path]:
    """Remove the temporaries (`.<name>.<pid>.<random>.tmp`) of dead writers of `path`; return them."""
    path = Path(path)
    pat = re.compile(re.escape(_tmp_prefix(path)) + r"(\d+)\.[^.]+" + re.escape(_TMP_SUFFIX) + "$")
    removed = []
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = pat.match(p.name)
        if not m or _alive(int(m.group(1))):
            continue
        try:
            p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems refuse fsync on a directory; the rename is still atomic
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _create_temp(path: Path) -> tuple[int, str]:
    """A new temporary beside `path`, mode 0666 less the umask (mkstemp's 0600 would survive the rename)."""
    for _ in range(100):
        tmp = str(path.parent / f"{_tmp_prefix(path)}{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise CheckpointError(f"cannot create a temporary file beside {path}: 100 names were all taken")


def atomic_savez(path: str | Path, arrays: dict[str, np.ndarray]) -> Path:
    """Write `arrays` as an uncompressed npz at exactly `path`, atomically (rule 1)."""
    path = _target(path)
    clean_stale_temps(path)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        if _before_rename is not None:
            _before_rename(tmp)
        os.replace(tmp, path)
        if _after_rename is not None:
            _after_rename(tmp)
        _fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def save_checkpoint(path: str | Path, params: dict[str, np.ndarray], optimizer_state: dict[str, np.ndarray] | None,
                    meta: dict) -> Path:
    """Write a checkpoint at exactly `path`; `meta` must be JSON-serializable."""
    arrays: dict[str, np.ndarray] = {}
    for k, v in params.items():
        arrays[k] = np.asarray(v)
    for k, v in (optimizer_state or {}).items():
        arrays[OPT_PREFIX + k] = np.asarray(v)
    for k, v in arrays.items():
        _check_dtype(k, v, path)
    manifest = {"format": FORMAT, "version": VERSION, "meta": meta,
                "has_optimizer_state": optimizer_state is not None,
                "arrays": {k: {"shape": list(v.shape), "dtype": v.dtype.str, "sha256": _digest(v)}
                           for k, v in arrays.items()}}
    blob = json.dumps(manifest, sort_keys=True).encode()
    arrays[MANIFEST_KEY] = np.frombuffer(blob, dtype=np.uint8)
    arrays[MANIFEST_HASH_KEY] = np.frombuffer(hashlib.sha256(blob).hexdigest().encode(), dtype=np.uint8)
    return atomic_savez(path, arrays)


def _open(path: Path):
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory, not a file")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): the write that made it did not complete")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"PK\x03\x04":
        kind = "a pickle" if head[:1] == b"\x80" else "a bare .npy array" if head == b"\x93NUM" else "not an npz"
        raise CheckpointError(f"{path} is not a minidl checkpoint ({kind}: it does not start like a zip archive)")
    try:
        return np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 -- a damaged zip raises anything (BadZipFile, zlib.error, ...)
        raise CheckpointError(f"checkpoint {path} is damaged (truncated or corrupted): "
                              f"{type(e).__name__}: {e}") from None


def _read(z, key: str, path: Path) -> np.ndarray:
    try:
        return z[key]
    except Exception as e:  # noqa: BLE001 -- as in _open
        raise CheckpointError(f"checkpoint {path} is damaged: array {key!r} cannot be read "
                              f"({type(e).__name__}: {e})") from None


def read_manifest(path: str | Path) -> dict:
    """The verified manifest of a checkpoint (its own hash checked), without reading the arrays."""
    path = Path(path)
    with _open(path) as z:
        return _manifest(z, path)


def _manifest(z, path: Path) -> dict:
    files = set(z.files)
    if MANIFEST_KEY not in files or MANIFEST_HASH_KEY not in files:
        old = " (written by an older minidl, without a manifest)" if "__meta__" in files else ""
        raise CheckpointError(f"{path} is not a minidl checkpoint{old}: it has no manifest")
    blob = bytes(_read(z, MANIFEST_KEY, path))
    want = bytes(_read(z, MANIFEST_HASH_KEY, path)).decode(errors="replace")
    if hashlib.sha256(blob).hexdigest() != want:
        raise CheckpointError(f"checkpoint {path} is damaged: its manifest does not match its checksum")
    try:
        manifest = json.loads(blob.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is damaged: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a minidl checkpoint (format {manifest.get('format')!r})")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {manifest.get('version')} is not supported "
                              f"(this minidl reads version {VERSION})")
    return manifest


def load_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """(parameters, optimizer state, metadata + `has_optimizer_state`), every array verified (rule 3)."""
    path = Path(path)
    with _open(path) as z:
        manifest = _manifest(z, path)
        listed = manifest["arrays"]
        present = set(z.files) - {MANIFEST_KEY, MANIFEST_HASH_KEY}
        missing, extra = sorted(set(listed) - present), sorted(present - set(listed))
        if missing or extra:
            raise CheckpointError(f"checkpoint {path} is damaged: arrays missing {missing[:5]}, not in its "
                                  f"manifest {extra[:5]}")
        params, opt = {}, {}
        for k, spec in listed.items():
            arr = _read(z, k, path)
            _check_dtype(k, arr, path)
            if list(arr.shape) != spec["shape"] or arr.dtype.str != spec["dtype"] or _digest(arr) != spec["sha256"]:
                raise CheckpointError(f"checkpoint {path} is damaged: array {k!r} does not match its checksum")
            if k.startswith(OPT_PREFIX):
                opt[k[len(OPT_PREFIX):]] = arr
            else:
                params[k] = arr
    meta = dict(manifest["meta"])
    meta["has_optimizer_state"] = bool(manifest["has_optimizer_state"])
    return params, opt, meta


def network_fingerprint(named: dict[str, tuple[tuple[int, ...], str]]) -> list[list]:
    """[[name, shape, dtype], ...] sorted by name: what a checkpoint's parameters must match."""
    return [[k, list(shape), str(dtype)] for k, (shape, dtype) in sorted(named.items())]


def compare_networks(saved: list, current: list) -> list[str]:
    """What differs between two fingerprints, in words (empty: identical)."""
    a = {k: (tuple(s), d) for k, s, d in saved}
    b = {k: (tuple(s), d) for k, s, d in current}
    out = []
    only_saved, only_now = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_saved:
        out.append(f"parameters only in the checkpoint: {', '.join(only_saved[:5])}"
                   f"{' ...' if len(only_saved) > 5 else ''}")
    if only_now:
        out.append(f"parameters only in this network: {', '.join(only_now[:5])}{' ...' if len(only_now) > 5 else ''}")
    for k in sorted(set(a) & set(b)):
        if a[k] != b[k]:
            out.append(f"{k}: {a[k][0]} {a[k][1]} in the checkpoint, {b[k][0]} {b[k][1]} here")
    return out


def compare_optimizers(saved: dict, current: dict, slots_saved: list, slots_now: list) -> list[str]:
    """What differs between two optimizer configurations, except `lr` (another rate keeps the state's meaning)."""
    out = []
    if saved.get("type") != current.get("type"):
        return [f"optimizer {saved.get('type')} in the checkpoint, {current.get('type')} here"]
    if list(slots_saved) != list(slots_now):
        out.append(f"optimizer state slots {list(slots_saved)} in the checkpoint, {list(slots_now)} here")
    for k in sorted(set(saved) | set(current)):
        if k != "lr" and saved.get(k) != current.get(k):
            out.append(f"optimizer {k}: {saved.get(k)} in the checkpoint, {current.get(k)} here")
    return out


REPLAY_LIMIT_SAMPLES = 10**8
"""Samples a resume from a bare batch count may reshuffle to find its place (one permutation per epoch: ~1 s)."""


def check_positions(meta: dict, path) -> tuple[int, int]:
    """(iteration, batches_consumed), integers with 0 <= batches_consumed <= iteration (one batch per step)."""
    it, bc = meta.get("iteration"), meta.get("batches_consumed")
    for what, v in (("iteration", it), ("batches_consumed", bc)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CheckpointError(f"checkpoint {path}: {what} is {v!r}, not a count >= 0")
    if bc > it:
        raise CheckpointError(f"checkpoint {path}: batches_consumed {bc} exceeds iteration {it} (one batch per "
                              f"step): the metadata is inconsistent")
    return it, bc


def check_data_position(meta: dict, consumed: int, path) -> dict | None:
    """The `BatchIterator.position()` to resume at, refused unless it is where `consumed` batches of the recorded
    batch end in the recorded data. None: at the start, or only a count is recorded (then skipped epoch by epoch,
    up to `REPLAY_LIMIT_SAMPLES`)."""
    pos, batch = meta.get("data_position"), meta.get("batch")
    samples = (meta.get("data") or {}).get("samples")
    if consumed == 0 and pos in (None, {"epoch": -1, "offset": 0, "rng": None}):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (samples, batch)) \
            or samples < batch:
        raise CheckpointError(f"checkpoint {path}: batches_consumed is {consumed}, but the data set ({samples} "
                              f"samples) and global batch ({batch}) it records cannot have given that many")
    per_epoch = samples // batch
    if pos is None:
        epochs = consumed // per_epoch
        if epochs * samples > REPLAY_LIMIT_SAMPLES:
            raise CheckpointError(f"checkpoint {path} has no data position, only batches_consumed = {consumed}: "
                                  f"finding that place in the data order would shuffle {epochs} epochs of "
                                  f"{samples} samples again; resume with --resume-params-only (the parameters "
                                  f"alone) instead")
        return None
    epoch, offset = (pos.get("epoch"), pos.get("offset")) if isinstance(pos, dict) else (None, None)
    exact = all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, offset)) and epoch >= 0 \
        and 0 <= offset <= per_epoch * batch and offset % batch == 0
    if not exact or epoch * per_epoch + offset // batch != consumed:
        raise CheckpointError(f"checkpoint {path}: its data position (epoch {epoch}, offset {offset}) is not where "
                              f"batches_consumed = {consumed} batches of {batch} end in {samples} samples "
                              f"({per_epoch} batches per epoch): the metadata is inconsistent")
    try:
        np.random.default_rng().bit_generator.state = pos.get("rng")
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: its data position's generator state is unusable "
                              f"({type(e).__name__}: {e})") from None
    return pos


def resume_problems(meta: dict, *, fingerprint: list, optimizer: dict, slots: list, seed: int, batch: int) -> list[str]:
    """Everything that keeps a checkpoint from resuming this run exactly, in words (empty: it resumes exactly)."""
    out = compare_networks(meta.get("fingerprint", []), fingerprint)
    saved_opt = meta.get("optimizer") or {}
    out += compare_optimizers(saved_opt, optimizer, meta.get("optimizer_slots", []), slots)
    if slots and not meta.get("has_optimizer_state", False):
        out.append(f"the checkpoint has no optimizer state ({', '.join(slots)} would restart from zero)")
    if meta.get("seed") != seed:
        out.append(f"seed {meta.get('seed')} in the checkpoint, {seed} here (the data order and dropout masks "
                   f"follow it)")
    if meta.get("batch") != batch:
        out.append(f"batch size {meta.get('batch')} in the checkpoint, {batch} here")
    return out


# what a resumed run's data must share with the checkpoint's: not its source (one file has many spellings)
_DATA_COMPARED = ("image_shape", "num_classes", "samples", "transform")


def compare_data(saved: dict | None, current: dict) -> list[str]:
    """What differs between the checkpoint's recorded data set and the one given now."""
    if not saved:
        return []
    return [f"data {k}: {saved.get(k)} in the checkpoint, {current.get(k)} here" for k in _DATA_COMPARED
            if k in saved and saved.get(k) != current.get(k)]
