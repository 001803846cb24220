"""The Trainer's ``threads`` setting (issue 39: one process with torch's default threads on a busy machine ran
12x slower than with one, and nothing said how many it ran): it reaches torch in a run in this process and in
every launched rank, a user's ``OMP_NUM_THREADS`` is the automatic count where it is not given, the count is
printed and recorded in summary.json, and a bad value is one clear error."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Trainer
from shardwise.errors import ConfigError
from shardwise.launcher import spawn
from shardwise.launcher.env import user_threads
from shardwise.trainer.callbacks import Callback
from shardwise.trainer.config import TrainerConfig, add_flags, flag_values, from_mapping


class ThreadsSeen(Callback):
    """torch's thread count while each rank trains, written to ``directory/rank-N`` (a rank's callback is a copy)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_step_end(self, trainer, engine, step, loss) -> None:
        (self.directory / f"rank-{engine.rank}").write_text(str(torch.get_num_threads()))


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch at 2 threads (the suite runs with 1) and no OMP_NUM_THREADS, both put back after."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _fit(tmp_path: Path, **settings) -> tuple[dict, dict[int, int]]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    seen = tmp_path / "seen"
    seen.mkdir(parents=True, exist_ok=True)
    summary = Trainer(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
        global_batch_size=16,
        max_steps=2,
        progress_bar=False,
        model_summary=False,
        callbacks=[ThreadsSeen(seen)],
        out=str(tmp_path / "run"),
        **settings,
    ).fit(nn.Linear(6, 3), data)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["threads"] == summary["threads"]
    return summary, {int(p.name.split("-")[1]): int(p.read_text()) for p in seen.iterdir()}


def test_an_in_process_run_trains_with_the_threads_given_records_them_and_puts_torch_s_back(two_threads, tmp_path, capsys):
    summary, seen = _fit(tmp_path, threads=1)
    assert seen == {0: 1} and summary["threads"] == 1 and summary["threads_from"] == "the threads setting"
    assert torch.get_num_threads() == 2  # the caller's count after the run
    assert "shardwise: strategy single on 1 process(es), 1 thread(s) each (the threads setting)" in capsys.readouterr().out


def test_without_threads_a_user_s_omp_num_threads_is_the_count_else_torch_s_own(two_threads, tmp_path, monkeypatch, capsys):
    summary, seen = _fit(tmp_path / "a")
    assert seen == {0: 2} and summary["threads"] == 2 and summary["threads_from"] == "torch's default"
    assert "2 thread(s) each (torch's default; --threads N sets another)" in capsys.readouterr().out
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # what torch starts with under OMP_NUM_THREADS=1
    summary, seen = _fit(tmp_path / "b")
    assert seen == {0: 1} and summary["threads"] == 1 and summary["threads_from"] == "OMP_NUM_THREADS"
    summary, seen = _fit(tmp_path / "c", threads=2)  # given, the setting wins over the environment
    assert seen == {0: 2} and summary["threads_from"] == "the threads setting"
    torch.set_num_threads(2)  # a program's own count (the planner's validation sets one) stands over the environment's
    summary, seen = _fit(tmp_path / "d")
    assert seen == {0: 2} and summary["threads_from"] == "torch.set_num_threads here"


def test_launched_ranks_run_the_threads_given_each(tmp_path, monkeypatch):
    # 2 per rank on this 2-core machine is not the automatic cores // 2 = 1: only the setting can give it
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    summary, seen = _fit(tmp_path, threads=2, strategy="ddp", nproc=2)
    assert seen == {0: 2, 1: 2} and summary["threads"] == 2 and summary["threads_from"] == "the threads setting"


def test_the_launcher_s_automatic_count_is_a_user_s_omp_num_threads_else_the_cores_shared_out(monkeypatch):
    monkeypatch.setattr(spawn.os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert spawn._default_threads(1) == 8 and spawn._default_threads(2) == 4 and spawn._default_threads(16) == 1
    trainer = Trainer(strategy="ddp", nproc=1)
    assert trainer._threads_choice(1) == (8, "8 cores // 1 processes") and trainer._threads_choice(None)[0] is None
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # issue 39: ddp on one process ran 2 threads whatever the user set
    assert spawn._default_threads(1) == 1 and trainer._threads_choice(1) == (1, "OMP_NUM_THREADS")
    assert Trainer(strategy="ddp", nproc=1, threads=3)._threads_choice(1) == (3, "the threads setting")
    assert [user_threads({"OMP_NUM_THREADS": v}) for v in ("3", "4,2", " 2 ", "0", "x", "")] == [3, 4, 2, None, None, None]


def test_threads_is_a_flag_and_a_toml_key_and_a_bad_value_is_one_clear_error():
    p = argparse.ArgumentParser()
    add_flags(p)
    assert flag_values(p.parse_args(["--threads", "3"]))["threads"] == 3
    assert from_mapping({"threads": 1}).threads == 1 and TrainerConfig(threads=0).threads is None and TrainerConfig().threads is None
    for bad in (-1, "2", True, 1.5):
        with pytest.raises(ConfigError, match=rf"threads must be a whole number >= 1 \(or 0 for automatic\); got {bad!r} \(e.g. --threads 1\)"):
            TrainerConfig(threads=bad)
