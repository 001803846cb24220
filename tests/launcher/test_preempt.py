"""A preemption signal that reaches one rank stops every rank after the same step (the log step's
reduction carries it), with a checkpoint; the Trainer's handlers are gone after fit."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from shardwise import Trainer
from shardwise.trainer.callbacks import Callback

pytestmark = pytest.mark.dist


def _mse(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, batch[1])


class _SignalRank1(Callback):
    """Rank 1 alone gets SIGUSR1 during step 3 (as from `kill -USR1` of one worker)."""

    def on_train_step_start(self, trainer, engine, step):
        if step == 3 and engine.rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_fit_end(self, trainer, engine, summary):
        summary[f"rank_{engine.rank}_stopped_at"] = trainer.step


@pytest.mark.timeout(180)
def test_a_signal_on_one_rank_stops_both_at_the_next_log_step(tmp_path):
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    trainer = Trainer(
        strategy="ddp", nproc=2, max_steps=20, log_every=2, global_batch_size=8, out=str(tmp_path), progress_bar=False, model_summary=False, loss_fn=_mse,
        callbacks=[_SignalRank1()],
    )  # fmt: skip
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    summary = trainer.fit(torch.nn.Linear(4, 1), data)
    assert summary["preempted"] == {"signal": "on another rank", "step": 4}  # rank 0's view: rank 1 got it
    assert summary["steps"] == 4 and (tmp_path / "checkpoints" / "step-00000004").is_dir()
    assert {sig: signal.getsignal(sig) for sig in before} == before  # launch put back what was there (the test runner's own)


def test_preempt_signals_that_cannot_work_are_refused():
    from shardwise.errors import ConfigError

    with pytest.raises(ConfigError, match="'SIGKILL' cannot be caught for preemption"):
        Trainer(preempt_signals=("SIGKILL",))
    assert Trainer(preempt_signals="SIGTERM, SIGUSR1").config.preempt_signals == ("SIGTERM", "SIGUSR1")
    assert Trainer(preempt_signals=()).config.preempt_signals == ()
