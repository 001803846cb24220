"""Global-batch sampling, exact-once evaluation, and the loader's resumable position."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardwise.data import ShardedLoader, eval_batches, eval_shard, per_rank_batch, unpack_data
from shardwise.errors import ConfigError


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float64).unsqueeze(1), torch.arange(n))


def test_per_rank_batch_divides_or_says_how_to_fix():
    assert per_rank_batch(64, 2, 2) == 16
    with pytest.raises(
        ConfigError,
        match=r"global batch 10 is not divisible by world size 4 x accumulate 1; choose a global batch that is a multiple of 4 \(e.g. 8 or 12\): "
        r"global_batch_size= in Python, --global-batch-size on the command line",
    ):
        per_rank_batch(10, 4, 1)
    with pytest.raises(ConfigError, match="world size must be a whole number >= 1; got 0"):
        per_rank_batch(8, 0, 1)


def _global_steps(n: int, gb: int, world: int, acc: int, epochs: int = 2) -> list[list[int]]:
    """Each step's global batch: every rank's micro-batches, rank-major."""
    loaders = [ShardedLoader(_dataset(n), global_batch=gb, world_size=world, rank=r, accumulate=acc, seed=7) for r in range(world)]
    steps: list[list[int]] = []
    for _ in range(epochs):
        per_rank = [list(iter(ld)) for ld in loaders]
        for step in zip(*per_rank, strict=True):
            steps.append([int(v) for rank_micro in step for mb in rank_micro for v in mb[1]])
    return steps


def test_the_global_batch_does_not_depend_on_world_size_or_accumulation():
    reference = _global_steps(50, 8, 1, 1)
    for world, acc in [(2, 1), (4, 1), (2, 2), (1, 4)]:
        assert _global_steps(50, 8, world, acc) == reference
    # Each epoch: 6 full global batches of distinct samples; the next epoch is a new order.
    assert len(reference) == 12
    assert len(set(sum(reference[:6], []))) == 48
    assert reference[:6] != reference[6:]


def test_ranks_take_disjoint_slices():
    loaders = [ShardedLoader(_dataset(40), global_batch=8, world_size=2, rank=r, seed=1) for r in range(2)]
    a, b = (next(iter(ld))[0][1].tolist() for ld in loaders)
    assert len(a) == len(b) == 4 and not set(a) & set(b)


def test_resume_mid_epoch_continues_with_exactly_the_next_samples():
    full = ShardedLoader(_dataset(30), global_batch=4, seed=3)
    order = [mb[0][1].tolist() for _ in range(3) for mb in iter(full)]
    part = ShardedLoader(_dataset(30), global_batch=4, seed=3)
    it = iter(part)
    seen = [next(it)[0][1].tolist() for _ in range(5)]  # mid-epoch (7 steps per epoch)
    state = part.state_dict()
    assert state["epoch"] == 0 and state["step_in_epoch"] == 5
    fresh = ShardedLoader(_dataset(30), global_batch=4, seed=0)
    fresh.load_state_dict(state)
    rest = [mb[0][1].tolist() for mb in iter(fresh)] + [mb[0][1].tolist() for _ in range(2) for mb in iter(fresh)]
    assert seen + rest[: len(order) - 5] == order


def test_a_position_from_another_data_set_is_refused():
    ld = ShardedLoader(_dataset(30), global_batch=4)
    with pytest.raises(ConfigError, match="saved for 31 samples"):
        ld.load_state_dict({"epoch": 0, "step_in_epoch": 1, "seed": 0, "n": 31, "global_batch": 4})


def test_fewer_samples_than_a_global_batch_is_an_error():
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        ShardedLoader(_dataset(3), global_batch=4)


@pytest.mark.parametrize("n,world", [(10, 3), (7, 4), (3, 4), (360, 2)])
def test_evaluation_covers_every_sample_exactly_once(n, world):
    seen = []
    for r in range(world):
        for batch in eval_batches(_dataset(n), world, r, batch_size=2):
            seen.extend(batch[1].tolist())
    assert sorted(seen) == list(range(n))
    sizes = [len(eval_shard(n, world, r)) for r in range(world)]
    assert max(sizes) - min(sizes) <= 1


def test_worker_processes_give_the_same_batches():
    a = ShardedLoader(_dataset(24), global_batch=4, accumulate=2, seed=5)
    b = ShardedLoader(_dataset(24), global_batch=4, accumulate=2, seed=5, num_workers=1)
    steps_a, steps_b = list(iter(a)), list(iter(b))
    b.close()
    assert len(steps_a) == len(steps_b) == 6
    for sa, sb in zip(steps_a, steps_b, strict=True):
        for ma, mb in zip(sa, sb, strict=True):
            assert torch.equal(ma[1], mb[1])
    assert a.state_dict() == b.state_dict()


def test_dataloaders_and_datasets_are_accepted_others_refused():
    ds = _dataset(8)
    assert unpack_data(DataLoader(ds, batch_size=4))[3] == 4
    assert unpack_data(ds)[0] is ds
    with pytest.raises(ConfigError, match="map-style Dataset"):
        unpack_data(iter([1, 2]))
