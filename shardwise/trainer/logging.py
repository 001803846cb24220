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


# -- memory: every process's peak beside the plan's (issue 37) ---------------------------------


def optimizer_slots(optimizer: Any) -> int:
    """Parameter-shaped tensors the optimizer keeps per parameter, read from its settings: Adam's two
    moments (three with AMSGrad), SGD's momentum buffer, none for plain SGD."""
    group = optimizer.param_groups[0] if getattr(optimizer, "param_groups", None) else {}
    if "betas" in group:
        return 2 + int(bool(group.get("amsgrad", False)))
    return 1 if float(group.get("momentum", 0.0) or 0.0) > 0 else 0


def batch_seq(batch: Any) -> int:
    """Tokens per sample: the last dimension of the first integer tensor of a collated batch (``input_ids``);
    0 when none. Read from a batch the run trained on: the dataset itself is not read again (a sample
    fetched here would be one the run did not train on, and a counting dataset would see it)."""
    import torch

    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else [batch]
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim() >= 2 and not item.is_floating_point():
            return int(item.shape[-1])
    return 0


def runtime_baseline(device: Any) -> float:
    """The calibrated runtime baseline for ``device`` (`shardwise.strategies.cost.cluster.DeviceProfile.runtime_baseline_bytes`):
    the measured cpu profile's on CPU, 0 on a GPU (device memory holds no interpreter) or without a profile."""
    if getattr(device, "type", "cpu") != "cpu":
        return 0.0
    from shardwise.errors import ConfigError
    from shardwise.strategies.cost.cluster import load_profile

    try:
        return float(load_profile("cpu").runtime_baseline_bytes)
    except ConfigError:
        return 0.0


def memory_section(
    engine: Any, start: dict[str, Any], end: dict[str, Any], tensors: Any, *, micro_batch: int, seq: int, optimizer: Any, built_whole: bool
) -> dict[str, Any]:
    """summary.json's ``memory``: each rank's peak at fit start and at the end (one all-reduce of
    world-size rows over the training ranks, through the engine's recorder; a rank outside the loop
    is None), each beside `shardwise.strategies.cost.peak.predict_rank` for it. Every training rank calls it."""
    import torch

    from shardwise.launcher.memory import FIELDS, as_row, from_row
    from shardwise.strategies.cost.peak import predict_rank, role

    width = 1 + 2 * len(FIELDS)
    rows = torch.zeros(engine.world_size, width, dtype=torch.float64, device=engine.device)
    rows[engine.rank] = torch.tensor([1.0, *as_row(start), *as_row(end)], dtype=torch.float64)  # column 0: this rank reported
    engine.all_reduce(rows, "sum")
    layout = engine.layout
    degrees = dict(layout.degrees)
    baseline = runtime_baseline(engine.device)
    slots = optimizer_slots(optimizer)
    ranks: list[dict[str, Any] | None] = []
    for r, row in enumerate(rows.tolist()):
        if row[0] == 0:
            ranks.append(None)
            continue
        n = len(FIELDS)
        pred = predict_rank(
            tensors,
            layout.strategy,
            r,
            degrees,
            units=layout.units or (),
            micro_batch=micro_batch,
            seq=seq // degrees.get("cp", 1),  # a cp rank holds 1/cp of every sequence
            optimizer_slots=slots,
            built_whole=built_whole,
            baseline=baseline,
        )
        ranks.append({"rank": r, "role": role(r, degrees), "start": from_row(row[1 : 1 + n]), "end": from_row(row[1 + n :]), "predicted": pred})
    return {
        "source": start.get("source"),
        "runtime_baseline_bytes": baseline,
        "model_built": "whole (eager)" if built_whole else "meta (each rank its share)",
        "ranks": ranks,
    }


def add_launcher_memory(summary: dict[str, Any], out: str | None, model: Any, received: Any = None, *, show: bool = False) -> dict[str, Any]:
    """The launching process's peak (this process's high-water mark, read after its workers returned)
    into ``summary["memory"]["launcher"]``, beside its prediction: the runtime baseline, the model when
    this process built it eagerly, and the state its workers sent back (``received``, a state dict or
    None); summary.json rewritten with it, and its row printed when ``show``."""
    import torch

    from shardwise.launcher.memory import snapshot

    section = summary.get("memory")
    if not isinstance(section, dict):
        return summary
    baseline = float(section.get("runtime_baseline_bytes") or 0.0)
    model_bytes = float(sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta))
    model_bytes += float(sum(b.numel() * b.element_size() for b in model.buffers() if not b.is_meta))
    back = float(sum(v.numel() * v.element_size() for v in received.values() if isinstance(v, torch.Tensor))) if isinstance(received, dict) else 0.0
    predicted = {"baseline": baseline, "model": model_bytes, "received": back, "peak": baseline + model_bytes + back}
    section["launcher"] = {**snapshot(), "predicted": predicted}
    path = Path(out) / "summary.json" if out else None
    if path is not None and path.exists():
        RunFiles(out, True, append=True).summary(summary)
    if show:
        launcher = section["launcher"]
        print(
            f"{'launcher':10s} {'(this process)':14s} {'':>10s} {_mb(launcher['peak_bytes']):>10s} {_mb(predicted['peak']):>10s}", file=sys.stderr, flush=True
        )  # after the workers' table; stderr keeps what the script prints next first on stdout
    return summary


def _mb(v: Any) -> str:
    return f"{v / 1e6:,.0f}" if isinstance(v, (int, float)) and v >= 0 else "-"


def format_memory(section: dict[str, Any]) -> str:
    """The end-of-run table: each rank's role, its peak at fit start and at the end, the prediction, and the launcher."""
    base = section.get("runtime_baseline_bytes") or 0.0
    lines = [
        f"peak resident memory per process, MB ({section.get('source')}; runtime baseline {_mb(base)} MB; model built {section.get('model_built')})",
        f"{'process':10s} {'role':14s} {'at start':>10s} {'at end':>10s} {'predicted':>10s} {'end/pred':>8s}",
    ]
    for row in section.get("ranks", []):
        if row is None:
            continue
        end, pred = row["end"]["peak_bytes"], row["predicted"]["peak"]
        ratio = f"{end / pred:.2f}" if end and pred else "-"
        lines.append(f"{'rank ' + str(row['rank']):10s} {row['role']:14s} {_mb(row['start']['peak_bytes']):>10s} {_mb(end):>10s} {_mb(pred):>10s} {ratio:>8s}")
        if row["end"].get("cuda_max_allocated_bytes") is not None:
            cuda = row["end"]
            allocated, reserved = _mb(cuda["cuda_max_allocated_bytes"]), _mb(cuda["cuda_max_reserved_bytes"])
            lines.append(f"{'':10s} {'cuda':14s} {'':>10s} {allocated:>10s} allocated, {reserved} reserved")
    launcher = section.get("launcher")
    if launcher is not None:
        lines.append(f"{'launcher':10s} {'':14s} {'':>10s} {_mb(launcher['peak_bytes']):>10s} {_mb(launcher['predicted']['peak']):>10s}")
    return "\n".join(lines)
