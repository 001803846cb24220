"""``shardwise train --strategy tp`` as a user runs it: charlm trains, summary.json has a ``tp`` section."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_cli import shardwise

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_charlm_with_tp2_and_sequence_parallel_trains_and_reports_its_collectives(tmp_path):
    proc = shardwise(
        "train",
        "--recipe",
        "charlm",
        "--strategy",
        "tp",
        "--tp",
        "2",
        "--sequence-parallel",
        "--nproc",
        "2",
        "--max-steps",
        "20",
        "--val-every",
        "10",
        "--log-every",
        "10",
        "--out",
        str(tmp_path),
        "--set",
        "recipe.n_layers=2",
        "--set",
        "recipe.d_model=64",
        "--set",
        "recipe.val_windows=64",
        "--set",
        "recipe.sample_chars=20",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["strategy"] == "tp" and summary["steps"] == 20 and summary["val_samples"] == 64
    evals = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] < 4.7  # ln(103) = 4.63 is a uniform guess
    tp = summary["tp"]
    assert tp["degree"] == 2 and tp["dp"] == 1 and tp["sequence_parallel"] is True
    assert tp["plan"]["blocks.0.attn.q"] == "colwise" and tp["plan"]["blocks.1.mlp.proj"] == "rowwise" and len(tp["plan"]) == 12
    # Per step: per block an all-gather and a reduce-scatter around attention and around the MLP,
    # each way, plus the all-gather leaving the sequence-sharded region (and its mirror in backward).
    per_step = tp["collectives_per_step"]
    assert per_step["tp/all_gather"] == {"forward": 5, "backward": 5}
    assert per_step["tp/reduce_scatter"] == {"forward": 4, "backward": 4}
    assert summary["comm"]["by_op"]["tp/reduce_scatter"]["count"] == 20 * 8
    # The checkpoint holds DTensors: written sharded with DCP.
    assert (tmp_path / "checkpoints/step-00000020/dcp").is_dir()


def test_tp_that_does_not_divide_the_processes_is_one_clear_line():
    proc = shardwise("train", "--recipe", "charlm", "--strategy", "tp", "--tp", "3", "--nproc", "2", "--max-steps", "1")
    assert proc.returncode == 2
    assert "tp 3 does not divide the world size 2; valid shapes: dp2 x tp1, dp1 x tp2 (set --tp to one of the tp degrees)" in proc.stderr
    assert "Traceback" not in proc.stderr
