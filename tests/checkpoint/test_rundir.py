"""The run directory: one run per directory, nothing another run wrote is lost, and metrics that
neither go missing nor repeat (a final step between log steps, every validation key, a resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise import Trainer
from shardwise import checkpoint as ckpt
from shardwise.errors import ConfigError
from tests.support.models import adam, ce, classification, mlp


def fit(out: Path | None, *, data_seed: int = 0, **settings):
    settings.setdefault("global_batch_size", 16)
    trainer = Trainer(optimizer=adam, loss_fn=ce, progress_bar=False, out=str(out) if out else None, **settings)
    return trainer.fit(mlp(dtype=torch.float32), classification(128, seed=data_seed, dtype=torch.float32))


def steps_logged(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if "train_loss" in json.loads(line)]


# -- item 4: reusing out -----------------------------------------------------------------------------------
def test_a_second_run_into_the_same_out_is_refused_naming_what_it_holds_and_the_ways_out(tmp_path):
    fit(tmp_path, max_steps=4, checkpoint_every=2)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(ConfigError) as err:
        fit(tmp_path, max_steps=4, checkpoint_every=2)
    message = str(err.value)
    assert str(tmp_path) in message and "step-00000004" in message and "ran to step 4" in message
    assert "resume='auto'" in message and "--overwrite" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before  # nothing touched


def test_overwrite_moves_the_old_run_aside_and_deletes_nothing(tmp_path, capsys):
    fit(tmp_path, max_steps=4, checkpoint_every=2)
    old_summary = (tmp_path / "summary.json").read_text()
    summary = fit(tmp_path, max_steps=2, checkpoint_every=1, overwrite=True)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("replaced-")]
    assert len(aside) == 1 and "moved to" in capsys.readouterr().out
    assert (aside[0] / "summary.json").read_text() == old_summary
    assert sorted(p.name for p in (aside[0] / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]
    assert Path(summary["last_checkpoint"]).exists() and steps_logged(tmp_path) == [2]


def test_pruning_keeps_the_last_of_this_run_and_never_another_runs(tmp_path):
    fit(tmp_path, max_steps=3, checkpoint_every=1, keep_last=10)
    foreign = tmp_path / "checkpoints" / "step-00000001"
    manifest = json.loads((foreign / "manifest.json").read_text())
    manifest["run_id"] = "another-run"  # a checkpoint some other run wrote here
    (foreign / "manifest.json").write_text(json.dumps(manifest))
    summary = fit(tmp_path, max_steps=8, checkpoint_every=1, keep_last=2, resume="auto")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000001", "step-00000007", "step-00000008"]  # this lineage's last 2, and the foreign one
    assert summary["last_checkpoint"].endswith("step-00000008") and Path(summary["last_checkpoint"]).exists()
    assert ckpt.run_id_of(tmp_path / "checkpoints" / "step-00000008") == ckpt.run_id_of(tmp_path / "checkpoints" / "step-00000007")


def test_resume_auto_after_an_overwrite_continues_the_new_run(tmp_path):
    fit(tmp_path, max_steps=6, checkpoint_every=3)
    fit(tmp_path, max_steps=2, checkpoint_every=2, overwrite=True)
    summary = fit(tmp_path, max_steps=4, checkpoint_every=2, resume="auto")
    assert summary["resumed_from"].endswith("step-00000002") and summary["steps"] == 4


def test_the_first_lines_say_what_is_saved_where(tmp_path, capsys):
    fit(tmp_path, max_steps=1)
    assert f"run directory {tmp_path}: metrics.jsonl, summary.json, checkpoints/" in capsys.readouterr().out
    fit(None, max_steps=1)
    assert "no out directory: nothing is saved" in capsys.readouterr().out


# -- item 5: metrics ---------------------------------------------------------------------------------------
def test_the_final_step_is_logged_when_the_run_stops_between_log_steps(tmp_path):
    summary = fit(tmp_path, max_steps=7, log_every=5)
    assert steps_logged(tmp_path) == [5, 7]
    assert isinstance(summary["train_loss"], float) and summary["train_loss"] == summary["train_loss"]  # not NaN


def test_a_callback_stop_between_log_steps_still_logs_the_train_loss(tmp_path):
    class StopAt3:
        def on_train_step_end(self, trainer, engine, step, loss):
            trainer.should_stop = step >= 3

    trainer = Trainer(
        optimizer=adam, loss_fn=ce, progress_bar=False, out=str(tmp_path), global_batch_size=16, max_steps=50, log_every=10, callbacks=[StopAt3()]
    )
    summary = trainer.fit(mlp(dtype=torch.float32), classification(128, dtype=torch.float32))
    assert summary["steps"] == 3 and steps_logged(tmp_path) == [3] and summary["train_loss"] == summary["train_loss"]


class WithValidationStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(dtype=torch.float32)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch):
        return ce(self(batch[0]), batch)

    def validation_step(self, batch):
        out = self(batch[0])
        return {"loss": ce(out, batch), "accuracy": (out.argmax(-1) == batch[1]).float().mean(), "top_logit": out.max()}


def test_every_key_validation_step_returns_is_logged(tmp_path):
    trainer = Trainer(optimizer=adam, progress_bar=False, out=str(tmp_path), global_batch_size=16, max_steps=2)
    summary = trainer.fit(WithValidationStep(), classification(64, dtype=torch.float32), classification(20, seed=3, dtype=torch.float32))
    assert {"val_loss", "val_accuracy", "val_top_logit", "val_samples"} <= set(summary)
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"val_loss", "val_accuracy", "val_top_logit"} <= set(last)


def test_resuming_a_finished_run_says_so_and_reports_no_nan(tmp_path, capsys):
    first = fit(tmp_path, max_steps=4, checkpoint_every=2)
    capsys.readouterr()
    again = fit(tmp_path, max_steps=4, checkpoint_every=2, resume="auto")
    assert "already finished at step 4" in capsys.readouterr().out
    assert again["already_finished"] is True and again["steps"] == 4 and again["steps_this_run"] == 0
    assert again["train_loss"] == first["train_loss"] and "samples_per_s" not in again
    assert steps_logged(tmp_path) == [4]


def test_a_resume_does_not_log_the_replayed_steps_twice(tmp_path):
    fit(tmp_path, max_steps=6, checkpoint_every=2, log_every=1)
    # a crash after step 6 but before step 6's checkpoint is what this replays: resume from step 4
    summary = fit(tmp_path, max_steps=8, checkpoint_every=2, log_every=1, resume=str(tmp_path / "checkpoints" / "step-00000004"))
    assert summary["steps"] == 8
    assert steps_logged(tmp_path) == [1, 2, 3, 4, 5, 6, 7, 8]
