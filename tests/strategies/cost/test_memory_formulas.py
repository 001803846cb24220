"""The ZeRO memory formulas (shardwise.strategies.cost.memory) and automatic wrapping, without a process group."""

from __future__ import annotations

import pytest
from torch import nn

from shardwise.strategies.cost.memory import MIXED_ADAM, compare, format_table, model_state_bytes, per_shard_numel, plain, sharded_categories


def test_the_papers_figure_one_numbers():
    # Rajbhandari et al. 2020, figure 1: Psi = 7.5B, N = 64, K = 12, mixed precision.
    psi, n = 7.5e9, 64
    totals = [model_state_bytes(stage, psi, n, MIXED_ADAM)["total"] / 1e9 for stage in range(4)]
    assert totals[0] == pytest.approx(120.0)
    assert totals[1] == pytest.approx(31.4, abs=0.05)
    assert totals[2] == pytest.approx(16.6, abs=0.05)
    assert totals[3] == pytest.approx(1.88, abs=0.005)


def test_each_stage_is_the_papers_formula_term_by_term():
    psi, n, k = 1000.0, 8, 12
    assert model_state_bytes(0, psi, n)["total"] == (2 + 2 + k) * psi
    assert model_state_bytes(1, psi, n)["total"] == 4 * psi + k * psi / n
    assert model_state_bytes(2, psi, n)["total"] == 2 * psi + (2 + k) * psi / n
    assert model_state_bytes(3, psi, n)["total"] == (2 + 2 + k) * psi / n
    by_cat = model_state_bytes(2, psi, n)
    assert (by_cat["params"], by_cat["grads"], by_cat["optimizer"]) == (2 * psi, 2 * psi / n, k * psi / n)


def test_the_fp32_variant():
    psi, n = 1000.0, 4
    adam = plain(4, optimizer_slots=2)
    assert (adam.params, adam.grads, adam.optimizer) == (4, 4, 8)
    assert model_state_bytes(0, psi, n, adam)["total"] == 16 * psi
    assert model_state_bytes(1, psi, n, adam)["total"] == 8 * psi + 8 * psi / n
    assert model_state_bytes(2, psi, n, adam)["total"] == 4 * psi + 12 * psi / n
    assert model_state_bytes(3, psi, n, adam)["total"] == 16 * psi / n
    # A separate master shard (zero2 on FSDP2) is 4 more bytes of K; SGD with momentum has one slot.
    assert plain(4, 2, master_copy=True).optimizer == 12
    assert plain(4, 1).optimizer == 4 and plain(8, 0).optimizer == 0
    with pytest.raises(ValueError):
        plain(0)


def test_one_process_is_the_baseline_for_every_stage():
    for stage in range(4):
        assert model_state_bytes(stage, 123, 1, MIXED_ADAM) == model_state_bytes(0, 123, 1, MIXED_ADAM)


def test_which_categories_each_stage_shards_and_bad_arguments():
    assert sharded_categories(0) == {"params": False, "grads": False, "optimizer": False}
    assert sharded_categories(1) == {"params": False, "grads": False, "optimizer": True}
    assert sharded_categories(2) == {"params": False, "grads": True, "optimizer": True}
    assert sharded_categories(3) == {"params": True, "grads": True, "optimizer": True}
    for bad in (lambda: sharded_categories(4), lambda: model_state_bytes(1, -1, 2), lambda: model_state_bytes(1, 10, 0)):
        with pytest.raises(ValueError):
            bad()


def test_chunked_shards_of_uneven_shapes():
    assert per_shard_numel((8, 8), 4) == [16, 16, 16, 16]
    assert per_shard_numel((10, 3), 4) == [9, 9, 9, 3]
    assert per_shard_numel((3,), 4) == [1, 1, 1, 0]
    assert sum(per_shard_numel((1023, 7), 8)) == 1023 * 7


def test_compare_and_the_printed_table():
    predicted = model_state_bytes(3, 100, 2, plain(4, 2))
    section = compare({"params": 200, "grads": 200, "optimizer": 440}, predicted)
    assert section["params"] == {"measured": 200.0, "predicted": 200.0, "ratio": 1.0}
    assert section["optimizer"]["ratio"] == pytest.approx(1.1)
    assert section["total"]["measured"] == 840.0 and section["total"]["predicted"] == 800.0
    assert compare({"params": 0, "grads": 0, "optimizer": 0}, model_state_bytes(3, 0, 2))["total"]["ratio"] == 1.0
    table = format_table({"strategy": "zero3", "stage": 3, "shard_degree": 2, **section})
    lines = table.splitlines()
    assert lines[0] == "model state per rank (zero3, ZeRO stage 3, shard degree 2)"
    assert lines[2].split() == ["params", "200", "B", "200", "B", "1.000"]
    assert lines[-1].split()[-1] == "1.050"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


class _Transformerish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(4, 10)


class _Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))


def test_automatic_wrapping_is_per_block_or_per_large_child():
    from shardwise.errors import ConfigError
    from shardwise.strategies.sharded.fsdp import auto_wrap_units, resolve_units

    # one unit per block, and the untied embedding and head (their own large weights, outside the block list)
    assert auto_wrap_units(_Transformerish()) == ["layers.0", "layers.1", "layers.2", "embed", "head"]
    # No list of blocks: the large children, looking through the single container ``net``;
    # the 258-parameter head is under 5% of 25,090 and stays with the root.
    assert auto_wrap_units(_Wrapped()) == ["net.0", "net.2"]
    assert resolve_units(_Wrapped(), "root") == []
    assert resolve_units(_Transformerish(), ["_Block"]) == ["layers.0", "layers.1", "layers.2"]
    assert resolve_units(_Transformerish(), ["head", "embed"]) == ["embed", "head"]
    with pytest.raises(ConfigError, match=r"\['nope'\] match no submodule name or class of _Transformerish"):
        resolve_units(_Transformerish(), ["nope"])
