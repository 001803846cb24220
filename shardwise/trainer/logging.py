"""Rank-0 output: a progress bar (or plain lines when not on a terminal), metrics.jsonl, summary.json."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, TextIO


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class Progress:
    """What rank 0 shows while training; other ranks stay silent."""

    def __init__(self, *, enabled: bool, total: int, initial: int = 0, bar: bool | None = None, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        use_bar = self.stream.isatty() if bar is None else bar
        self._bar = None
        if enabled and use_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=self.stream)

    def update(self, steps: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix({k: _fmt(v) for k, v in metrics.items() if k != "step"}, refresh=False)
            self._bar.update(steps)
        elif "train_loss" in metrics or "val_loss" in metrics:
            text = "  ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
            print(text, file=self.stream, flush=True)

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class RunFiles:
    """metrics.jsonl and summary.json in the run directory (rank 0 only)."""

    def __init__(self, out: str | None, enabled: bool, *, append: bool, after_step: int | None = None) -> None:
        """``append``: continue metrics.jsonl (a resume); records of steps after ``after_step`` (the
        resumed checkpoint's step, replayed now) are dropped first, so no step is logged twice."""
        self.dir = Path(out) if out else None
        self.enabled = enabled and self.dir is not None
        self._metrics: TextIO | None = None
        if self.enabled:
            assert self.dir is not None
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.dir / "metrics.jsonl"
            if append and after_step is not None and path.exists():
                kept = [line for line in path.read_text().splitlines() if line.strip() and _step_of(line) <= after_step]
                tmp = path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(line + "\n" for line in kept))
                os.replace(tmp, path)
            self._metrics = open(path, "a" if append else "w")

    def log(self, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(_clean(record)) + "\n")
            self._metrics.flush()

    def summary(self, summary: dict[str, Any]) -> None:
        if self.enabled:
            assert self.dir is not None
            tmp = self.dir / "summary.json.tmp"
            tmp.write_text(json.dumps(_clean(summary), indent=2) + "\n")
            os.replace(tmp, self.dir / "summary.json")

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


def write_rank_comm(out: str | None, rank: int, world_size: int, report: dict[str, Any], steps: int | None) -> None:
    """``out/comm/rank-RRRRR.json``: this rank's recorded traffic over the run (every rank writes
    its own, servers included, so ``shardwise plot`` can draw bytes per rank; summary.json's
    ``comm`` is rank 0's). ``steps`` is None on a rank that served rather than stepped."""
    if out is None:
        return
    root = Path(out) / "comm"
    root.mkdir(parents=True, exist_ok=True)
    doc = {"rank": rank, "world_size": world_size, "steps": steps, "by_op": report.get("by_op", {})}
    tmp = root / f"rank-{rank:05d}.json.tmp"
    tmp.write_text(json.dumps(_clean(doc), indent=1) + "\n")
    os.replace(tmp, root / f"rank-{rank:05d}.json")


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0.0


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN and infinities become None (strict JSON has neither)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj
