"""``shardwise plot RUN_DIR [RUN_DIR ...] [--out DIR]``: the charts of `shardwise.tools.plot` from the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from shardwise.config import add_arguments as add_flags
from shardwise.config import flag

PLOT_HELP = "PNG charts of finished runs: curves, throughput, memory, traffic, step breakdown, pipeline timeline"


@dataclass(frozen=True, kw_only=True)
class PlotOptions:
    """``shardwise plot``'s arguments (`shardwise.config.flag`: each field's flag, default and help)."""

    runs: list[str] = flag(help="run directories (the --out of shardwise train); several are overlaid", positional=True, nargs="+", metavar="RUN_DIR")
    out: str | None = flag(None, "where the PNGs go (default RUN_DIR/plots for one run, ./plots for several)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, PlotOptions)


def main(args: argparse.Namespace) -> int:
    from shardwise.tools.plot import plot_runs

    out = args.out or (str(Path(args.runs[0]) / "plots") if len(args.runs) == 1 else "plots")
    report = plot_runs(list(args.runs), out)
    for path in report.files.values():
        print(f"wrote {path}")
    for line in report.notes:
        print(f"note: {line}")
    for line in report.skipped:
        print(f"not drawn: {line}")
    return 0
