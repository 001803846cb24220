"""Data-loading workers: the same run, bit for bit, with 0 or 2 workers (augmentation drawing
from the global generators included, resume included), workers started once per run, and an
IterableDataset without __len__ refused without max_steps."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from shardwise import Trainer
from shardwise.data import ShardedLoader
from shardwise.errors import ConfigError


class Augmented(Dataset):
    """Digits-like samples with augmentation from all three global generators, as users write it."""

    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = torch.randn(8) * 0.1 + random.random() * 0.01 + float(np.random.rand()) * 0.01
        return self.x[i] + noise, self.y[i]


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


def loss_fn(out, batch):
    return nn.functional.cross_entropy(out, batch[1])


def train(workers: int, out=None, **settings) -> dict[str, torch.Tensor]:
    model = WithDropout()
    Trainer(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        loss_fn=loss_fn,
        global_batch_size=16,
        accumulate=2,
        num_workers=workers,
        progress_bar=False,
        out=str(out) if out else None,
        **settings,
    ).fit(model, Augmented())
    return model.state_dict()


def test_two_workers_train_bit_for_bit_as_none():
    plain, workers = train(0, max_steps=14), train(2, max_steps=14)  # 6 steps per epoch: three epochs
    for k in plain:
        assert torch.equal(plain[k], workers[k]), k


def test_a_resume_with_workers_equals_an_uninterrupted_run_without(tmp_path):
    whole = train(0, max_steps=8)
    train(2, out=tmp_path, max_steps=4, checkpoint_every=4)
    resumed = train(2, out=tmp_path, max_steps=8, resume="auto")
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k


class Pids(Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        return torch.tensor(os.getpid()), torch.tensor(i)


def test_workers_start_once_and_serve_every_epoch():
    loader = ShardedLoader(Pids(), global_batch=4, num_workers=2)
    pids = set()
    try:
        for _ in range(3):  # three epochs of 6 steps
            for step in loader:
                pids.update(step[0][0].tolist())
    finally:
        loader.close()
    assert len(pids) == 2 and os.getpid() not in pids


def test_augmentation_does_not_move_the_callers_generators():
    loader = ShardedLoader(Augmented(16), global_batch=4)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    next(iter(loader))
    assert torch.equal(torch.rand(3), expected)


class Stream(IterableDataset):
    def __iter__(self):
        yield from (torch.zeros(8) for _ in range(10))


def test_an_iterable_dataset_without_len_needs_max_steps():
    # streams train (tests/trainer/test_stream_fit.py); one with no __len__ cannot size a run by epochs
    with pytest.raises(ConfigError, match=r"stream with no __len__.*--max-steps N"):
        Trainer(loss_fn=loss_fn, max_epochs=1).fit(WithDropout(), Stream())
    with pytest.raises(ConfigError, match=r"stream with no __len__.*--max-steps N"):
        Trainer(loss_fn=loss_fn).fit(WithDropout(), torch.utils.data.DataLoader(Stream(), batch_size=2))


class Draws(Dataset):
    """Each sample is its index and one draw from each global generator: what an augmentation sees."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        return i, torch.tensor([torch.rand(()).item(), random.random(), float(np.random.rand())], dtype=torch.float64)


def _draws(loader: ShardedLoader, steps: int) -> dict[int, torch.Tensor]:
    """Index -> its draws, over the loader's next ``steps`` steps (across an epoch's end too)."""
    out: dict[int, torch.Tensor] = {}
    while steps:
        for step in loader:
            for index, draws in step:
                out.update(zip(index.tolist(), draws, strict=True))
            steps -= 1
            if not steps:
                break
    return out


def test_augmentation_draws_anew_each_epoch_and_the_same_again_on_a_resume_or_in_a_worker():
    # 12 samples in global batches of 4: 3 steps an epoch. Samples are seeded from (seed, epoch, index):
    # the same index draws differently in epoch 1 than in epoch 0 (an augmentation that repeated
    # every epoch would show a model the same crops forever), and identically when epoch 1 is replayed.
    loader = ShardedLoader(Draws(), global_batch=4, seed=3)
    epoch0 = _draws(loader, 3)
    epoch1_first = _draws(loader, 1)
    position = loader.state_dict()
    epoch1_rest = _draws(loader, 2)
    epoch1 = {**epoch1_first, **epoch1_rest}
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))
    for i in range(12):
        assert (epoch0[i] != epoch1[i]).all(), (i, epoch0[i], epoch1[i])  # every generator, every sample
    assert len({tuple(d.tolist()) for d in epoch0.values()}) == 12

    resumed = ShardedLoader(Draws(), global_batch=4, seed=3)
    resumed.load_state_dict(position)
    again = _draws(resumed, 2)
    assert again.keys() == epoch1_rest.keys() and all(torch.equal(again[i], epoch1_rest[i]) for i in again)

    worker = ShardedLoader(Draws(), global_batch=4, seed=3, num_workers=1)
    try:
        in_worker = [_draws(worker, 3), _draws(worker, 3)]  # both epochs from one persistent worker
    finally:
        worker.close()
    for got, want in zip(in_worker, (epoch0, epoch1), strict=True):
        assert got.keys() == want.keys() and all(torch.equal(got[i], want[i]) for i in got)
