"""``pin_memory`` on CUDA: the loader hands out page-locked batches (fetched in the training process, or
pinned by torch's pin-memory thread behind a worker), the Trainer says nothing about it, and a pinned
run (batches copied with non_blocking=True) trains as an unpinned one. Skipped without a CUDA device;
the CPU side (the note, the same weights) is tests/trainer/test_data_path.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Trainer
from shardwise.data import ShardedLoader
from shardwise.trainer.callbacks import Callback

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))


@pytest.mark.parametrize("workers", [0, 1])
def test_pinned_batches_are_page_locked(workers):
    pinned = ShardedLoader(_data(), global_batch=8, pin_memory=True, num_workers=workers)
    plain = ShardedLoader(_data(), global_batch=8, num_workers=workers)
    try:
        a, b = next(iter(pinned))[0], next(iter(plain))[0]
    finally:
        pinned.close()
        plain.close()
    assert pinned.pin_memory and all(t.is_pinned() for t in a)
    assert not any(t.is_pinned() for t in b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Seen(Callback):
    """Whether the run's loader pins, and the device of every batch the step got."""

    def __init__(self) -> None:
        self.pinned: bool | None = None

    def on_train_step_end(self, trainer, engine, step, loss) -> None:
        self.pinned = trainer._state["loader"].pin_memory
        assert engine.device.type == "cuda"


def _fit(**settings) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Seen]:
    """(the weights before, after, what was seen) of 8 steps on CUDA."""
    torch.manual_seed(0)
    model, seen = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), Seen()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    Trainer(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
        accelerator="cuda",
        global_batch_size=16,
        max_steps=8,
        progress_bar=False,
        model_summary=False,
        callbacks=[seen],
        **settings,
    ).fit(model, _data())
    return start, {k: v.detach().cpu() for k, v in model.state_dict().items()}, seen


@pytest.mark.parametrize("workers", [0, 1])
def test_a_pinned_run_trains_as_an_unpinned_one(workers, capsys):
    start, plain, seen_plain = _fit(num_workers=workers)
    _, pinned, seen_pinned = _fit(num_workers=workers, pin_memory=True)
    assert (seen_plain.pinned, seen_pinned.pinned) == (False, True)
    assert "pin_memory needs" not in capsys.readouterr().out  # on CUDA there is nothing to say
    assert max((plain[k] - start[k]).abs().max().item() for k in plain) > 1e-3  # training moved the weights
    for k in plain:
        assert torch.allclose(plain[k], pinned[k], rtol=0, atol=1e-6), (k, (plain[k] - pinned[k]).abs().max().item())
