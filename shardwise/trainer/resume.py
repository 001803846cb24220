"""Resuming a fit: which checkpoint ``resume`` names (``"auto"``: the newest finite one of the run), and
a run that had already reached its last step."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from shardwise import checkpoint as ckpt
from shardwise.engine import Engine

if TYPE_CHECKING:
    from shardwise.trainer.loop import Trainer

__all__ = ["already_finished", "restore"]


def restore(trainer: Trainer, engine: Engine, state: dict[str, Any]) -> Path | None:
    """Load the checkpoint ``resume`` names into ``state`` (every rank); its path, or None for a fresh start."""
    cfg = trainer.config
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        assert cfg.out is not None
        with warnings.catch_warnings(record=True) as skipped:  # said as the run's own lines, not as Python warnings
            warnings.simplefilter("always")
            path = ckpt.latest_valid(Path(cfg.out) / "checkpoints", finite=True)  # never back onto NaN weights
        for w in skipped:
            engine.print(f"shardwise: resume='auto': {w.message}")
        if path is None:
            engine.print("resume='auto': no checkpoint yet, starting fresh")
            return None
    else:
        path = Path(cfg.resume)
    plain = engine.load(path, state)
    state["counters"] = dict(plain["counters"])
    return path


def already_finished(
    trainer: Trainer, engine: Engine, wrapped: nn.Module, state: dict[str, Any], resumed_from: Path, step: int, total: int, return_state: bool
) -> tuple[dict[str, Any], Any]:
    """Resuming a run that already reached its last step: say so, train nothing, return its summary.
    A checkpoint from elsewhere is saved into this run's directory, so ``out`` holds what it continued."""
    cfg = trainer.config
    engine.print(f"shardwise: the run already finished at step {step} (max steps {total}); nothing to train")
    root = Path(cfg.out) / "checkpoints" if cfg.out else None
    if root is not None and Path(resumed_from).resolve().parent != root.resolve():
        summary_path = trainer._save(engine, state, root)
    else:
        summary_path = Path(resumed_from)
    strategy_section = engine.finish()  # the strategy's end of run (parameter servers stop)
    summary: dict[str, Any] = {}
    if cfg.out and (Path(cfg.out) / "summary.json").exists():
        try:
            summary = json.loads((Path(cfg.out) / "summary.json").read_text())
        except ValueError:
            summary = {}
    summary.update(
        {
            "strategy": cfg.strategy,
            "world_size": engine.world_size,
            "steps": step,
            "steps_this_run": 0,
            "already_finished": True,
            "resumed_from": str(resumed_from),
            **strategy_section,
        }
    )
    summary.pop("samples_per_s", None)
    summary["last_checkpoint"] = str(summary_path)
    model_state = None
    if return_state:
        full = engine.consolidated_state_dict(wrapped)  # collective under sharded strategies: every rank
        model_state = full if engine.is_rank_zero else None
    return summary, model_state
