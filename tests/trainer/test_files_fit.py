"""Issue 41's must-show for token shards: a 2-process ddp `Trainer` run on a directory of token
shards trains; one stopped at step 3 and resumed to 6 ends bitwise equal to the uninterrupted one;
a resume at another world size (2 -> 1, 1 -> 2) trains the same set of block ids in every step.

Each sample carries its block id; the model records the ids of every training forward in a file
per process, one line a step (accumulate 1, no validation), so a step's global batch is the union
of line k over the ranks' files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise import Trainer
from shardwise.data import TokenShards, write_token_shards
from shardwise.errors import ConfigError

pytestmark = pytest.mark.dist

SEQ, BATCH = 8, 8


class Labelled(TokenShards):
    """Blocks with their id: ``(x, id, y)``, so the model is called as ``model(x, id)``."""

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return x, torch.tensor(i), y


class Recording(nn.Module):
    def __init__(self, log: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.log = nn.Embedding(64, 16), nn.Linear(16, 64), log

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and ids.device.type != "meta":  # the parent counts FLOPs on meta tensors once
            with open(os.path.join(self.log, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(sorted(ids.tolist())) + "\n")
        return self.head(torch.tanh(self.emb(x)))


def _loss(out: torch.Tensor, batch) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), batch[-1].reshape(-1))


def _fit(data: Path, out: Path, log: Path, nproc: int, max_steps: int, resume: str | None = None) -> dict[str, torch.Tensor]:
    log.mkdir(parents=True, exist_ok=True)
    model = Recording(str(log))
    Trainer(
        strategy="ddp" if nproc > 1 else "single",
        nproc=nproc,
        global_batch_size=BATCH,
        max_steps=max_steps,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        loss_fn=_loss,
        out=str(out),
        checkpoint_every=3,
        resume=resume,
        progress_bar=False,
        timeout_s=60,
    ).fit(model, Labelled(data, SEQ, shuffle_window=4))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _steps(log: Path) -> list[set[int]]:
    """The global batch of each step: line k of every process's file, together."""
    files = [[json.loads(line) for line in p.read_text().splitlines()] for p in sorted(log.glob("*.jsonl"))]
    assert len({len(f) for f in files}) == 1, [len(f) for f in files]
    return [set().union(*(f[k] for f in files)) for k in range(len(files[0]))]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (30,), generator=g)]
    path = tmp_path_factory.mktemp("shards")
    write_token_shards(docs, path, sep=0, shard_tokens=100)  # ~350 tokens: 4 shards, ~42 blocks, 5 steps an epoch
    return path


def test_ddp_on_token_shards_resumes_bitwise_and_at_another_world_size_trains_the_same_blocks(shards, tmp_path):
    n = len(TokenShards(shards, SEQ))
    assert 3 <= n // BATCH < 6  # 6 steps cross an epoch's end
    whole = _fit(shards, tmp_path / "whole", tmp_path / "log-whole", 2, 6)
    want = _steps(tmp_path / "log-whole")
    assert len(want) == 6 and all(len(s) == BATCH for s in want)

    _fit(shards, tmp_path / "split", tmp_path / "log-split-a", 2, 3)
    shutil.copytree(tmp_path / "split", tmp_path / "to-one")  # the step-3 checkpoint, resumed at 1 process below
    resumed = _fit(shards, tmp_path / "split", tmp_path / "log-split-b", 2, 6, "auto")
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k
    assert _steps(tmp_path / "log-split-a") + _steps(tmp_path / "log-split-b") == want

    _fit(shards, tmp_path / "to-one", tmp_path / "log-to-one", 1, 6, "auto")  # 2 -> 1
    assert _steps(tmp_path / "log-to-one") == want[3:]

    _fit(shards, tmp_path / "to-two", tmp_path / "log-to-two-a", 1, 3)  # 1 -> 2
    _fit(shards, tmp_path / "to-two", tmp_path / "log-to-two-b", 2, 6, "auto")
    assert _steps(tmp_path / "log-to-two-a") + _steps(tmp_path / "log-to-two-b") == want


def test_a_resume_with_another_shuffle_window_is_refused_before_launch(tmp_path: Path) -> None:
    write_token_shards([list(range(2, 60))] * 6, tmp_path / "data", sep=1, shard_tokens=100)
    _fit(tmp_path / "data", tmp_path / "run", tmp_path / "log", nproc=1, max_steps=3)
    trainer = Trainer(strategy="ddp", nproc=2, global_batch_size=BATCH, max_steps=6, loss_fn=_loss, out=str(tmp_path / "run"), resume="auto")
    with pytest.raises(ConfigError, match=r"step-00000003: .*would not follow \(window 4 -> 8\).*same shards and shuffle_window"):
        trainer.fit(Recording(str(tmp_path / "log")), Labelled(tmp_path / "data", SEQ, shuffle_window=8))
    assert not (tmp_path / "run" / "errors").exists(), "refused in the workers, not before launch"
