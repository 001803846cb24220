"""What ``shardwise plot`` reads from a run directory, as plain series (no drawing here).

A run directory holds ``metrics.jsonl`` (one object per logged step: ``step``, ``train_loss``,
``lr``, ``samples_per_s``; and one per evaluation: ``step``, ``val_loss``, ``val_<metric>``,
``val_samples``) and ``summary.json`` (``global_batch_size``, ``comm``, and each strategy's
section: ``memory_per_rank`` from the ZeRO / FSDP family, ``pipeline`` with its ``timeline``).
The functions here turn those into the numbers each chart draws, so a test can hold a chart's
data to the files it came from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError

Series = tuple[list[float], list[float]]
"""(x, y) of one line."""


@dataclass(frozen=True)
class Run:
    path: Path
    label: str
    records: list[dict[str, Any]]
    """metrics.jsonl, one dict per line."""
    summary: dict[str, Any]
    """summary.json ({} when the run has none yet: still running, or stopped)."""


def read_run(path: str | Path, label: str | None = None) -> Run:
    """A run directory's metrics and summary; a directory with neither is a one-line error."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{path} is not a directory; shardwise plot takes run directories (the --out of shardwise train)")
    metrics, summary = root / "metrics.jsonl", root / "summary.json"
    if not metrics.exists() and not summary.exists():
        raise ConfigError(f"{path} holds no metrics.jsonl or summary.json; is it the --out directory of a run?")
    records = []
    if metrics.exists():
        for n, line in enumerate(metrics.read_text().splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except ValueError:
                    raise ConfigError(f"{metrics} line {n} is not JSON: {line[:80]!r}") from None
    doc: dict[str, Any] = {}
    if summary.exists():
        try:
            doc = json.loads(summary.read_text())
        except ValueError:
            raise ConfigError(f"{summary} is not valid JSON") from None
    return Run(root, label or root.resolve().name, records, doc)


def labels_for(paths: list[str]) -> list[str]:
    """Short distinct names: the directory name, with its parent's when two names are the same."""
    names = [Path(p).resolve().name for p in paths]
    return [f"{Path(p).resolve().parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(paths, names, strict=True)]


def _value(v: Any) -> float:
    return math.nan if v is None else float(v)  # metrics.jsonl writes NaN and infinities as null


def curve(run: Run, key: str) -> Series:
    """(step, value) of every record that has ``key``, in file order."""
    pts = [(float(r["step"]), _value(r[key])) for r in run.records if key in r and "step" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def val_metrics(run: Run) -> list[str]:
    """The evaluation keys other than the loss and the sample count, in first-seen order."""
    keys: list[str] = []
    for r in run.records:
        keys += [k for k in r if k.startswith("val_") and k not in ("val_loss", "val_samples") and k not in keys]
    return keys


def throughput(run: Run) -> Series:
    """(seconds since training started, samples per second) at each log step.

    The log lines carry the rate over each interval since the previous log, not a clock: the
    interval lasted ``(steps since the last log) x global batch / rate`` seconds (evaluations and
    checkpoints inside it included, as the Trainer measures the rate), so the times add up to the
    wall time of each log since the loop started.
    """
    batch = run.summary.get("global_batch_size")
    rows = [r for r in run.records if r.get("samples_per_s") and "step" in r]
    if not rows:
        return [], []
    if not batch:
        raise ConfigError(f"{run.path}: summary.json has no global_batch_size to turn rates into time (is the run finished?)")
    t, last, xs, ys = 0.0, None, [], []
    for r in rows:
        steps = r["step"] - last if last is not None else r["step"]
        last = r["step"]
        t += steps * batch / r["samples_per_s"]
        xs.append(t)
        ys.append(float(r["samples_per_s"]))
    return xs, ys


MEMORY_KINDS = ("params", "grads", "optimizer", "activations")


def memory(run: Run) -> dict[str, dict[str, float]] | None:
    """``{kind: {"measured": bytes, "predicted": bytes}}`` per rank from ``memory_per_rank``; None without it."""
    section = run.summary.get("memory_per_rank")
    if not isinstance(section, Mapping):
        return None
    out = {}
    for kind in (*MEMORY_KINDS, "total"):
        entry = section.get(kind)
        if isinstance(entry, Mapping) and ("measured" in entry or "predicted" in entry):
            out[kind] = {k: float(entry[k]) for k in ("measured", "predicted") if entry.get(k) is not None}
    return out or None


def comm(run: Run) -> dict[str, dict[str, float]] | None:
    """``{group/op: {"sent": bytes per step, "received": ..., "calls": per step}}`` for every operation
    that moved bytes (rank 0's record: summary.json holds rank 0's recorder)."""
    section = run.summary.get("comm")
    if not isinstance(section, Mapping) or not section.get("by_op"):
        return None
    steps = max(float(section.get("steps") or 1), 1.0)
    out = {}
    for name, t in section["by_op"].items():
        if t.get("sent_bytes", 0) or t.get("received_bytes", 0):
            out[name] = {"sent": t.get("sent_bytes", 0) / steps, "received": t.get("received_bytes", 0) / steps, "calls": t.get("count", 0) / steps}
    return out or None


def comm_per_rank(run: Run) -> dict[int, dict[str, dict[str, float]]] | None:
    """``{rank: {group/op: {"sent": bytes per step, "received": ...}}}`` from each rank's
    ``comm/rank-RRRRR.json`` (every rank of the run's world size, servers included: a rank that
    served is divided by the training steps); None when the run wrote no such files (older runs)."""
    root = run.path / "comm"
    world = run.summary.get("world_size")
    steps = max(float(run.summary.get("steps_this_run") or run.summary.get("steps") or 1), 1.0)
    out: dict[int, dict[str, dict[str, float]]] = {}
    for path in sorted(root.glob("rank-*.json")) if root.is_dir() else []:
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            raise ConfigError(f"{path} is not valid JSON") from None
        if world is not None and doc.get("world_size") != world:
            continue  # left by an earlier run at another world size
        per = max(float(doc.get("steps") or steps), 1.0)
        out[int(doc["rank"])] = {
            name: {"sent": t.get("sent_bytes", 0) / per, "received": t.get("received_bytes", 0) / per}
            for name, t in doc.get("by_op", {}).items()
            if t.get("sent_bytes", 0) or t.get("received_bytes", 0)
        }
    return out if any(out.values()) else None


@dataclass(frozen=True)
class Breakdown:
    """The profiler's step breakdown (summary.json's ``profile``, `shardwise.trainer.profile`)."""

    parts: list[str]
    """The parts that partition a step, in order (data, forward, backward, comm_exposed, optimizer, idle)."""
    per_rank: dict[int, dict[str, float]]
    """Rank -> seconds of each part per step (mean over the profiled window); ranks that did not train left out."""
    measured: dict[int, float]
    """Rank -> the step time measured outside the profiler."""
    window: list[int]
    """First and last profiled step."""


def breakdown(run: Run) -> Breakdown | None:
    """Where each rank's step went, from the profiler's section; None when the run was not profiled."""
    section = run.summary.get("profile")
    if not isinstance(section, Mapping) or not section.get("parts") or not section.get("per_rank"):
        return None
    parts = [str(p) for p in section["parts"]]
    per_rank = {r: {p: float(row[p]) for p in parts} for r, row in enumerate(section["per_rank"]) if isinstance(row, Mapping)}
    measured = {r: float(row["measured_step"]) for r, row in enumerate(section["per_rank"]) if isinstance(row, Mapping) and "measured_step" in row}
    return Breakdown(parts, per_rank, measured, [int(s) for s in section.get("window", [])]) if per_rank else None


def timeline_events(run: Run) -> tuple[list[tuple[int, int, str, float, float]], int, str] | None:
    """A pipeline run's recorded timeline (the ``<timeline>.json`` it wrote): events, pp, schedule."""
    section = run.summary.get("pipeline")
    if not isinstance(section, Mapping) or not section.get("timeline"):
        return None
    written = Path(str(section["timeline"]) + ".json")
    for candidate in (written, run.path / written.name):  # the run directory may have moved
        if candidate.exists():
            doc = json.loads(candidate.read_text())
            events = [(int(e["stage"]), int(e["microbatch"]), str(e["kind"]), float(e["start_s"]), float(e["end_s"])) for e in doc["events"]]
            return events, int(doc["pp"]), str(doc["schedule"])
    return None
