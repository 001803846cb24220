"""README claims about the ``shardwise`` command that no other test proves, run as a user runs them.

The claim each test proves is quoted beside it (``# README: "..."``).
"""

from __future__ import annotations

import json

import pytest

from tests.cli.test_cli import shardwise

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


# README: "shardwise train --recipe digits|charlm ... [--config FILE.toml] [--set trainer.key=value ...]"
# and "`checkpoints/step-NNNNNNNN/` (atomic, checksummed, the last 3 of this run kept)".
def test_config_file_sets_trainer_and_recipe_and_set_overrides_it(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        "[trainer]\nmax_steps = 7\nglobal_batch_size = 32\ncheckpoint_every = 1\nlog_every = 1\nval_every = 100\n\n[recipe]\nval_fraction = 0.1\nhidden = 32\n"
    )
    out = tmp_path / "run"
    # --set wins over the file: 5 steps, not 7 (and not the recipe's 300, whatever the file says).
    proc = shardwise("train", "--recipe", "digits", "--config", str(config), "--set", "trainer.max_steps=5", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["global_batch_size"] == 32  # the recipe's default batch is 64
    assert summary["val_samples"] == round(1797 * 0.1)  # the [recipe] section reached the recipe (default 0.2: 359)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train_loss" in r] == [1, 2, 3, 4, 5]  # log_every = 1 from the file
    # A checkpoint at every step, the last 3 kept (keep_last's default).
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{i:08d}" for i in (3, 4, 5)]


# README: "`--straggler RANK:FACTOR` slows one rank down on purpose (any strategy)": the flag reaches
# the run (tests/readme/test_readme_claims.py proves the slowing itself, on 2 processes).
def test_straggler_flag_reaches_the_run():
    proc = shardwise("train", "--recipe", "digits", "--max-steps", "2", "--straggler", "3:2", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "straggler rank 3 does not exist in a world of 1 processes" in proc.stderr
