"""The run directory's rules: one run per directory, and nothing another run wrote is lost.

A directory that already holds a run is refused before anything starts, unless ``resume``
continues it or ``overwrite=True`` moves its files aside into ``replaced-<time>/`` (nothing is
deleted); every checkpoint records its run lineage (``run_id``), and pruning deletes only
checkpoints of the same lineage. Design notes (why, and what a run writes: ``metrics.jsonl``,
``summary.json``): docs/checkpoint.md, "The run directory" and "Run outputs".
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from shardwise.errors import ConfigError

RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints", "errors", "csv", "tensorboard", "mlruns", "wandb", "profile")
"""What a run writes into `out` (the loggers and the profiler theirs too): what `move_aside` moves."""


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def held_run(out: str | os.PathLike[str]) -> str | None:
    """What an earlier run left in ``out`` (one line), or None when it holds no run."""
    root = Path(out)
    if not root.is_dir():
        return None
    found = [name for name in ("metrics.jsonl", "summary.json") if (root / name).exists()]
    checkpoints = sorted(p.name for p in (root / "checkpoints").iterdir() if p.is_dir()) if (root / "checkpoints").is_dir() else []
    if checkpoints:
        found.append(f"checkpoints/ ({len(checkpoints)}, newest {checkpoints[-1]})")
    if not found:
        return None
    step = None
    try:
        step = json.loads((root / "summary.json").read_text()).get("steps")
    except (OSError, ValueError):
        pass
    return ", ".join(found) + (f"; it ran to step {step}" if step is not None else "")


def check_out(out: str | None, resume: str | None, overwrite: bool) -> None:
    """Refuse a run directory that holds another run unless resume or overwrite says what to do."""
    if out is None or resume is not None or overwrite:
        return
    held = held_run(out)
    if held is not None:
        raise ConfigError(
            f"the run directory {out} already holds a run ({held}). Continue it with resume='auto' "
            f"(--resume auto), move it aside with overwrite=True (--overwrite: its files go to "
            f"{out}/replaced-<time>/, nothing is deleted), or choose another out directory"
        )


def move_aside(out: str | os.PathLike[str]) -> Path | None:
    """Move an earlier run's files in ``out`` into ``out/replaced-<time>/``; returns that directory."""
    root = Path(out)
    present = [root / name for name in RUN_FILES if (root / name).exists()]
    if not present:
        return None
    aside = root / time.strftime("replaced-%Y%m%d-%H%M%S", time.gmtime())
    n = 1
    while aside.exists():
        n += 1
        aside = root / time.strftime(f"replaced-%Y%m%d-%H%M%S-{n}", time.gmtime())
    aside.mkdir()
    for path in present:
        os.replace(path, aside / path.name)
    return aside


def describe_outputs(out: str | None, checkpoint_every: int | None, keep_last: int) -> str:
    """The run's first line about what is saved where."""
    if out is None:
        return "shardwise: no out directory: nothing is saved (metrics, summary and checkpoints need out=... / --out DIR)"
    every = f"every {checkpoint_every} steps and at the end" if checkpoint_every else "at the end"
    return f"shardwise: run directory {out}: metrics.jsonl, summary.json, checkpoints/ ({every}, the last {keep_last} of this run kept)"
