"""`StreamLoader`: each global batch is the stream's next B samples at any world size (stride), the
position resumes by the source's state or a replay (at another world size too), workers change nothing,
and the last smaller batch is weighted as the map-style loader's."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from shardwise.data import ShardedLoader, StreamLoader
from shardwise.errors import ConfigError


class Ids(IterableDataset):
    """Sample i: (i, one draw of each global generator, the epoch set): what an augmenting stream yields."""

    def __init__(self, n: int = 22) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor(i), torch.tensor([torch.rand(()).item(), random.random(), float(np.random.rand()), self.epoch], dtype=torch.float64)


class Sized(Ids):
    def __len__(self) -> int:
        return self.n


class Stateful(Ids):
    """A source that reports its position (as torchdata's and Hugging Face's do) and counts what it reads."""

    def __init__(self, n: int = 22) -> None:
        super().__init__(n)
        self.pos, self.start, self.reads = 0, 0, 0

    def __iter__(self):
        start, self.start = self.start, 0
        for i in range(start, self.n):
            self.pos, self.reads = i + 1, self.reads + 1
            yield torch.tensor(i), torch.tensor([torch.rand(()).item(), random.random(), float(np.random.rand()), self.epoch], dtype=torch.float64)

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["pos"]


class SplitsItself(Ids):
    """A stream that shards itself over a DataLoader's workers, as many do: the loader must read it whole."""

    def __iter__(self):
        info = get_worker_info()
        for k, sample in enumerate(super().__iter__()):
            if info is None or k % info.num_workers == info.id:
                yield sample


def steps(loader, count: int) -> list[list]:
    """The next ``count`` steps (across epoch ends), each a list of micro-batches."""
    out: list[list] = []
    while len(out) < count:
        got = False
        for step in loader:
            got = True
            out.append(step)
            if len(out) == count:
                break
        assert got or len(out) == count or loader.steps_per_epoch is None
    return out


def ids(step: list) -> list[list[int]]:
    return [m[0].tolist() for m in step]


@pytest.mark.parametrize("world,accumulate", [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_each_step_is_the_next_global_batch_by_stride_at_any_world_size(world, accumulate):
    B, n = 8, 22  # 2 full steps an epoch, 6 left out
    ranks = [StreamLoader(Ids(n), global_batch=B, world_size=world, rank=r, accumulate=accumulate, seed=3) for r in range(world)]
    per_rank = [steps(ld, 4) for ld in ranks]  # two epochs
    m = B // (world * accumulate)
    for s in range(4):
        base = (s % 2) * B
        for r in range(world):
            want = [[base + r + world * j for j in range(k * m, (k + 1) * m)] for k in range(accumulate)]
            assert ids(per_rank[r][s]) == want
    one = steps(StreamLoader(Ids(n), global_batch=B, seed=3), 4)
    for s in range(4):  # the same samples, drawn the same, whatever the split
        whole = {i: d for i, d in zip(one[s][0][0].tolist(), one[s][0][1], strict=True)}
        for r in range(world):
            for mb in per_rank[r][s]:
                for i, d in zip(mb[0].tolist(), mb[1], strict=True):
                    assert torch.equal(whole[i], d)
    epochs = [float(per_rank[0][s][0][1][0, 3]) for s in range(4)]
    assert epochs == [0, 0, 1, 1]  # set_epoch at each epoch's start
    assert ranks[0].epoch == 1 and ranks[0].steps_per_epoch is None and ranks[0].left_out == 0


def test_the_last_smaller_batch_is_weighted_as_the_map_loaders():
    # 11 samples, B 4 over 2 ranks x 2: the last step holds 3 samples; every micro-batch's weight is
    # size x parts / samples, a part left empty gets a copy weighted 0, and the weighted means add up.
    loaders = [StreamLoader(Sized(11), global_batch=4, world_size=2, rank=r, accumulate=2, drop_last=False) for r in range(2)]
    got = [steps(ld, 3) for ld in loaders]
    assert loaders[0].steps_per_epoch == 3 and loaders[0].last_step_samples == 3
    assert ids(got[0][2]) == [[8], [10]] and ids(got[1][2]) == [[9], [8]]
    assert loaders[0].last_weights == [4 / 3, 4 / 3] and loaders[1].last_weights == [4 / 3, 0.0]
    mapped = [
        ShardedLoader(torch.utils.data.TensorDataset(torch.arange(11)), global_batch=4, world_size=2, rank=r, accumulate=2, drop_last=False) for r in range(2)
    ]
    assert sum(w for ld in loaders for w in ld.last_weights) == sum(w for ld in mapped for w in ld.step_weights(2)) == 4  # parts: world x accumulate
    # the strategies' mean of weighted micro-batch means is the mean over the step's 3 samples
    means = [float(m[0].double().mean()) for step in (got[0][2], got[1][2]) for m in step]
    weights = loaders[0].last_weights + loaders[1].last_weights
    assert abs(sum(w * x for w, x in zip(weights, means, strict=True)) / 4 - (8 + 9 + 10) / 3) < 1e-12
    kept = StreamLoader(Sized(11), global_batch=4, drop_last=True)
    assert kept.steps_per_epoch == 2 and kept.left_out == 3


@pytest.mark.parametrize("source", [Ids, Stateful])
def test_a_resume_continues_at_the_next_sample_at_the_same_or_another_world_size(source):
    B = 8
    whole = steps(StreamLoader(source(), global_batch=B, seed=5), 5)  # epoch 0: steps 0-1, epoch 1: 2-3, epoch 2: 4
    for stop in (1, 2, 3):
        first = StreamLoader(source(), global_batch=B, world_size=2, rank=1, seed=5)
        steps(first, stop)
        state = first.state_dict()
        # stopped at step 2 the loader has not yet seen epoch 0's stream end (no __len__): a resume finds it
        assert (state["epoch"], state["consumed"]) == {1: (0, 8), 2: (0, 16), 3: (1, 8)}[stop]
        assert (state["source"] is not None) == (source is Stateful)
        for world in (1, 2, 4):
            parts = []
            for r in range(world):
                src = source()
                ld = StreamLoader(src, global_batch=B, world_size=world, rank=r, seed=5)
                ld.load_state_dict(state)
                parts.append(steps(ld, 5 - stop))
                if source is Stateful and stop == 1:
                    assert src.reads == (22 - B) + 22 + B  # read from the position, not replayed from the start
            for s in range(5 - stop):
                got = sorted((i, tuple(d.tolist())) for p in parts for mb in p[s] for i, d in zip(mb[0].tolist(), mb[1], strict=True))
                want = sorted((i, tuple(d.tolist())) for i, d in zip(whole[stop + s][0][0].tolist(), whole[stop + s][0][1], strict=True))
                assert got == want, (stop, world, s)


@pytest.mark.parametrize("source", [Ids, SplitsItself, Stateful])
def test_two_workers_give_the_batches_of_none_bit_for_bit_resume_included(source):
    kwargs = dict(global_batch=4, world_size=2, rank=1, accumulate=2, seed=7, drop_last=False)
    plain = steps(StreamLoader(source(10), **kwargs), 6)  # 3 steps an epoch (the last one smaller)
    loader = StreamLoader(source(10), num_workers=2, **kwargs)
    try:
        with_workers = steps(loader, 4)
        state = loader.state_dict()
    finally:
        loader.close()
    resumed = StreamLoader(source(10), num_workers=2, **kwargs)
    resumed.load_state_dict(state)
    try:
        with_workers += steps(resumed, 2)
        weights = resumed.last_weights
    finally:
        resumed.close()
    assert weights == [4 / 2, 0.0]
    assert len(plain) == len(with_workers) == 6
    for a, b in zip(plain, with_workers, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_limit_epochs_and_the_callers_generators():
    loader = StreamLoader(Ids(40), global_batch=4, limit=3)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = [ids(s) for s in loader]
    assert torch.equal(torch.rand(3), expected)  # reading the stream moved none of the caller's generators
    assert first == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9, 10, 11]]] and loader.epoch == 1
    assert [ids(s) for s in loader][0] == [[0, 1, 2, 3]]
    assert StreamLoader(Sized(40), global_batch=4, limit=0.5).steps_per_epoch == 5
    with pytest.raises(ConfigError, match=r"Cut.__len__ says 8 samples, and epoch 0 of the stream yielded at least 9.*remove __len__"):
        longer = StreamLoader(Cut(12), global_batch=4)
        [[ids(s) for s in longer] for _ in range(2)]  # an epoch cut by __len__ finds the stream's end as the next one starts
    with pytest.raises(ConfigError, match=r"Cut.__len__ says 8 samples, and epoch 0 of the stream yielded 6\b"):
        [ids(s) for s in StreamLoader(Cut(6), global_batch=4)]
    exact = StreamLoader(Cut(8), global_batch=4)
    assert [[ids(s) for s in exact] for _ in range(2)] == [[[[0, 1, 2, 3]], [[4, 5, 6, 7]]]] * 2
    assert [ids(s) for s in StreamLoader(Cut(12), global_batch=4, limit=1)] == [[[0, 1, 2, 3]]]  # a limit cuts on purpose


class Cut(Ids):
    """A stream of ``n`` whose __len__ says 8 (wrong unless n is 8): refused where the stream ends elsewhere."""

    def __init__(self, n: int) -> None:
        super().__init__(n)

    def __len__(self) -> int:
        return 8


def test_refusals_say_what_and_how():
    loader = StreamLoader(Ids(), global_batch=8)
    with pytest.raises(ConfigError, match="saved for global batches of 8 samples; this run takes 4.*global batch size 8"):
        StreamLoader(Ids(), global_batch=4).load_state_dict(loader.state_dict())
    mapped = ShardedLoader(torch.utils.data.TensorDataset(torch.arange(16)), global_batch=8)
    with pytest.raises(ConfigError, match="map-style loader's"):
        loader.load_state_dict(mapped.state_dict())
    with pytest.raises(ConfigError, match="an iterator: it can be read once"):
        StreamLoader(iter(range(10)), global_batch=2)
    with pytest.raises(ConfigError, match="'auto'.*'replay'"):
        StreamLoader(Ids(), global_batch=2, resume="state")
    with pytest.raises(ConfigError, match="fraction of an epoch, and the stream has no __len__"):
        StreamLoader(Ids(), global_batch=2, limit=0.5)
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        StreamLoader(Sized(6), global_batch=8)
    with pytest.raises(ConfigError, match="epoch 0 of the stream holds no global batch of 32"):
        next(iter(StreamLoader(Ids(20), global_batch=32)))
    replayed = StreamLoader(Ids(4), global_batch=2)
    replayed.load_state_dict({**loader.state_dict(), "global_batch": 2, "consumed": 8})
    with pytest.raises(ConfigError, match="ended after 4 samples of epoch 0, before the checkpoint's position"):
        next(iter(replayed))


class Plain(IterableDataset):
    """A stream that draws no random numbers and says so: the loader skips seeding each sample."""

    draws_no_randomness = True

    def __iter__(self):
        for i in range(22):
            yield torch.tensor(i), torch.tensor([float(i)], dtype=torch.float64)


class PlainAugmented(Plain):
    """Overrides ``__iter__`` with noise and does not say it draws none: seeded again."""

    def __iter__(self):
        for i, x in super().__iter__():
            yield i, x + torch.rand(())


def test_a_stream_that_says_it_draws_no_randomness_is_not_seeded_a_subclass_that_augments_is(monkeypatch):
    import shardwise.data.stream as stream

    calls = []
    monkeypatch.setattr(stream, "_seed_all", lambda value: calls.append(value))
    steps(StreamLoader(Plain(), global_batch=8), 2)
    assert calls == [], "a source that declares draws_no_randomness is seeded per sample (torch's default collate draws nothing either)"
    steps(StreamLoader(PlainAugmented(), global_batch=8), 2)
    assert len(calls) >= 16, "a subclass that overrides __iter__ without the declaration must be seeded per sample"
    monkeypatch.undo()
    # still the same samples at any world size and on a resume: the augmented subclass is seeded
    whole = steps(StreamLoader(PlainAugmented(), global_batch=8, seed=3), 2)
    halves = [steps(StreamLoader(PlainAugmented(), global_batch=8, seed=3, world_size=2, rank=r), 2) for r in range(2)]
    for s in range(2):
        got = sorted((int(i), float(x)) for h in halves for i, x in zip(h[s][0][0], h[s][0][1], strict=True))
        assert got == sorted((int(i), float(x)) for i, x in zip(whole[s][0][0], whole[s][0][1], strict=True))
