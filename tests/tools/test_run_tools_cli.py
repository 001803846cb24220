"""``shardwise train`` with loggers, the profiler and a quick run, as a user types it."""

from __future__ import annotations

import csv
import json

import pytest

from tests.cli.test_cli import shardwise

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_loggers_and_the_profiler_on_two_processes(tmp_path):
    proc = shardwise(
        "train", "--recipe", "digits", "--strategy", "ddp", "--nproc", "2", "--max-steps", "20", "--val-every", "10",
        "--logger", "csv,tensorboard" if _has("tensorboard") else "csv", "--profile", "--out", str(tmp_path), timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(lines)  # one record per run (rank 0), never one per rank
    assert [float(r["train_loss"]) for r in rows if r.get("train_loss")] == [r["train_loss"] for r in lines if "train_loss" in r]
    params = json.loads((tmp_path / "csv" / "hparams.json").read_text())
    assert params["strategy"] == "ddp" and params["recipe"] == "digits" and params["recipe.hidden"] == 128
    if _has("tensorboard"):
        assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank-00000.json", "rank-00001.json"]
    assert len(summary["profile"]["per_rank"]) == 2 and "comm_exposed" in proc.stdout and "measured step" in proc.stdout
    assert "parameters per rank after sharding: rank 0: 26,122  rank 1: 26,122" in proc.stdout


def _has(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def test_fast_dev_run_saves_nothing_and_a_bad_logger_is_one_line(tmp_path):
    proc = shardwise("train", "--recipe", "digits", "--fast-dev-run", "--out", str(tmp_path / "quick"))
    assert proc.returncode == 0, proc.stderr
    assert "fast_dev_run: 1 step(s)" in proc.stdout and not (tmp_path / "quick").exists()
    proc = shardwise("train", "--recipe", "digits", "--max-steps", "2", "--logger", "csv,tensorbord", "--out", str(tmp_path / "bad"))
    assert proc.returncode == 2 and "unknown logger 'tensorbord'. Did you mean 'tensorboard'?" in proc.stderr and "Traceback" not in proc.stderr
