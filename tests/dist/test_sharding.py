"""Sharded data parallel (zero1, zero2, zero3, hsdp) equals the single-process reference, and
each rank's model-state bytes equal the ZeRO formula for its stage.

One launch per world size runs every fit of that size (a process start costs ~2.5 s here):
the Trainer, started inside a launched worker, joins the existing process group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Trainer, launch
from shardwise.errors import ConfigError
from shardwise.plan.memory import model_state_bytes, plain
from tests.dist.models import accuracy, adam, ce, classification, max_diff, mlp, params, sgd

COMMON = dict(precision="64", global_batch_size=16, accumulate=2, max_steps=10, log_every=5, progress_bar=False, clip_grad_norm=0.05)
OPTIMIZERS = {"adam": adam, "sgd": sgd}
VAL = 37  # an odd number of validation samples: ranks get shards of unequal size


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters on every rank, whatever the strategy left in the module (DTensor shards or tensors)."""
    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def _fit(strategy: str, optimizer: str, **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model = mlp()
    trainer = Trainer(strategy=strategy, optimizer=OPTIMIZERS[optimizer], loss_fn=ce, metrics={"accuracy": accuracy},
                      strategy_options=options, **COMMON)
    summary = trainer.fit(model, classification(), classification(n=VAL, seed=5))
    return _full_params(model), summary


class Blocks(nn.Module):
    """Eight 8x8 blocks: every tensor splits evenly on dim 0 across 2 and 4 ranks (FSDP2), and
    whole tensors split evenly across ranks too (zero1's ZeroRedundancyOptimizer assigns tensors)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x  # 8 logits; labels are 0..2


def eight_features(n: int = 96) -> TensorDataset:
    x, y = classification(n).tensors
    return TensorDataset(torch.cat([x, x[:, :2] ** 2], dim=1), y)


def _memory(strategy: str, optimizer: str, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's memory section, measured on a model whose tensors split evenly."""
    model = Blocks().double()
    trainer = Trainer(strategy=strategy, optimizer=OPTIMIZERS[optimizer], loss_fn=ce, strategy_options=options,
                      **{**COMMON, "max_steps": 2, "clip_grad_norm": None})
    summary = trainer.fit(model, eight_features())
    psi = sum(p.numel() for p in Blocks().parameters())
    return summary["memory_per_rank"], {"psi": psi, "fsdp": summary.get("fsdp")}


def _world_of_two() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in ("zero1", "zero2", "zero3"):
        for opt in OPTIMIZERS:
            out[(strategy, opt)] = _fit(strategy, opt)
    for strategy in ("zero1", "zero2", "zero3"):
        for opt in OPTIMIZERS:
            out[("memory", strategy, opt)] = _memory(strategy, opt)
    for strategy in ("zero2", "zero3"):  # CPUOffloadPolicy without pinned memory (no CUDA here)
        out[("offload", strategy)] = _fit(strategy, "adam", offload=True)
    return out


def _world_of_four() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        out[("hsdp", opt)] = _fit("hsdp", opt)  # default shape at 4: replicate 2 x shard 2
    for strategy in ("zero1", "zero2", "zero3"):
        out[("memory", strategy, "adam")] = _memory(strategy, "adam")
    out[("memory", "hsdp", "adam")] = _memory("hsdp", "adam")
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    return {opt: _fit("single", opt) for opt in OPTIMIZERS}


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return launch(_world_of_two, nproc=2, threads_per_proc=1)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return launch(_world_of_four, nproc=4, threads_per_proc=1)  # type: ignore[no-any-return]


def _check_parity(result: tuple[dict[str, torch.Tensor], dict[str, Any]], ref: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> None:
    got, summary = result
    want, ref_summary = ref
    assert max_diff(want, got) < 1e-9
    assert abs(summary["train_loss"] - ref_summary["train_loss"]) < 1e-9
    # Evaluation: every rank made the same number of (collective) forward calls, each sample counted once.
    assert summary["val_samples"] == VAL
    assert summary["val_loss"] == pytest.approx(ref_summary["val_loss"], abs=1e-9)
    assert summary["val_accuracy"] == pytest.approx(ref_summary["val_accuracy"], abs=1e-12)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_stage_equals_single_at_world_size_two(strategy, opt, two, reference):
    for rank in range(2):  # every rank ends with the same whole parameters
        _check_parity(two[rank][(strategy, opt)], reference[opt])
    assert two[0][(strategy, opt)][1]["steps"] == 10
    # That the clip is active in these runs (a reference without it differs) is
    # test_clipping_matters_in_the_parity_runs; that it clips by the global norm, the hand loop of
    # tests/unit/test_maths_single.py.


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_hsdp_two_by_two_equals_single(opt, four, reference):
    for rank in range(4):
        _check_parity(four[rank][("hsdp", opt)], reference[opt])
    assert four[0][("hsdp", opt)][1]["fsdp"]["replicate"] == 2 and four[0][("hsdp", opt)][1]["fsdp"]["shard"] == 2


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_offload_to_cpu_trains_the_same(strategy, two, reference):
    for rank in range(2):
        _check_parity(two[rank][("offload", strategy)], reference["adam"])
    assert two[0][("offload", strategy)][1]["fsdp"]["offload"] is True


def test_clipping_matters_in_the_parity_runs():
    model = mlp()
    Trainer(strategy="single", optimizer=adam, loss_fn=ce, **{**COMMON, "clip_grad_norm": None}).fit(model, classification())
    clipped = _fit("single", "adam")[0]
    assert max_diff(params(model), clipped) > 1e-4


def _expected(strategy: str, psi: int, world: int, slots: int) -> dict[str, float]:
    stage = {"zero1": 1, "zero2": 2, "zero3": 3, "hsdp": 3}[strategy]
    shard = world // 2 if strategy == "hsdp" else world
    # zero2 steps FSDP2's shards, a copy apart from the gathered compute parameters: a master copy.
    return model_state_bytes(stage, psi, shard, plain(8, slots, master_copy=strategy == "zero2"))


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_measured_bytes_equal_the_formula_at_world_size_two(strategy, two):
    for rank in range(2):
        for opt, slots in (("adam", 2), ("sgd", 1)):
            section, info = two[rank][("memory", strategy, opt)]
            expected = _expected(strategy, info["psi"], 2, slots)
            for cat in ("params", "grads", "optimizer", "total"):
                assert section[cat]["measured"] == expected[cat], (strategy, opt, rank, cat, section[cat], expected[cat])
                assert section[cat]["ratio"] == 1.0


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "hsdp"])
def test_measured_bytes_equal_the_formula_at_world_size_four(strategy, four):
    for rank in range(4):
        section, info = four[rank][("memory", strategy, "adam")]
        expected = _expected(strategy, info["psi"], 4, 2)
        for cat in ("params", "grads", "optimizer", "total"):
            assert section[cat]["measured"] == expected[cat], (strategy, rank, cat, section[cat], expected[cat])
    # Stage 3 holds a quarter of stage 0's bytes at world size 4 (16 Psi -> 4 Psi bytes of fp64 Adam x 1/4 ...).
    z3 = four[0][("memory", "zero3", "adam")][0]["total"]["measured"]
    z1 = four[0][("memory", "zero1", "adam")][0]["total"]["measured"]
    psi = four[0][("memory", "zero3", "adam")][1]["psi"]
    assert z3 == 32 * psi / 4 and z1 == 8 * psi * 2 + 16 * psi / 4


# -- bad inputs: clear errors before training starts -------------------------------------------


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.lin.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)  # type: ignore[no-any-return]


def test_a_stage_on_a_model_without_trainable_parameters_is_a_config_error():
    with pytest.raises(ConfigError, match=r"strategy 'zero3' shards .* has no trainable parameters \(21 parameters, none with requires_grad\)"):
        Trainer(strategy="zero3", nproc=1, loss_fn=ce, max_steps=1, progress_bar=False).fit(Frozen(), classification())
    with pytest.raises(ConfigError, match="has no parameters; there is nothing to train"):
        Trainer(strategy="zero2", nproc=1, loss_fn=ce, max_steps=1, progress_bar=False).fit(nn.Tanh(), classification())


def test_offload_with_a_strategy_that_cannot_is_a_config_error():
    with pytest.raises(ConfigError, match="strategy 'zero1' does not support offload=True.*Use strategy 'zero2', 'zero3' or 'hsdp'"):
        Trainer(strategy="zero1", nproc=2, strategy_options={"offload": True}, loss_fn=ce).fit(mlp(), classification())
    with pytest.raises(ConfigError, match="bad options for strategy 'ddp'.*offload"):
        Trainer(strategy="ddp", nproc=2, strategy_options={"offload": True}, loss_fn=ce).fit(mlp(), classification())


def test_an_hsdp_shape_that_does_not_divide_the_world_size_is_a_config_error():
    with pytest.raises(ConfigError, match=r"hsdp shape replicate=3 x shard=None does not divide the world size 4; choose replicate x shard = 4 \(one of 1x4, 2x2, 4x1\)"):
        Trainer(strategy="hsdp", nproc=4, strategy_options={"replicate": 3}, loss_fn=ce).fit(mlp(), classification())
    with pytest.raises(ConfigError, match="replicate=2 x shard=2 does not divide the world size 2"):
        Trainer(strategy="hsdp", nproc=2, strategy_options={"replicate": 2, "shard": 2}, loss_fn=ce).fit(mlp(), classification())
