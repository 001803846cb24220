"""Magnitude pruning (`shardwise.tools.compress.prune`): exact sparsity, the right weights, masks kept while training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.tools.compress.prune import ModelPruning, make_permanent, masks, prune_to, sparse_bytes, sparsity_of
from shardwise.tools.recipes.charlm import CharGPT
from shardwise.tools.recipes.digits import DigitsMLP


def _mlp() -> DigitsMLP:
    torch.manual_seed(0)
    return DigitsMLP(hidden=128)


def _linear_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight.detach().clone() for m in model.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.9])
def test_global_unstructured_masks_exactly_the_smallest(sparsity):
    model = _mlp()
    before = torch.cat([w.flatten() for w in _linear_weights(model)])
    prune_to(model, sparsity)
    make_permanent(model)
    after = torch.cat([w.flatten() for w in _linear_weights(model)])
    n = 64 * 128 + 128 * 128 + 128 * 10  # by hand: the three Linear weights
    assert before.numel() == n and int((after == 0).sum()) == round(sparsity * n)
    if sparsity:
        # Every removed weight is no larger in magnitude than every kept one; kept ones are untouched.
        assert before[after == 0].abs().max() <= before[after != 0].abs().min()
        assert torch.equal(after[after != 0], before[after != 0])
    assert sparsity_of(model)["zeros"] == round(sparsity * n)
    assert not masks(model) and all(not k.endswith("_orig") for k in model.state_dict())  # permanent: plain weights


def test_iterative_rounds_equal_one_shot_without_training():
    a, b = _mlp(), _mlp()
    prune_to(a, 0.5)
    for s in (0.2, 0.35, 0.5):
        prune_to(b, s)
    assert all(torch.equal(masks(a)[k], masks(b)[k]) for k in masks(a))


def test_structured_removes_the_lowest_norm_rows_and_their_biases():
    model = _mlp()
    w0 = model.net[0].weight.detach().clone()
    prune_to(model, 0.5, structured=True)
    make_permanent(model)
    for i in (0, 3):
        layer = model.net[i]
        dead = (layer.weight == 0).all(dim=1)
        assert int(dead.sum()) == 64  # 0.5 x 128 output channels
        assert torch.all(layer.bias[dead] == 0) and not torch.any((layer.weight[~dead] == 0).all(dim=1))
    assert int((model.net[6].weight == 0).sum()) == 0  # the class layer is left whole
    expected = set(torch.argsort(w0.norm(dim=1))[:64].tolist())  # by hand: the 64 smallest row norms
    assert set(torch.nonzero((model.net[0].weight == 0).all(dim=1)).flatten().tolist()) == expected


def test_structured_prunes_attention_heads_whole():
    torch.manual_seed(0)
    model = CharGPT(30, block_size=8, d_model=32, n_heads=4, n_layers=2)
    prune_to(model, 0.5, structured=True)
    make_permanent(model)
    for block in model.blocks:
        dead_heads = [h for h in range(4) if all(torch.all(lin.weight[8 * h : 8 * h + 8] == 0) for lin in (block.attn.q, block.attn.k, block.attn.v))]
        assert len(dead_heads) == 2  # 0.5 x 4 heads, each its 8 rows in q, k and v
        rows_zero = sum(int((lin.weight == 0).all(dim=1).sum()) for lin in (block.attn.q, block.attn.k, block.attn.v))
        assert rows_zero == 3 * 16
        assert int((block.mlp.fc.weight == 0).all(dim=1).sum()) == 64  # 0.5 x 128 hidden channels
    assert int((model.head.out.weight == 0).sum()) == 0


def test_sparse_storage_is_smaller_when_sparse_enough():
    model = _mlp()
    prune_to(model, 0.9)
    make_permanent(model)
    dense = sum(w.numel() * 4 for w in _linear_weights(model))
    kept = sum(int((w != 0).sum()) for w in _linear_weights(model))
    # CSR with int32 indices: 8 bytes per kept weight and 4 per row, against 4 bytes per weight dense.
    from shardwise.tools.compress.measure import saved_bytes

    assert saved_bytes(model.state_dict()) - sparse_bytes(model) == pytest.approx(dense - 8 * kept - 4 * (129 + 129 + 11), abs=2000)


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, "half", True])
def test_sparsity_outside_0_1_is_refused(bad):
    with pytest.raises(ConfigError, match=r"sparsity must be a fraction in \[0, 1\)"):
        prune_to(_mlp(), bad)
    with pytest.raises(ConfigError, match="sparsity must be"):
        ModelPruning(bad)


def _ce(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(output, batch[1])


def test_model_pruning_callback_keeps_masks_while_training():
    from torch.utils.data import TensorDataset

    from shardwise.trainer.loop import Trainer

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
    model = DigitsMLP(hidden=32)
    pruning = ModelPruning(0.6, at_steps=(1, 4))
    trainer = Trainer(max_steps=8, global_batch_size=32, progress_bar=False, model_summary=False, callbacks=[pruning], loss_fn=_ce)
    summary = trainer.fit(model, data)
    n = 64 * 32 + 32 * 32 + 32 * 10
    # Pruned at 30% before step 1, 60% before step 4, trained 8 steps: the zeros stay zeros.
    assert sparsity_of(model)["zeros"] == round(0.6 * n)
    assert [r["target"] for r in summary["pruning"]["rounds"]] == pytest.approx([0.3, 0.6])
    assert not masks(model) and sorted(model.state_dict()) == sorted(DigitsMLP(hidden=32).state_dict())


def test_a_model_without_linear_layers_is_refused_before_any_process_starts(monkeypatch):
    from torch.utils.data import TensorDataset

    import shardwise.launcher.spawn as spawn
    from shardwise import Trainer

    def no_launch(*args, **kwargs):
        raise AssertionError("processes were started for a model ModelPruning cannot prune")

    monkeypatch.setattr(spawn, "_spawn", no_launch)
    conv = nn.Sequential(nn.Conv1d(1, 2, 3), nn.Flatten())
    data = TensorDataset(torch.randn(8, 1, 5), torch.zeros(8, 6))
    trainer = Trainer(nproc=2, strategy="ddp", global_batch_size=4, max_steps=2, loss_fn=lambda out, batch: out.sum(), callbacks=[ModelPruning(0.5)])
    with pytest.raises(ConfigError, match="Sequential has no nn.Linear layer to prune"):
        trainer.fit(conv, data)
