"""``pin_memory`` for streams on CUDA: `StreamLoader` hands out page-locked micro-batches (pinned as fetched
without workers, by torch's pin-memory thread behind them), the same values as unpinned, and a Trainer run on
a stream trains on the GPU with pinned batches as without. Skipped without a CUDA device (run on a GPU machine)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset

from shardwise import Trainer
from shardwise.data import StreamLoader

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(48):
            x = torch.randn(6, generator=g)
            yield x, torch.tensor(int(x.argmax()) % 3)


@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_stream_batches_are_page_locked_and_the_same(workers):
    pinned = StreamLoader(Stream(), global_batch=8, accumulate=2, pin_memory=True, num_workers=workers)
    plain = StreamLoader(Stream(), global_batch=8, accumulate=2, num_workers=workers)
    try:
        a, b = list(pinned), list(plain)
    finally:
        pinned.close()
        plain.close()
    assert len(a) == len(b) == 6
    for sa, sb in zip(a, b, strict=True):
        for ma, mb in zip(sa, sb, strict=True):
            assert all(t.is_pinned() for t in ma) and not any(t.is_pinned() for t in mb)
            assert all(torch.equal(x, y) for x, y in zip(ma, mb, strict=True))


def _fit(pin: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    Trainer(
        accelerator="cuda",
        global_batch_size=8,
        max_steps=10,
        pin_memory=pin,
        loss_fn=lambda out, batch: nn.functional.cross_entropy(out, batch[1]),
        progress_bar=False,
    ).fit(model, Stream())
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_a_stream_trains_on_the_gpu_pinned_as_unpinned():
    pinned, plain = _fit(True), _fit(False)
    for k in plain:
        assert torch.equal(pinned[k], plain[k]), k
