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


# -- the epoch's remainder: said, and kept exactly with drop_last=False ----------------------------------


def test_drop_last_false_splits_the_last_batch_evenly_with_weights_and_pads_empty_parts():
    # 70 samples, global batch 16: 4 full steps and one of 6 samples, over 2 ranks x 2 micro-batches: 2, 2, 1, 1
    seen, weights = [], []
    for rank in range(2):
        loader = ShardedLoader(_dataset(70), global_batch=16, world_size=2, rank=rank, accumulate=2, shuffle=False, drop_last=False)
        assert loader.steps_per_epoch == 5 and loader.left_out == 0
        steps = list(loader)
        seen += [x[0].squeeze(1).long().tolist() for x in steps[-1]]
        weights += loader.step_weights(4)
        assert loader.step_weights(3) is None
    assert seen == [[64, 65], [66, 67], [68], [69]] and weights == [4 / 3, 4 / 3, 2 / 3, 2 / 3]  # size x 4 parts / 6, mean 1
    # 66 samples: the last step has 2, so two of the four parts are a weight-0 copy of its first sample
    loader = ShardedLoader(_dataset(66), global_batch=16, world_size=2, rank=1, accumulate=2, shuffle=False, drop_last=False)
    assert [x[0].squeeze(1).long().tolist() for x in list(loader)[-1]] == [[64], [64]] and loader.step_weights(4) == [0.0, 0.0]
    assert ShardedLoader(_dataset(66), global_batch=16).left_out == 2


def _lin() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2).double()


def _mse(out, batch):
    return (out - batch[1]).pow(2).mean()


def _regression(n: int = 70) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return TensorDataset(x, x @ torch.tensor([[1.0, -1.0], [0.5, 2.0], [0.0, 1.0]], dtype=torch.float64))


def test_drop_last_false_equals_a_loop_over_the_whole_data_set_and_the_first_lines_say_the_batch(tmp_path, capsys, monkeypatch):
    import json
    import sys

    from shardwise import Trainer
    from shardwise.data import epoch_permutation

    model = _lin()
    opt = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    summary = Trainer(
        optimizer=opt, loss_fn=_mse, global_batch_size=16, accumulate=4, max_epochs=2, drop_last=False, out=str(tmp_path), progress_bar=False
    ).fit(model, _regression())
    # by hand: every epoch's order, batches of 16 and a last one of 6, the mean loss of each
    ref = _lin()
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = _regression().tensors
    for epoch in range(2):
        perm = epoch_permutation(70, 0, epoch)
        for start in range(0, 70, 16):
            idx = perm[start : start + 16]
            _mse(ref(x[idx]), (None, y[idx])).backward()
            sgd.step()
            sgd.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    assert summary["steps"] == 10 and summary["samples"] == 140 and summary["samples_left_out_per_epoch"] == 0
    assert json.loads((tmp_path / "summary.json").read_text())["drop_last"] is False
    # the default (drop_last=True), the global batch left unset: both said in the first lines, in summary.json
    # (the bar written where the lines go, to see the order: the whole model table, then the bar)
    capsys.readouterr()
    monkeypatch.setattr(sys, "stderr", sys.stdout)
    summary = Trainer(optimizer=opt, loss_fn=_mse, max_steps=1, progress_bar=True).fit(_lin(), _regression())
    out = capsys.readouterr().out
    assert "shardwise: global batch 32 (the default; set global_batch_size=... or --global-batch-size)" in out
    assert "shardwise: 6 samples of 70 are left out of each epoch (70 % global batch 32); drop_last=False keeps them" in out
    assert out.index("global batch 32") < out.index("module  type") < out.index("parameters per rank after sharding") < out.index("train:")
    assert summary["global_batch_size_from"] == "default" and summary["samples_left_out_per_epoch"] == 6


def test_drop_last_false_is_refused_before_launch_where_it_cannot_be_exact():
    from shardwise import Trainer

    with pytest.raises(ConfigError, match=r"drop_last=False: strategy 'pipeline' cannot take the epoch's smaller last batch exactly"):
        Trainer(strategy="pipeline", nproc=2, loss_fn=_mse, global_batch_size=16, drop_last=False).fit(
            torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)).double(), _regression()
        )
