"""The Trainer in one process: precisions, epochs, schedulers, callbacks, DataLoaders, run files."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader

from shardwise import Trainer
from tests.support.models import accuracy, adam, ce, classification, mlp, step_lr


def _fit(tmp_path=None, data=None, model=None, **settings):
    model = model if model is not None else mlp(dtype=torch.float32)
    data = data if data is not None else classification(128, dtype=torch.float32)
    trainer = Trainer(optimizer=adam, loss_fn=ce, metrics={"accuracy": accuracy}, progress_bar=False, out=str(tmp_path) if tmp_path else None, **settings)
    return trainer, trainer.fit(model, data, classification(40, seed=9, dtype=torch.float32))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32"])
def test_mixed_precision_trains(precision):
    _, first = _fit(global_batch_size=32, max_steps=1, precision=precision)
    _, last = _fit(global_batch_size=32, max_steps=60, precision=precision)
    assert last["precision"] == precision
    assert last["val_loss"] < first["val_loss"] - 0.2


def test_epochs_scheduler_callbacks_and_run_files(tmp_path):
    seen = {"steps": [], "val": [], "start": 0, "end": None}

    class Recorder:
        def on_fit_start(self, trainer, engine):
            seen["start"] += 1

        def on_train_step_end(self, trainer, engine, step, loss):
            seen["steps"].append(step)

        def on_validation_end(self, trainer, engine, metrics):
            seen["val"].append(metrics["val_samples"])

        def on_fit_end(self, trainer, engine, summary):
            seen["end"] = summary["steps"]

    trainer = Trainer(
        optimizer=adam,
        loss_fn=ce,
        lr_scheduler=step_lr,
        metrics={"accuracy": accuracy},
        callbacks=[Recorder()],
        global_batch_size=32,
        max_epochs=2,
        val_every=3,
        log_every=2,
        out=str(tmp_path),
        progress_bar=False,
    )
    summary = trainer.fit(mlp(dtype=torch.float32), classification(100, dtype=torch.float32), classification(40, seed=9, dtype=torch.float32))
    assert summary["steps"] == 6  # 100 // 32 = 3 steps an epoch, 2 epochs
    assert seen == {"steps": [1, 2, 3, 4, 5, 6], "val": [40, 40], "start": 1, "end": 6}
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "train_loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert [r["lr"] for r in train] == [0.01, 0.005, 0.0025]  # StepLR(3, 0.5) steps after each optimizer step
    assert [r["step"] for r in lines if "val_loss" in r] == [3, 6]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["steps"] == 6 and saved["val_samples"] == 40 and 0 <= saved["val_accuracy"] <= 1


def test_a_dataloader_gives_its_batch_size_and_collate(tmp_path):
    calls = {"n": 0}

    def collate(samples):
        calls["n"] += 1
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    loader = DataLoader(classification(64, dtype=torch.float32), batch_size=16, collate_fn=collate)
    trainer = Trainer(optimizer=adam, loss_fn=ce, max_steps=3, progress_bar=False)
    summary = trainer.fit(mlp(dtype=torch.float32), loader)
    assert summary["global_batch_size"] == 16 and summary["samples"] == 48
    assert calls["n"] == 1 + 3  # one sample collated before launch (does the batch fit forward?), then 3 steps


def test_a_progress_bar_on_a_terminal(capsys):
    import io

    from shardwise.trainer.logging import Progress

    stream = io.StringIO()
    bar = Progress(enabled=True, total=10, bar=True, stream=stream)
    bar.update(5, {"step": 5, "train_loss": 0.5})
    bar.close()
    assert "5/10" in stream.getvalue() and "train_loss" in stream.getvalue()
    silent = io.StringIO()
    Progress(enabled=False, total=10, bar=True, stream=silent).update(5, {"train_loss": 1.0})
    assert silent.getvalue() == ""


def test_ctrl_c_is_named_once_as_sigint_and_a_later_sigterm_is_not_announced(capsys, monkeypatch):
    import os
    import signal

    from shardwise.trainer.preempt import Preemption

    monkeypatch.setenv("RANK", "0")
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # the premise: Ctrl-C not ignored (see tests/conftest.py)
    p = Preemption()
    with pytest.raises(KeyboardInterrupt), p.installed(("SIGTERM",)):
        os.kill(os.getpid(), signal.SIGINT)  # a terminal's Ctrl-C (Python runs the handler at once, in this thread)
    with p.installed(("SIGTERM",)):
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher stopping its ranks after the Ctrl-C
    assert capsys.readouterr().out == "shardwise: SIGINT received (Ctrl-C): stopping now, without a checkpoint\n"
    assert p.signal == "SIGINT" and p.flag == 0.0  # not a preemption: no checkpoint at the next log step
    monkeypatch.setenv("RANK", "1")
    q = Preemption()
    with q.installed(("SIGTERM",)):
        os.kill(os.getpid(), signal.SIGTERM)
    assert capsys.readouterr().out == "" and q.signal == "SIGTERM" and q.flag == 1.0  # rank 1 notes it, rank 0 says it
    signal.signal(signal.SIGINT, before)


def test_on_nonfinite_and_drop_last_are_flags_of_shardwise_train_and_toml_keys():
    from shardwise.cli import train_parser
    from shardwise.trainer.config import apply_overrides, from_mapping

    args = train_parser().parse_args(["--recipe", "digits", "--on-nonfinite", "skip", "--keep-last-batch"])
    config = from_mapping(apply_overrides({}, args.set)["trainer"])
    assert (config.on_nonfinite, config.drop_last) == ("skip", False)
    later = train_parser().parse_args(["--recipe", "digits", "--on-nonfinite", "skip", "--set", "trainer.on_nonfinite=warn"])
    assert from_mapping(apply_overrides({}, later.set)["trainer"]).on_nonfinite == "warn"  # in order: the later wins
    assert "--on-nonfinite {stop,skip,warn}" in train_parser().format_help()
