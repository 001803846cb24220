"""The run directory's rules: one run per directory, and nothing another run wrote is lost.

A run writes ``metrics.jsonl``, ``summary.json`` and ``checkpoints/`` into its ``out``
directory. A second run into the same directory would mix with the first (keep-last pruning
by step number deleting the new run's checkpoints, ``resume="auto"`` picking the old run), so:

- a directory that already holds a run is refused before anything starts, unless
  ``resume`` says to continue it or ``overwrite=True`` says to replace it;
- ``overwrite`` moves the old run's files aside into ``replaced-<time>/`` (nothing is
  deleted), and says so;
- every checkpoint records its run lineage (``run_id``; a resumed run keeps the id of the
  checkpoint it resumed from), and pruning deletes only checkpoints of the same lineage.

Design notes: Run outputs
=========================

One directory holds one run (`shardwise.checkpoint.rundir`): an `out` that holds `metrics.jsonl`,
`summary.json` or checkpoints is refused before launch unless `resume` continues it or
`overwrite=True` moves its files into `out/replaced-<time>/` (nothing is deleted). Each
checkpoint's manifest records its `run_id` (a resume takes the id of the checkpoint it resumed
from), and keep-last pruning deletes only checkpoints of the same id. The first printed line
says where metrics, summary and checkpoints go, or that nothing is saved without `out`. A
resume drops `metrics.jsonl` lines of steps after the resumed checkpoint (the replayed steps log
again, once); a run stopped between log steps logs its last step; every key `validation_step`
returns is logged as `val_<key>`; resuming a run that already reached its last step trains
nothing and says so (`already_finished` in its summary, no NaN). Under data parallelism,
`sync_batchnorm=True` replaces BatchNorm with `strategies.batchnorm.SyncBatchNorm` (statistics
of the global batch: one differentiable all-reduce of sum, sum of squares and count per layer in
forward and the same in backward; torch's own is CUDA-only), and a model with BatchNorm trained
data-parallel without it gets a warning at start. ddp's own C++ bucket allreduce is not timed,
so its `comm` entry has no `seconds` (it was a misleading 0.0; `record_buckets=True` times it).

Rank 0 writes `metrics.jsonl` (a line per log step and per evaluation) and `summary.json`
(`strategy`, `world_size`, `precision`, `global_batch_size`, `accumulate`, `steps`,
`steps_this_run`, `samples`, `wall_s`, `train_s`, `samples_per_s`, `train_loss`, `val_loss`,
`val_<metric>`, `val_samples`, `resumed_from`, `last_checkpoint`, `comm` and each strategy's
own section). `comm.by_op` is keyed `group/op` with count, payload bytes, bytes sent and
received per rank, seconds. For library collectives the sent/received bytes are the
bandwidth-optimal figures nccl-tests uses (allreduce `2(p-1)/p n`), stated as such in
`shardwise/comm/recorder.py`.
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
