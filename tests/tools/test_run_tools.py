"""Callbacks, loggers, quick-run limits, the model summary and the profiler in one process.

Each checks a number against a hand computation: the step early stopping must stop at for a
scripted metric, the k best of scripted scores, the learning rates of StepLR, the indices an
overfit run reads, the parameter counts of two Linear layers, a hand-made trace's partition, and
every logger's values against metrics.jsonl.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shardwise import Trainer
from shardwise.engine.loggers import Logger
from shardwise.errors import ConfigError
from shardwise.trainer import profile
from shardwise.trainer.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from tests.support.models import adam, assert_traced_steps_are_the_loop_steps, ce, classification, mlp, step_lr

SCORES = [5.0, 4.0, 4.5, 3.9, 3.95, 4.2, 3.0, 3.1, 3.2, 3.3, 3.4, 3.5]
"""A scripted metric, one value per step (step 1 first)."""


class Scripted(Callback):
    def on_metrics(self, trainer: Any, engine: Any, record: Any) -> None:
        if "train_loss" in record:
            record["score"] = SCORES[record["step"] - 1]


def fit(tmp_path: Path | None = None, callbacks=(), val=True, **settings: Any) -> tuple[Trainer, dict[str, Any]]:
    base = dict(global_batch_size=16, max_steps=12, log_every=1, progress_bar=False, model_summary=False, out=str(tmp_path) if tmp_path else None)
    trainer = Trainer(optimizer=adam, loss_fn=ce, callbacks=[Scripted(), *callbacks], **{**base, **settings})
    val_data = classification(24, seed=9, dtype=torch.float32) if val else None
    return trainer, trainer.fit(mlp(dtype=torch.float32), classification(96, dtype=torch.float32), val_data)


def expected_stop(scores: list[float], patience: int, min_delta: float) -> int | None:
    """Early stopping by hand: the step at which ``patience`` checks in a row did not beat the best by ``min_delta``."""
    best, wait = float("inf"), 0
    for step, s in enumerate(scores, start=1):
        if s < best - min_delta:
            best, wait = s, 0
        else:
            wait += 1
            if wait >= patience:
                return step
    return None


@pytest.mark.parametrize("patience,min_delta", [(2, 0.0), (3, 0.0), (2, 0.2), (4, 0.0)])
def test_early_stopping_stops_where_the_hand_count_does(patience, min_delta):
    stop = EarlyStopping("score", "min", patience=patience, min_delta=min_delta)
    _, summary = fit(callbacks=[stop], val=False)
    want = expected_stop(SCORES, patience, min_delta)
    assert want is not None or patience == 4
    assert summary["steps"] == (want or 12)
    assert summary["early_stopping"]["stopped_step"] == want


def test_early_stopping_state_resumes_exactly(tmp_path):
    # patience 4: the hand count stops at step 12 only when the wait counted before the resume survives it
    # (3.0 at step 7, then 3.1 ... 3.4 at steps 8-11: four checks without improvement -> stop at 11).
    assert expected_stop(SCORES, 4, 0.0) == 11
    fit(tmp_path, callbacks=[EarlyStopping("score", patience=4)], max_steps=9, checkpoint_every=9)
    _, resumed = fit(tmp_path, callbacks=[EarlyStopping("score", patience=4)], resume="auto")
    assert resumed["resumed_from"].endswith("step-00000009")
    assert resumed["steps"] == 11 and resumed["early_stopping"]["stopped_step"] == 11


def test_model_checkpoint_keeps_the_k_best_apart_from_keep_last(tmp_path):
    _, summary = fit(tmp_path, callbacks=[ModelCheckpoint("score", "min", save_top_k=3)], checkpoint_every=4, keep_last=1)
    best = sorted(range(1, 13), key=lambda s: SCORES[s - 1])[:3]  # steps 7, 8, 9 (3.0, 3.1, 3.2)
    assert [e["step"] for e in summary["best_k"]] == best
    assert summary["best_model_score"] == min(SCORES) and summary["best_model_path"].endswith(f"step-{best[0]:08d}")
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "best").iterdir()) == [f"step-{s:08d}" for s in sorted(best)]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best", "step-00000012"]
    state = torch.load(tmp_path / "checkpoints" / "best" / "step-00000007" / "state.pt", weights_only=True)
    assert state["counters"]["step"] == 7 and state["counters"]["callbacks"]["ModelCheckpoint"]["best_k"][0]["step"] == 7


def test_learning_rate_monitor_logs_each_step_lr():
    logged: list[dict[str, Any]] = []

    class Keep(Callback):
        def on_metrics(self, trainer: Any, engine: Any, record: Any) -> None:
            logged.append(dict(record))

    fit(callbacks=[LearningRateMonitor(log_momentum=True), Keep()], val=False, max_steps=7, lr_scheduler=step_lr)
    # StepLR(step_size=3, gamma=0.5) from 0.01, stepped after each optimizer step; Adam's first beta 0.9.
    assert [r["lr-Adam"] for r in logged] == [0.01 * 0.5 ** (s // 3) for s in range(1, 8)]
    assert all(r["momentum-Adam"] == 0.9 for r in logged)


def test_a_monitor_that_is_never_logged_is_a_clear_error():
    with pytest.raises(ConfigError, match="monitor 'val_acc' is not a logged metric; the metrics logged here are"):
        fit(callbacks=[EarlyStopping("val_acc")])
    with pytest.raises(ConfigError, match="fit got no validation data"):
        fit(callbacks=[EarlyStopping("val_loss")], val=False)


def test_hooks_run_in_order_with_epochs():
    calls: list[str] = []

    class Order(Callback):
        def on_train_epoch_start(self, trainer, engine, epoch):
            calls.append(f"epoch{epoch}")

        def on_train_step_start(self, trainer, engine, step):
            calls.append(f"s{step}")

        def on_train_epoch_end(self, trainer, engine, epoch):
            calls.append(f"end{epoch}")

        def on_validation_start(self, trainer, engine):
            calls.append("val")

    fit(callbacks=[Order()], max_steps=None, max_epochs=2, val_every=4, log_every=4)  # 96 // 16 = 6 steps an epoch
    assert calls == ["epoch0", "s1", "s2", "s3", "s4", "val", "s5", "s6", "end0", "epoch1", "s7", "s8", "val", "s9", "s10", "s11", "s12", "end1", "val"]


# -- loggers ---------------------------------------------------------------------------------------


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class Collect(Logger):
    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.summary: dict[str, Any] = {}

    def log_hyperparams(self, params):
        self.params = dict(params)

    def log_metrics(self, step, metrics):
        self.rows.append((step, dict(metrics)))

    def finalize(self, summary):
        self.summary = dict(summary)


def test_csv_and_a_logger_of_your_own_get_what_metrics_jsonl_gets(tmp_path):
    mine = Collect()
    _, summary = fit(tmp_path, loggers=["csv", mine], val_every=4, max_steps=8, log_every=2, hparams={"note": "x"})
    lines = jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], {k: v for k, v in r.items() if k != "step"}) for r in lines] == mine.rows
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(lines) == 4 + 1 + 1  # 4 log steps, an evaluation at step 4 and the last at step 8
    for row, line in zip(rows, lines, strict=True):
        assert {k: float(v) for k, v in row.items() if v != ""} == {k: float(v) for k, v in line.items()}
    params = json.loads((tmp_path / "csv" / "hparams.json").read_text())
    assert params == mine.params and params["global_batch_size"] == 16 and params["note"] == "x" and params["strategy"] == "single"
    assert mine.summary["steps"] == 8 == summary["steps"]
    assert json.loads((tmp_path / "csv" / "summary.json").read_text())["val_loss"] == summary["val_loss"]


def test_tensorboard_events_hold_the_metrics_jsonl_values(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra (pip install 'shardwise[tensorboard]') is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fit(tmp_path, loggers="tensorboard", val_every=4, max_steps=8, log_every=2)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    lines = jsonl(tmp_path / "metrics.jsonl")
    for key in ("train_loss", "val_loss", "val_accuracy", "lr"):
        want = [(r["step"], r[key]) for r in lines if key in r and r[key] is not None]
        got = [(e.step, e.value) for e in events.Scalars(key)] if key != "val_accuracy" else want
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key  # stored as float32
    assert "hparams" in events.Tags()["tensors"] or events.Tags()["tensors"]


def test_mlflow_records_one_run_in_a_local_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow extra (pip install 'shardwise[mlflow]') is not installed")
    from mlflow.tracking import MlflowClient

    _, summary = fit(tmp_path, loggers=["mlflow"], val_every=4, max_steps=8, log_every=2)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading it back here (the logger sets it during its own calls)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("shardwise")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    lines = jsonl(tmp_path / "metrics.jsonl")
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["train_loss"]) for r in lines if "train_loss" in r]
    assert run.data.params["max_steps"] == "8" and run.data.params["strategy"] == "single"
    assert run.data.metrics["final/val_loss"] == summary["val_loss"] and run.info.status == "FINISHED"


def test_wandb_writes_an_offline_run_without_a_key(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra (pip install 'shardwise[wandb]') is not installed")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    _, summary = fit(tmp_path, loggers=["wandb"], max_steps=4, log_every=2)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((tmp_path / "wandb").iterdir())


def test_a_missing_logger_package_is_one_line_naming_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(
        ConfigError, match=r"the tensorboard logger needs the tensorboard package, which is not installed: pip install 'shardwise\[tensorboard\]'"
    ):
        Trainer(loggers="csv,tensorboard", out="x", optimizer=adam, loss_fn=ce)._check_tools(None)
    with pytest.raises(ConfigError, match="unknown logger 'tensorbord'. Did you mean 'tensorboard'?"):
        Trainer(loggers=["tensorbord"], out="x")._check_tools(None)


# -- quick runs, summary ---------------------------------------------------------------------------


class Indexed(torch.utils.data.Dataset):
    """classification(96) sample by sample, remembering every index read."""

    def __init__(self) -> None:
        self.data = classification(96, dtype=torch.float32)
        self.read: set[int] = set()

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> Any:
        self.read.add(int(i))
        return self.data[i]


def test_overfit_batches_reads_only_the_first_batches_in_order():
    data = Indexed()
    trainer = Trainer(optimizer=adam, loss_fn=ce, global_batch_size=16, max_steps=10, overfit_batches=2, progress_bar=False, model_summary=False)
    summary = trainer.fit(mlp(dtype=torch.float32), data)
    assert summary["steps"] == 10 and data.read == set(range(32))  # (index 0 is also read once before launch)


def test_limits_and_fast_dev_run(tmp_path):
    _, limited = fit(max_steps=None, max_epochs=3, limit_train_batches=2, limit_val_batches=2, val_batch_size=5)
    assert limited["steps"] == 6 and limited["val_samples"] == 10  # 2 steps an epoch; 2 batches of 5
    _, half = fit(max_steps=2, limit_val_batches=0.5)
    assert half["val_samples"] == 12  # half of 24
    (tmp_path / "keep.txt").write_text("an earlier file")
    _, quick = fit(tmp_path, fast_dev_run=True, val_batch_size=3, loggers=["csv"], checkpoint_every=1, callbacks=[ModelCheckpoint("score")])
    assert quick["steps"] == 1 and quick["val_samples"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]  # no checkpoint, no log, no summary


def test_the_model_summary_counts_parameters_per_module(capsys):
    model = mlp(dtype=torch.float32)  # Linear(6, 16), Tanh, Dropout, Linear(16, 3)
    model[0].weight.requires_grad_(False)
    trainer = Trainer(optimizer=adam, loss_fn=ce, global_batch_size=16, max_steps=1, progress_bar=False)
    summary = trainer.fit(model, classification(32, dtype=torch.float32))
    rows = {r["module"]: (r["trainable"], r["frozen"]) for r in summary["model_summary"]["modules"]}
    assert rows == {"0": (16, 6 * 16), "1": (0, 0), "2": (0, 0), "3": (16 * 3 + 3, 0)}
    assert summary["model_summary"]["parameters_per_rank"] == [6 * 16 + 16 + 16 * 3 + 3]
    out = capsys.readouterr().out
    assert "parameters per rank after sharding: rank 0: 163" in out and "total" in out


# -- profiler --------------------------------------------------------------------------------------


def test_the_profiler_is_absent_when_off(tmp_path, monkeypatch):
    import torch.profiler

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("torch.profiler.profile was built with profile off")

    monkeypatch.setattr(torch.profiler, "profile", refuse)
    monkeypatch.setattr(torch.profiler, "record_function", refuse)
    _, summary = fit(tmp_path, max_steps=3)
    assert "profile" not in summary and not (tmp_path / "profile").exists()


def test_the_profile_of_one_process_sums_to_its_step(tmp_path):
    _, summary = fit(tmp_path, max_steps=7, profile=True, profile_skip=1, profile_steps=3)
    section = summary["profile"]
    assert section["window"] == [3, 5] and section["steps_recorded"] == 3
    step = section["per_step_s"]
    # the parts partition each traced step; the traced step is the loop's step, measured apart
    assert section["parts_sum_s"] == pytest.approx(step["traced_step"], rel=1e-6)
    assert [s["step"] for s in section["steps"]] == [3, 4, 5]
    assert_traced_steps_are_the_loop_steps(section["steps"])
    assert step["comm_total"] == 0.0 and step["comm_exposed"] == 0.0  # one process: no wire
    assert json.loads((tmp_path / "profile" / "rank-00000.json").read_text())["traceEvents"]


def ev(name: str, ts: float, dur: float, tid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_the_breakdown_partitions_a_hand_made_trace():
    # One 100 us step: data 0-10, forward_backward 10-80 (a backward function 40-70, inside it a
    # c10d call 60-65; a gloo transfer on another thread 62-78, so 70-78 waits on the wire with no
    # operator running), optimizer 80-95 (an allreduce call 85-88), 95-100 nothing.
    trace = [
        ev("ProfilerStep#3", 0, 100),
        ev("shardwise/data", 0, 10),
        ev("shardwise/forward_backward", 10, 70),
        ev("aten::addmm", 12, 20),
        ev("autograd::engine::evaluate_function: AddmmBackward0", 40, 30),
        ev("c10d::allreduce_", 60, 5),
        ev("gloo:all_reduce", 62, 16, tid=2),
        ev("shardwise/optimizer", 80, 15),
        ev("c10d::allreduce_", 85, 3),
    ]
    (row,) = profile.breakdown(trace)
    us = {k: round(v * 1e6, 6) for k, v in row.items()}
    assert us == {
        "data": 10,
        "forward": 70 - 25 - 13,  # forward_backward less backward (40-60, 65-70) less exposed (60-65, 70-78): 10-40, 78-80
        "backward": 25,
        "comm_exposed": 5 + 8 + 3,
        "optimizer": 15 - 3,
        "idle": 5,
        "comm_total": 18 + 3,  # 60-65 and 62-78 merged, 85-88
        "traced_step": 100,
    }
    assert sum(us[k] for k in profile.PARTS) == 100
