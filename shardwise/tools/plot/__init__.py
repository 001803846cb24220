"""``shardwise plot``: pictures of finished runs, read from their run directories (issue 14).

``plot_runs(["runs/a", "runs/b"], out="plots")`` writes, as PNGs (matplotlib's headless Agg
backend; the ``plot`` extra):

- ``curves.png``: training and validation loss against step, and the other validation metrics,
  every run overlaid (from metrics.jsonl);
- ``throughput.png``: samples per second against seconds of training, every run overlaid;
- ``memory[-RUN].png``: bytes per rank by kind (parameters, gradients, optimizer state; activations
  when a run records them), measured beside the formula (``memory_per_rank``, written by zero1,
  zero2, zero3 / fsdp and hsdp);
- ``comm[-RUN].png``: bytes sent and received per step by each collective (summary.json's
  ``comm``, rank 0's record);
- ``comm_ranks[-RUN].png``: bytes each rank sends and receives per step, stacked by collective
  (``comm/rank-*.json``, one file per rank: where a pipeline's or a server's traffic lies);
- ``breakdown[-RUN].png``: where each rank's step goes (data, forward, backward, exposed
  communication, optimizer, idle), when the run was profiled (``--profile``: summary.json's
  ``profile``, `shardwise.trainer.profile`);
- ``timeline[-RUN].png``: a pipeline run's timeline of one step, when it recorded one (the
  ``timeline`` option), drawn by the pipeline strategy's own ``write_timeline``.

A chart a run has no figures for is not drawn; the report says which and why. The numbers each
chart drew are returned (``PlotReport.series``), so they can be checked against the files.
Modules: ``runs`` (reading), ``charts`` (drawing), ``commands`` (the command).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.tools.plot import charts
from shardwise.tools.plot import runs as read
from shardwise.tools.plot.runs import Run, read_run


@dataclass
class PlotReport:
    files: dict[str, str] = field(default_factory=dict)
    """Chart name (``curves``, ``memory-RUN`` ...) -> the PNG written."""
    skipped: list[str] = field(default_factory=list)
    """One line per chart not drawn, saying why."""
    notes: list[str] = field(default_factory=list)
    """One line per chart drawn with some of its figures missing."""
    series: dict[str, Any] = field(default_factory=dict)
    """Chart name -> the numbers it drew."""


def plot_runs(paths: list[str], out: str | Path) -> PlotReport:
    """Every chart the runs in ``paths`` have figures for, written into ``out``."""
    runs = [read_run(p, label) for p, label in zip(paths, read.labels_for(paths), strict=True)]
    out = Path(out)
    report = PlotReport()
    charts.pyplot()  # a missing matplotlib is one line before anything is read further

    def put(name: str, path: str, series: Any) -> None:
        report.files[name] = path
        report.series[name] = series

    if any(read.curve(r, "train_loss")[0] or read.curve(r, "val_loss")[0] for r in runs):
        put("curves", str(out / "curves.png"), charts.curves(runs, out / "curves.png"))
    else:
        report.skipped.append("curves: no run logged a training or validation loss in metrics.jsonl")
    if any(read.throughput(r)[0] for r in runs):
        put("throughput", str(out / "throughput.png"), charts.throughput(runs, out / "throughput.png"))
    else:
        report.skipped.append("throughput: no run logged samples_per_s in metrics.jsonl")
    for run in runs:
        suffix = "" if len(runs) == 1 else f"-{run.label.replace('/', '-')}"
        _per_run(run, suffix, out, report, put)
    return report


def _per_run(run: Run, suffix: str, out: Path, report: PlotReport, put: Any) -> None:
    strategy = run.summary.get("strategy", "?")
    figures = read.memory(run)
    if figures is None:
        report.skipped.append(f"memory{suffix}: {run.label} ({strategy}) has no memory figures in summary.json (zero1, zero2, zero3/fsdp and hsdp record them)")
    else:
        name = f"memory{suffix}"
        put(name, str(out / f"{name}.png"), charts.memory(run, figures, out / f"{name}.png"))
        missing = [k for k in read.MEMORY_KINDS if k not in figures]
        if missing:
            report.notes.append(f"memory{suffix}: {run.label} records no {', '.join(missing)} figures; the chart shows the others")
    traffic = read.comm(run)
    if traffic is None:
        report.skipped.append(f"comm{suffix}: {run.label} ({strategy}) recorded no collective that moved bytes")
    else:
        name = f"comm{suffix}"
        put(name, str(out / f"{name}.png"), charts.comm(run, traffic, out / f"{name}.png"))
    per_rank = read.comm_per_rank(run)
    if per_rank is None:
        report.skipped.append(f"comm_ranks{suffix}: {run.label} has no per-rank traffic (comm/rank-*.json, written by runs of this version that moved bytes)")
    else:
        name = f"comm_ranks{suffix}"
        put(name, str(out / f"{name}.png"), charts.comm_ranks(run, per_rank, out / f"{name}.png"))
    phases = read.breakdown(run)
    if phases is None:
        report.skipped.append(f"breakdown{suffix}: {run.label} was not profiled (train with --profile for the step breakdown)")
    else:
        name = f"breakdown{suffix}"
        put(name, str(out / f"{name}.png"), charts.breakdown(run, phases, out / f"{name}.png"))
    recorded = read.timeline_events(run)
    if recorded is not None:
        name = f"timeline{suffix}"
        events, pp, schedule = recorded
        put(name, charts.timeline(events, pp, schedule, out / f"{name}.png"), events)  # returns its path
    elif "pipeline" in run.summary:
        report.skipped.append(f"timeline{suffix}: {run.label} recorded no timeline (train with --set trainer.strategy_options.timeline=PATH)")


__all__ = ["PlotReport", "Run", "plot_runs", "read_run"]
