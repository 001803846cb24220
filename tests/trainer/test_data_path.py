"""The Trainer's data-path settings: ``num_workers``, ``pin_memory`` and ``prefetch_factor`` reach the
loader (from the Trainer, a DataLoader, flags and TOML keys), pin_memory on a machine without CUDA is
said once and trains identically, and bad values are one clear error before anything runs."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from shardwise import Trainer
from shardwise.errors import ConfigError
from shardwise.trainer.callbacks import Callback
from shardwise.trainer.config import TrainerConfig, add_flags, flag_values, from_mapping

NOTE = "shardwise: pin_memory needs CUDA; this machine has none, batches are not pinned"


class LoaderSeen(Callback):
    """What the run's loader was built with: (workers, pinned, prefetch factor)."""

    def __init__(self) -> None:
        self.seen: tuple[int, bool, int | None] | None = None

    def on_train_step_end(self, trainer, engine, step, loss) -> None:
        loader = trainer._state["loader"]
        self.seen = (loader.num_workers, loader.pin_memory, loader.prefetch_factor)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))


def _fit(data=None, **settings) -> tuple[dict[str, torch.Tensor], LoaderSeen]:
    torch.manual_seed(0)
    model, seen = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), LoaderSeen()
    Trainer(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
        global_batch_size=16,
        max_steps=6,
        progress_bar=False,
        model_summary=False,
        callbacks=[seen],
        **settings,
    ).fit(model, _data() if data is None else data)
    return model.state_dict(), seen


def test_workers_and_prefetch_factor_reach_the_loader_from_the_trainer_or_a_dataloader():
    _, seen = _fit(num_workers=1, prefetch_factor=3)
    assert seen.seen == (1, False, 3)
    _, seen = _fit(DataLoader(_data(), batch_size=16, num_workers=1, prefetch_factor=4))
    assert seen.seen == (1, False, 4)  # the DataLoader's own settings count
    _, seen = _fit(DataLoader(_data(), batch_size=16, num_workers=1, prefetch_factor=4), num_workers=1, prefetch_factor=2)
    assert seen.seen == (1, False, 2)  # the Trainer's, given, wins
    with pytest.raises(ConfigError, match="num_workers is 0"):  # the Trainer's prefetch_factor is for the Trainer's workers
        TrainerConfig(prefetch_factor=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only machine's behaviour (pinned on CUDA: tests/gpu/test_pinned.py)")
def test_pin_memory_without_cuda_is_said_once_and_trains_identically(capsys):
    plain, _ = _fit()
    assert NOTE not in capsys.readouterr().out
    pinned, seen = _fit(pin_memory=True)
    assert capsys.readouterr().out.count(NOTE) == 1
    assert seen.seen == (0, False, None)
    for k in plain:
        assert torch.equal(plain[k], pinned[k]), k


@pytest.mark.parametrize(
    "settings,message",
    [
        (
            {"prefetch_factor": 2},
            r"^prefetch_factor=2 sets how many micro-batches each data-loading worker keeps ready, and num_workers is 0: "
            r".*Set num_workers >= 1 \(--num-workers N\), or leave prefetch_factor out \(a DataLoader given to fit keeps its own\)$",
        ),
        ({"num_workers": 2, "prefetch_factor": 0}, r"^prefetch_factor must be a whole number >= 1 .*; got 0$"),
        ({"num_workers": 2, "prefetch_factor": True}, r"prefetch_factor must be a whole number >= 1 .*; got True$"),
        ({"num_workers": 2, "prefetch_factor": 1.5}, r"prefetch_factor must be a whole number >= 1 .*; got 1.5$"),
        ({"num_workers": -1}, r"^num_workers must be a whole number >= 0 .*; got -1$"),
        ({"num_workers": "2"}, r"^num_workers must be a whole number >= 0 .*; got '2'$"),
        ({"pin_memory": "yes"}, r"^pin_memory must be True or False; got 'yes'$"),
    ],
)
def test_bad_values_are_one_clear_error_before_anything_runs(settings, message):
    with pytest.raises(ConfigError, match=message):
        TrainerConfig(**settings)
    with pytest.raises(ConfigError, match=message):
        from_mapping(settings)  # a [trainer] table in a TOML file


def test_flags_and_toml_keys_give_the_settings():
    p = argparse.ArgumentParser()
    add_flags(p)
    args = p.parse_args(["--num-workers", "2", "--prefetch-factor", "3", "--pin-memory"])
    cfg = TrainerConfig(**flag_values(args))
    assert (cfg.num_workers, cfg.prefetch_factor, cfg.pin_memory) == (2, 3, True)
    unset = TrainerConfig(**flag_values(p.parse_args([])))
    assert (unset.num_workers, unset.prefetch_factor, unset.pin_memory) == (0, None, False)
    toml = from_mapping({"num_workers": 1, "prefetch_factor": 4, "pin_memory": True})
    assert (toml.num_workers, toml.prefetch_factor, toml.pin_memory) == (1, 4, True)


def test_the_command_refuses_prefetch_without_workers_in_one_line(capsys):
    from shardwise.cli import main

    assert main(["train", "--recipe", "digits", "--max-steps", "1", "--prefetch-factor", "3"]) == 2
    err = capsys.readouterr().err
    assert "prefetch_factor=3 sets how many micro-batches" in err and "--num-workers N" in err and "Traceback" not in err
