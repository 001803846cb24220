"""Engine.gather_for_metrics: evaluation outputs of a padded DistributedSampler loader, gathered
in dataset order with the padding dropped, equal to one process's evaluation (37 samples, which
2 and 3 ranks do not divide: the sampler pads 1 and 2 duplicates)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from shardwise import ConfigError, Engine, launch
from tests.support.models import classification, mlp

pytestmark = pytest.mark.dist

N, BATCH = 37, 4


def _evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = model(x)
    return logits.argmax(-1), torch.nn.functional.cross_entropy(logits, y, reduction="none"), logits.argmax(-1) == y


def _ranks() -> dict:
    engine = Engine(strategy="ddp", accelerator="cpu", precision="64")
    data = classification(N)
    model = mlp()
    sampler = DistributedSampler(data, num_replicas=engine.mesh.size("dp"), rank=engine.mesh.coordinate("dp"), shuffle=False)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    index = torch.tensor(list(iter(sampler)))  # the dataset positions this rank evaluates, padding included
    per_batch: list[tuple[torch.Tensor, ...]] = []
    mine: list[tuple[torch.Tensor, ...]] = []
    for i, (x, y) in enumerate(loader):
        preds, losses, correct = _evaluate(model, x, y)
        mine.append((preds, losses, correct))
        # Accelerate's pattern: one gather per batch (offset = samples of this rank before the batch).
        per_batch.append(engine.gather_for_metrics((preds, losses, correct), total=N, offset=i * BATCH))
    whole = engine.gather_for_metrics(tuple(torch.cat(c) for c in zip(*mine, strict=True)), total=N)
    try:
        engine.gather_for_metrics(torch.zeros(N), total=N)
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    naive = sum(engine.all_reduce(torch.tensor([len(index)]), "sum").tolist())  # what a plain all-gather would count
    out = {
        "index": engine.gather_for_metrics(index, total=N),
        "whole": whole,
        "per_batch": tuple(torch.cat(c) for c in zip(*per_batch, strict=True)),
        "naive": naive,
        "refused": refused,
    }
    engine.close()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_gather_for_metrics_drops_the_padding_and_equals_one_process(world):
    data = classification(N)
    preds, losses, correct = _evaluate(mlp(), *data.tensors)
    for got in launch(_ranks, nproc=world):
        # The padded sampler hands out ceil(37 / W) x W positions: 38 on 2 ranks, 39 on 3.
        assert got["naive"] == -(-N // world) * world > N
        assert torch.equal(got["index"], torch.arange(N))  # every sample once, in dataset order
        for gathered in (got["whole"], got["per_batch"]):
            assert torch.equal(gathered[0], preds) and gathered[2].dtype == torch.bool and torch.equal(gathered[2], correct)
            torch.testing.assert_close(gathered[1], losses, rtol=1e-12, atol=0)
            # The metric a user computes: accuracy and mean loss over exactly 37 samples.
            assert gathered[2].sum().item() == correct.sum().item() and len(gathered[1]) == N
        assert "do not fit a padded shard of" in got["refused"] and f"({N} samples over {world} ranks)" in got["refused"]


def test_one_process_gathers_its_own_outputs():
    engine = Engine(strategy="single", accelerator="cpu")
    t = torch.arange(N)
    assert torch.equal(engine.gather_for_metrics(t, total=N), t)
    assert torch.equal(engine.gather_for_metrics(t[8:12], total=N, offset=8), t[8:12])
    with pytest.raises(ConfigError, match="pass total=len\\(dataset\\)"):
        engine.gather_for_metrics(t, total=N - 1)
    engine.close()
