"""`Trainer.fit` on a stream (an IterableDataset): a 2-process ddp run stopped and resumed trains weights bitwise
equal to an uninterrupted one (the source replayed, or its own state loaded), a resume at another world size
trains the same samples in every step (recorded by id), validation over a stream counts each sample once, and
what a stream cannot do is refused before launch."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset

from shardwise import Trainer
from shardwise.cli import main
from shardwise.errors import ConfigError


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(4, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
    return torch.tensor(i), x, x.sum() + 0.1 * i


class Ids(IterableDataset):
    """Samples 0..n-1 as (id, x, y); no __len__: an epoch ends where the stream does."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __iter__(self):
        yield from (sample(i) for i in range(self.n))


class Stateful(Ids):
    """The same samples from a source that reports its position; it notes in ``mark`` each state it is given."""

    def __init__(self, n: int = 40, mark: str | None = None) -> None:
        super().__init__(n)
        self.pos, self.start, self.mark = 0, 0, mark

    def __iter__(self):
        start, self.start = self.start, 0
        for i in range(start, self.n):
            self.pos = i + 1
            yield sample(i)

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["pos"]
        if self.mark and state["pos"]:
            with open(self.mark, "a") as f:
                f.write(f"{state['pos']}\n")


class Net(nn.Module):
    """A linear model whose training_step records the sample ids each rank trains on, one line per step."""

    def __init__(self, record: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(4, 1).double()
        self.record = record

    def forward(self, x):
        return self.lin(x).squeeze(-1)

    def training_step(self, batch):
        ids, x, y = batch
        if self.training and self.record:
            rank = dist.get_rank() if dist.is_initialized() else 0
            with open(f"{self.record}-{rank}.txt", "a") as f:
                f.write(" ".join(str(i) for i in ids.tolist()) + "\n")
        return ((self(x) - y) ** 2).mean()


def fit(data, *, nproc: int, steps: int, out: Path, record: str | None = None, val=None, **settings) -> tuple[dict, dict]:
    model = Net(record)
    trainer = Trainer(
        strategy="ddp" if nproc > 1 else "single",
        nproc=nproc,
        precision="64",
        global_batch_size=8,
        max_steps=steps,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        progress_bar=False,
        out=str(out),
        **settings,
    )
    summary = trainer.fit(model, data, val)
    return summary, model.state_dict()


def steps_of(record: str, world: int) -> list[set[int]]:
    """The samples of each step over the ranks' records."""
    lines = [Path(f"{record}-{r}.txt").read_text().split("\n")[:-1] for r in range(world)]
    return [set().union(*({int(i) for i in ln[s].split()} for ln in lines)) for s in range(len(lines[0]))]


def test_a_stream_resumes_bitwise_replayed_or_from_its_state_and_at_another_world_size(tmp_path):
    # 40 samples in global batches of 8: 5 steps an epoch, so 6 steps cross an epoch's end.
    whole_rec = str(tmp_path / "whole")
    summary, whole = fit(Ids(), nproc=2, steps=6, out=tmp_path / "whole", record=whole_rec, val=Ids(7))
    assert summary["steps"] == 6 and summary["samples"] == 48 and summary["val_samples"] == 7
    expected = [set(range(s * 8 % 40, s * 8 % 40 + 8)) for s in range(6)]
    assert steps_of(whole_rec, 2) == expected
    model = Net()
    model.load_state_dict(whole)
    with torch.no_grad():  # validation over the stream: each of the 7 samples once, over 2 ranks
        val = sum(float((model(x) - y) ** 2) for _, x, y in Ids(7)) / 7
    assert abs(summary["val_loss"] - val) < 1e-12

    for name, source in (("replay", lambda: Ids()), ("state", lambda: Stateful(mark=str(tmp_path / "loaded")))):
        out = tmp_path / name
        fit(source(), nproc=2, steps=3, out=out, checkpoint_every=3)
        shutil.copytree(out, tmp_path / f"{name}-copy")
        summary, resumed = fit(source(), nproc=2, steps=6, out=out, resume="auto")
        assert summary["resumed_from"] and summary["samples"] == 48
        for k in whole:
            assert torch.equal(whole[k], resumed[k]), (name, k)
    assert Path(tmp_path / "loaded").read_text().split() == ["24", "24"]  # each rank loaded the source's state at sample 24

    # 2 processes -> 1: the resumed steps train the same samples
    rec = str(tmp_path / "to1")
    fit(Ids(), nproc=1, steps=6, out=tmp_path / "replay-copy", resume="auto", record=rec)
    assert steps_of(rec, 1) == expected[3:]
    # 1 process -> 2
    fit(Ids(), nproc=1, steps=3, out=tmp_path / "one", checkpoint_every=3)
    rec = str(tmp_path / "to2")
    fit(Ids(), nproc=2, steps=6, out=tmp_path / "one", resume="auto", record=rec)
    assert steps_of(rec, 2) == expected[3:]


def test_validating_a_stream_under_zero3_pads_the_uneven_rank_and_counts_each_sample_once():
    # 9 samples in batches of 2 over 2 ranks: rank 0 holds 5 (3 batches), rank 1 holds 4 (2 batches and the padding
    # forward: zero3's forward gathers the weights, a collective both ranks must make as often)
    model = Net()
    with torch.no_grad():
        losses = [float((model(x) - y) ** 2) for _, x, y in Ids(9)]
    settings = dict(strategy="zero3", nproc=2, precision="64", val_batch_size=2, progress_bar=False, timeout_s=60)
    got = Trainer(**settings).validate(Net(), Ids(9))
    assert got["val_samples"] == 9 and abs(got["val_loss"] - sum(losses) / 9) < 1e-12
    limited = Trainer(precision="64", val_batch_size=2, limit_val_batches=2, progress_bar=False).validate(Net(), Ids(9))
    assert limited["val_samples"] == 4 and abs(limited["val_loss"] - sum(losses[:4]) / 4) < 1e-12  # 2 batches of 2: the first 4


class Sized(Ids):
    def __len__(self) -> int:
        return self.n


def test_the_last_smaller_batch_of_a_stream_trains_as_a_hand_loop(tmp_path):
    # 21 samples, global batch 8 in 2 micro-batches, drop_last=False: steps of 8, 8 and 5 (micro-batches of 3 and 2,
    # weighted 6/5 and 4/5) each epoch, two epochs
    summary, got = fit(Sized(21), nproc=1, steps=6, out=tmp_path / "run", drop_last=False, accumulate=2)
    assert summary["samples"] == 42 and summary["samples_left_out_per_epoch"] == 0
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = list(Sized(21))
    for _ in range(2):
        for start in (0, 8, 16):
            batch = data[start : start + 8]
            x, y = torch.stack([b[1] for b in batch]), torch.stack([b[2] for b in batch])
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    for k, v in model.state_dict().items():
        assert torch.allclose(got[k], v, rtol=0, atol=1e-12), k


def test_a_stream_is_checked_before_launch():
    def refused(data, match, **settings):
        with pytest.raises(ConfigError, match=match):
            Trainer(global_batch_size=8, progress_bar=False, **settings).fit(Net(), data)

    refused(Ids(), r"stream with no __len__.*max_steps=\.\.\. \(--max-steps N\)", max_epochs=2)
    refused(Ids(0), "yields no sample", max_steps=2)
    refused(Ids(5), "yields 5 samples, fewer than one global batch of 8", max_steps=2)
    refused(Ids(), "fraction of an epoch", max_steps=2, limit_train_batches=0.5)
    refused((sample(i) for i in range(20)), "an iterator: it can be read once", max_steps=2)
    with pytest.raises(ConfigError, match="predict returns one row per sample in dataset order"):
        Trainer(progress_bar=False).predict(Net(), Ids())


def test_overfit_and_the_first_lines(capsys, tmp_path):
    summary, _ = fit(Stateful(), nproc=1, steps=4, out=tmp_path / "a", overfit_batches=1, record=str(tmp_path / "of"))
    assert steps_of(str(tmp_path / "of"), 1) == [set(range(8))] * 4
    fit(Ids(), nproc=1, steps=1, out=tmp_path / "b")
    said = capsys.readouterr().out
    assert "a stream (Ids, no __len__: an epoch ends where the stream does), each rank keeping samples i % 1 == rank" in said
    assert "a resume replays the stream up to its position (Ids has no state_dict/load_state_dict)" in said
    fit(Stateful(), nproc=1, steps=1, out=tmp_path / "c", val=Ids(3))
    assert "a resume loads Stateful's own state" in capsys.readouterr().out
    fit(Stateful(), nproc=1, steps=1, out=tmp_path / "d", stream_resume="replay", num_workers=1)
    said = capsys.readouterr().out
    assert "a resume replays the stream up to its position (stream_resume='replay')" in said
    assert "each of the 1 data-loading workers reads the whole stream" in said


MODULE = """
import torch
from torch.utils.data import IterableDataset


class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(64):
            x = torch.randn(4, generator=g)
            yield x, x.sum()


def make_model():
    return torch.nn.Linear(4, 1)


def make_stream():
    return Stream()


def loss(output, batch):
    return ((output.squeeze(-1) - batch[1]) ** 2).mean()
"""


def test_shardwise_train_takes_a_stream_from_data(tmp_path, monkeypatch):
    (tmp_path / "streammod.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    try:
        argv = ["train", "--model", "streammod:make_model", "--data", "streammod:make_stream", "--loss", "streammod:loss"]
        assert main([*argv, "--max-steps", "3", "--global-batch-size", "16", "--out", "run"]) == 0
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3
    finally:
        sys.modules.pop("streammod", None)


class ShardsItselfByRank(Ids):
    """The hand-written DDP idiom inside a stream: each process keeps ``range(rank, n, world)`` (shardwise splits
    the stream itself: done twice, half the samples would never train)."""

    def __iter__(self):
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        yield from (sample(i) for i in range(rank, self.n, world))


class UnseededFilter(Ids):
    """Drops samples with a generator of its own, seeded differently in every process."""

    def __iter__(self):
        import os

        keep = torch.Generator().manual_seed(os.getpid())
        yield from (sample(i) for i in range(self.n) if torch.rand((), generator=keep) < 0.7)


class DiffersAfterTheFirstBatches(Ids):
    """The same first 24 samples (three global batches of 8) in every process, then another order on rank 1: a
    check of the first global batch alone passes it (and then trains duplicated and missing samples)."""

    def __iter__(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        tail = list(range(24, self.n))
        yield from (sample(i) for i in [*range(24), *(reversed(tail) if rank == 1 else tail)])


@pytest.mark.parametrize("stream", [ShardsItselfByRank, UnseededFilter, DiffersAfterTheFirstBatches])
def test_a_stream_that_reads_differently_per_process_is_refused_at_the_start(tmp_path, stream):
    with pytest.raises(ConfigError, match=rf"the stream {stream.__name__} reads differently in different processes.*same samples in the same order"):
        fit(stream(), nproc=2, steps=2, out=tmp_path / "run")


def test_a_resume_with_another_global_batch_is_refused_before_launch(tmp_path):
    fit(Ids(), nproc=1, steps=3, out=tmp_path / "run", checkpoint_every=3)
    trainer = Trainer(strategy="ddp", nproc=2, precision="64", global_batch_size=16, max_steps=6, progress_bar=False, out=str(tmp_path / "run"), resume="auto")
    with pytest.raises(ConfigError, match=r"trained with a global batch of 8 samples, and this run takes 16.*global_batch_size=8"):
        trainer.fit(Net(), Ids())
    assert not (tmp_path / "run" / "errors").exists(), "refused in the workers, not before launch"
