"""``shardwise plot RUN_DIR [RUN_DIR ...] [--out DIR]``: the charts of `shardwise.tools.plot` from the command line."""

from __future__ import annotations

import argparse
from pathlib import Path

PLOT_HELP = "PNG charts of finished runs: curves, throughput, memory, traffic, step breakdown, pipeline timeline"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (the --out of shardwise train); several are overlaid")
    parser.add_argument("--out", help="where the PNGs go (default RUN_DIR/plots for one run, ./plots for several)")


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
