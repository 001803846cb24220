"""``shardwise.tools.plot`` on hand-written run directories: each chart's numbers against the files, worked by
hand, and the one-line errors (no processes; real runs: tests/tools/test_plot_cli.py)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib.image
import pytest

from shardwise.errors import ConfigError
from shardwise.tools.plot import plot_runs, read_run
from shardwise.tools.plot import runs as read

# The memory section zero2 wrote for digits on 2 ranks (a real summary.json, trimmed).
ZERO2_MEMORY = {
    "strategy": "zero2",
    "stage": 2,
    "shard_degree": 2,
    "psi": 26122,
    "bytes_per_param": {"params": 4, "grads": 4, "optimizer": 12},
    "params": {"measured": 104488.0, "predicted": 104488.0, "ratio": 1.0},
    "grads": {"measured": 52244.0, "predicted": 52244.0, "ratio": 1.0},
    "optimizer": {"measured": 156732.0, "predicted": 156732.0, "ratio": 1.0},
    "total": {"measured": 313464.0, "predicted": 313464.0, "ratio": 1.0},
}


def write_run(root: Path, lines: list[dict], summary: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (root / "summary.json").write_text(json.dumps(summary))
    return root


LINES = [
    {"step": 5, "epoch": 0, "train_loss": 2.0, "lr": 0.1, "samples_per_s": 100.0},
    {"step": 10, "epoch": 0, "train_loss": None, "lr": 0.1, "samples_per_s": 50.0},  # NaN is written as null
    {"step": 10, "val_loss": 1.5, "val_accuracy": 0.5, "val_samples": 40},
    {"step": 20, "epoch": 1, "train_loss": 1.0, "lr": 0.1, "samples_per_s": 200.0},
]


def test_series_read_by_hand(tmp_path):
    run = read_run(write_run(tmp_path / "a", LINES, {"global_batch_size": 10, "memory_per_rank": ZERO2_MEMORY}))
    xs, ys = read.curve(run, "train_loss")
    assert xs == [5, 10, 20] and ys[0] == 2.0 and math.isnan(ys[1]) and ys[2] == 1.0
    assert read.curve(run, "val_loss") == ([10], [1.5]) and read.val_metrics(run) == ["val_accuracy"]
    # 5 steps x 10 samples at 100/s = 0.5 s; 5 x 10 at 50/s = 1 s more; 10 x 10 at 200/s = 0.5 s more.
    assert read.throughput(run) == ([0.5, 1.5, 2.0], [100.0, 50.0, 200.0])
    kinds = ("params", "grads", "optimizer", "total")
    assert read.memory(run) == {k: {"measured": ZERO2_MEMORY[k]["measured"], "predicted": ZERO2_MEMORY[k]["predicted"]} for k in kinds}


# The profiler's section of a ddp run on 2 ranks (a real summary.json, trimmed: two parts of six).
PROFILE = {
    "window": [4, 6],
    "parts": ["forward", "comm_exposed"],
    "per_rank": [
        {"forward": 0.000624, "comm_exposed": 0.000930, "comm_total": 0.001035, "measured_step": 0.002673},
        {"forward": 0.000673, "comm_exposed": 0.000906, "comm_total": 0.000906, "measured_step": 0.002647},
    ],
}


def test_traffic_per_step_and_the_profiler_s_breakdown(tmp_path):
    comm = {
        "steps": 4,
        "by_op": {
            "dp/all_reduce": {"count": 8, "payload_bytes": 800, "sent_bytes": 800, "received_bytes": 600},
            "world/barrier": {"count": 2, "payload_bytes": 0, "sent_bytes": 0, "received_bytes": 0},
        },
    }
    run = read_run(write_run(tmp_path / "a", LINES, {"comm": comm, "profile": PROFILE}))
    assert read.comm(run) == {"dp/all_reduce": {"sent": 200.0, "received": 150.0, "calls": 2.0}}  # per step of 4; the barrier moved nothing
    parts = read.breakdown(run)
    assert parts is not None and parts.parts == ["forward", "comm_exposed"] and parts.window == [4, 6]
    assert parts.per_rank == {0: {"forward": 0.000624, "comm_exposed": 0.000930}, 1: {"forward": 0.000673, "comm_exposed": 0.000906}}
    assert parts.measured == {0: 0.002673, 1: 0.002647}
    # A rank that did not train (a parameter server) has no row; a run not profiled has no breakdown.
    server = read_run(write_run(tmp_path / "b", LINES, {"profile": {**PROFILE, "per_rank": [PROFILE["per_rank"][0], None]}}))
    assert sorted(read.breakdown(server).per_rank) == [0]
    assert read.breakdown(read_run(write_run(tmp_path / "c", LINES, {}))) is None


def test_a_zero2_run_gets_its_memory_and_breakdown_charts_and_a_note_on_activations(tmp_path):
    run = write_run(tmp_path / "z", LINES, {"strategy": "zero2", "global_batch_size": 10, "memory_per_rank": ZERO2_MEMORY, "profile": PROFILE})
    report = plot_runs([str(run)], tmp_path / "out")
    assert sorted(report.files) == ["breakdown", "curves", "memory", "throughput"]
    sizes = {"curves": (540, 1440), "throughput": (540, 960), "memory": (540, 960), "breakdown": (312, 1140)}  # inches x 120 dpi
    for name, path in report.files.items():
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(path).shape[:2] == sizes[name]
    assert report.series["memory"]["grads"] == {"measured": 52244.0, "predicted": 52244.0}
    assert report.notes == ["memory: z records no activations figures; the chart shows the others"]
    said = "\n".join(report.skipped)
    assert "comm: z (zero2) recorded no collective that moved bytes" in said


def test_two_runs_of_the_same_name_are_told_apart(tmp_path):
    a = write_run(tmp_path / "x" / "run", LINES, {"global_batch_size": 10})
    b = write_run(tmp_path / "y" / "run", LINES[:1], {"global_batch_size": 10})
    report = plot_runs([str(a), str(b)], tmp_path / "out")
    assert sorted(report.series["curves"]) == ["x/run", "y/run"]
    assert report.series["curves"]["y/run"]["train_loss"] == ([5], [2.0])


def test_bad_run_directories_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        read_run(tmp_path / "missing")
    with pytest.raises(ConfigError, match="holds no metrics.jsonl or summary.json"):
        read_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ConfigError, match="metrics.jsonl line 2 is not JSON"):
        read_run(tmp_path)


def test_without_matplotlib_the_error_names_the_extra(tmp_path, monkeypatch):
    run = write_run(tmp_path / "a", LINES, {"global_batch_size": 10})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ConfigError, match=r"shardwise plot needs matplotlib: pip install 'shardwise\[plot\]'"):
        plot_runs([str(run)], tmp_path / "out")
