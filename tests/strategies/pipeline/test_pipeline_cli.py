"""``shardwise train --strategy pipeline`` as a user runs it, in a subprocess."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_cli import shardwise

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_charlm_on_a_two_stage_pipeline_reports_its_bubble_draws_a_timeline_and_samples(tmp_path):
    timeline = tmp_path / "timeline.png"
    proc = shardwise(
        "train",
        "--recipe",
        "charlm",
        "--strategy",
        "pipeline",
        "--pp",
        "2",
        "--nproc",
        "2",
        "--microbatches",
        "4",
        "--schedule",
        "1f1b",
        "--max-steps",
        "6",
        "--out",
        str(tmp_path),
        "--set",
        "recipe.n_layers=2",
        "--set",
        "recipe.d_model=32",
        "--set",
        "recipe.val_windows=16",
        "--set",
        "recipe.sample_chars=40",
        "--set",
        f"trainer.strategy_options.timeline={timeline}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["strategy"] == "pipeline" and summary["world_size"] == 2 and summary["steps"] == 6
    section = summary["pipeline"]
    assert section["schedule"] == "1f1b" and section["pp"] == 2 and section["microbatches"] == 4
    assert section["stage_layers"] == [["embed", "blocks.0"], ["blocks.1", "head"]]
    assert section["bubble_predicted"] == pytest.approx(1 / 5)
    assert 0.0 <= section["bubble_measured"] <= 1.0 and section["steps_measured"] == 5
    assert [s["rank"] for s in section["per_stage"]] == [0, 1]
    assert summary["val_samples"] == 16  # each validation window counted once, not once per stage
    # The picture and its events: 4 forwards and 4 backwards on each stage.
    assert timeline.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads((tmp_path / "timeline.png.json").read_text())["events"]
    for stage in (0, 1):
        assert sorted((e["kind"], e["microbatch"]) for e in events if e["stage"] == stage) == sorted((k, m) for k in "FB" for m in range(4))
    # The trained weights came back whole to the parent, which samples text after "The ".
    sample = proc.stdout.split("done: 6 steps", 1)[1].split("\n", 1)[1]
    assert sample.startswith("The ") and len(sample.rstrip("\n")) >= 4 + 40 - 5
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000006"]


def test_one_f_one_b_with_fewer_micro_batches_than_stages_is_one_clear_line():
    proc = shardwise("train", "--recipe", "charlm", "--strategy", "pipeline", "--pp", "2", "--nproc", "2", "--microbatches", "1", "--max-steps", "1")
    assert proc.returncode == 2
    assert "1f1b needs at least as many micro-batches as stages" in proc.stderr and "Traceback" not in proc.stderr


def test_the_layers_flag_reaches_the_splitter_and_a_wrong_path_is_one_clear_line():
    proc = shardwise("train", "--recipe", "charlm", "--strategy", "pipeline", "--pp", "2", "--nproc", "2", "--layers", "blocks.nope", "--max-steps", "1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "layers='blocks.nope' is not a module of CharGPT; its module lists are ['blocks']" in proc.stderr
    assert "Traceback" not in proc.stderr
