"""``shardwise train --recipe charlm`` as a user runs it: the validation loss falls and text is sampled."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_cli import shardwise

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_charlm_with_ddp_on_two_processes_lowers_validation_loss_and_samples(tmp_path):
    proc = shardwise(
        "train", "--recipe", "charlm", "--strategy", "ddp", "--nproc", "2", "--max-steps", "80", "--val-every", "40",
        "--log-every", "20", "--out", str(tmp_path),
        "--set", "recipe.n_layers=2", "--set", "recipe.d_model=64", "--set", "recipe.val_windows=64", "--set", "recipe.sample_chars=40",
    )
    assert proc.returncode == 0, proc.stderr
    evals = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert [r["step"] for r in evals] == [40, 80]
    assert evals[1]["val_loss"] < evals[0]["val_loss"] < 4.7  # ln(103) = 4.63 is a uniform guess
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["val_samples"] == 64 and summary["strategy"] == "ddp"
    sample = proc.stdout.split("done: ")[-1].split("\n", 1)[1]
    assert sample.startswith("The ") and 4 < len(sample.rstrip("\n")) <= 4 + 40  # the prompt and 40 sampled characters
