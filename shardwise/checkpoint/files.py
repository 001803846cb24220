"""The checkpoint directory on disk: atomic write, manifest and checksums, RNG capture, pruning,
``weights_only`` reads, and the check that a checkpoint fits the model it is loaded into."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardwise.errors import CheckpointError

FORMAT = "shardwise-checkpoint/1"
SHARDED_DIR = "dcp"
_NAME = re.compile(r"^step-(\d{8})$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_file(path: Path, obj: Any) -> None:
    """``torch.save`` to ``path``, flushed and fsynced: for files a strategy adds to a checkpoint
    directory (``Engine.save``'s ``save_extra_state`` hook)."""
    _write(Path(path), obj)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(model_state: dict[str, Any]) -> str:
    """A hash of parameter names and shapes: two models match when it does."""
    items = sorted((k, tuple(v.shape)) for k, v in model_state.items() if isinstance(v, torch.Tensor))
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def capture_rng() -> dict[str, Any]:
    """Every RNG stream this process draws from, as tensors and plain values."""
    np_state: Any = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "key": np_state[0],
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached": float(np_state[4]),
            "state": torch.from_numpy(np_state[1].astype(np.int64)),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["key"], n["state"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def write(
    final: Path,
    *,
    rank: int,
    world_size: int,
    shared: dict[str, Any] | None,
    own: dict[str, Any],
    barrier: Callable[[], None],
    meta: dict[str, Any] | None = None,
    sharded: dict[str, Any] | None = None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write a checkpoint directory ``final`` atomically; every rank calls it (rank 0 passes ``shared``).

    ``sharded`` (every rank, the same keys) is state of DTensors, written collectively with
    ``torch.distributed.checkpoint`` into ``dcp/`` of the temporary directory.
    ``extra(tmp)`` runs on every rank after its own files and before the closing barrier:
    files it puts in the temporary directory (each replica's own state, a parameter server's
    shards, written by the servers themselves) are hashed into the manifest and published by
    the same rename.
    """
    final = Path(final)
    root = final.parent
    tmp = root / f".tmp-{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    _write(tmp / f"rank-{rank:05d}.pt", own)
    if sharded is not None:
        import torch.distributed.checkpoint as dcp  # loaded only for sharded strategies

        dcp.save(sharded, storage_writer=dcp.FileSystemWriter(str(tmp / SHARDED_DIR), sync_files=True))
    if rank == 0:
        if shared is None:
            raise CheckpointError("rank 0 must pass the shared state to write a checkpoint")
        _write(tmp / "state.pt", shared)
    if extra is not None:
        extra(tmp)
    barrier()
    if rank == 0:
        files = {p.relative_to(tmp).as_posix(): {"sha256": sha256(p), "bytes": p.stat().st_size} for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {
            "format": FORMAT,
            "world_size": world_size,
            "created": time.time(),
            "files": files,
            **(meta or {}),
        }
        if sharded is not None:
            manifest["sharded"] = {"dir": SHARDED_DIR, "keys": sorted(sharded)}
        with open(tmp / "manifest.json", "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. the final save): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    barrier()
    return final


def prune(root: Path, keep_last: int, run_id: str | None = None) -> None:
    """Delete all but the newest ``keep_last`` checkpoints under ``root`` written by run lineage
    ``run_id`` (every checkpoint when None); another run's checkpoints are never touched. The newest
    finite checkpoint (`is_finite`) is never deleted, even when ``keep_last`` newer ones are not
    finite: after a run trained on NaN (``on_nonfinite="warn"``) it is the one to go back to."""
    ours = [p for p in list_checkpoints(root) if run_id is None or _run_id(p) == run_id]
    keep = next((p for p in reversed(ours) if is_finite(p)), None)
    for old in ours[:-keep_last] if keep_last > 0 else []:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def is_finite(path: Path) -> bool:
    """Whether a checkpoint's weights came from finite steps only, as its manifest records
    (``"finite"``, written by the Trainer); a checkpoint that does not say (the Engine's, older
    ones) counts as finite, and so does an unreadable one (verification decides about those)."""
    try:
        return read_manifest(Path(path)).get("finite", True) is not False
    except CheckpointError:
        return True


def _run_id(path: Path) -> str | None:
    try:
        return read_manifest(path).get("run_id")
    except CheckpointError:
        return None


def run_id_of(path: Path) -> str | None:
    """The run lineage a checkpoint belongs to (None for checkpoints written before lineages)."""
    return _run_id(Path(path))


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, oldest first (temporary ones excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)), key=lambda p: p.name)


def read_manifest(path: Path) -> dict[str, Any]:
    path = Path(path)
    mf = path / "manifest.json"
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: it is not a directory (expected one holding manifest.json)")
    if not mf.exists():
        raise CheckpointError(f"{path} is not a shardwise checkpoint: it has no manifest.json (an unfinished or foreign write)")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"the manifest of {path} is damaged ({exc})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"the manifest of {path} is damaged (it holds a JSON {type(manifest).__name__}, not an object)")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}; this shardwise reads {FORMAT!r}")
    return manifest


def verify(path: Path) -> dict[str, Any]:
    """Check every file against the manifest; returns the manifest or raises `CheckpointError`."""
    manifest = read_manifest(path)
    for name, info in manifest["files"].items():
        f = Path(path) / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        if f.stat().st_size != info["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {name} has {f.stat().st_size} bytes, the manifest says {info['bytes']} (truncated?)")
        if sha256(f) != info["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its checksum (damaged after writing)")
    return manifest


def latest_valid(root: Path, *, finite: bool = False) -> Path | None:
    """The newest checkpoint under ``root`` that verifies and loads; damaged ones are skipped with a warning.

    Verifying is the manifest's checksums; loading is every ``.pt`` file through `load_file`
    (``weights_only``: tensors and plain data, nothing else unpickled), so a file that matches its
    checksum but holds something else (written over, manifest and all) is skipped too, the same way
    on every rank, before any rank starts to load it. ``finite`` (``resume="auto"``) also skips, with
    a warning, checkpoints whose manifest says their weights saw a non-finite step (`is_finite`):
    resuming from NaN weights trains nothing; pass such a checkpoint's path to take it anyway."""
    for path in reversed(list_checkpoints(root)):
        if finite and not is_finite(path):
            warnings.warn(
                f"skipping checkpoint {path}: it was saved after a non-finite step (its manifest says finite: false); resume=<its path> takes it anyway",
                stacklevel=2,
            )
            continue
        try:
            manifest = verify(path)
            for name in manifest["files"]:
                if name.endswith(".pt") and not name.startswith(SHARDED_DIR + "/"):
                    load_file(Path(path) / name)
            return path
        except CheckpointError as exc:
            warnings.warn(f"skipping damaged checkpoint: {exc}", stacklevel=2)
    return None


def load_file(path: Path) -> Any:
    """``torch.load`` with ``weights_only=True`` and errors a user can act on."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"cannot read {path}: it is truncated, damaged, or not a checkpoint written by shardwise/torch.save of tensors ({first})"
        ) from None


def load_shared(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint's ``state.pt``, with a model and optimizer written in parts (one per rank) merged whole."""
    from shardwise.checkpoint.parts import join

    return join(Path(path), load_file(Path(path) / "state.pt"), load_file)


def read(path: Path, rank: int, *, verify_files: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """Load (shared state, this rank's own state or None, manifest) from a checkpoint directory."""
    path = Path(path)
    manifest = verify(path) if verify_files else read_manifest(path)
    shared = load_shared(path)
    own_path = path / f"rank-{rank:05d}.pt"
    own = load_file(own_path) if own_path.exists() else None
    return shared, own, manifest


RESUME_FIX = "Resume with the model it was saved from, or start a fresh run in another --out directory"


def check_model_state(expected: dict[str, Any], found: dict[str, Any], path: Path, fix: str = RESUME_FIX) -> None:
    """A clear error when a checkpoint's model does not match the model being trained (``fix``: how
    to mend it, in the words of the command that read the checkpoint)."""
    exp = {k: tuple(v.shape) for k, v in expected.items() if isinstance(v, torch.Tensor)}
    got = {k: tuple(v.shape) for k, v in found.items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(exp) - set(got))
    unexpected = sorted(set(got) - set(exp))
    shapes = sorted(k for k in set(exp) & set(got) if exp[k] != got[k])
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} (e.g. {unexpected[:3]})")
        if shapes:
            parts.append("different shapes for " + ", ".join(f"{k}: checkpoint {got[k]} vs model {exp[k]}" for k in shapes[:3]))
        raise CheckpointError(f"checkpoint {path} was saved from another model: " + "; ".join(parts) + f". {fix}")
