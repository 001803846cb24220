"""What ``ep`` refuses, in the parent before any process starts, and what its rule finds.

ep not dividing the number of experts, ep not dividing the data-parallel degree, a module that
looks like experts but no rule covers (a hand-written router + ModuleList MoE, stacked experts
behind another forward), a model with no MoE layer, a bad ep value; the rule finds each family's
experts layers by structure (no class names).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardwise import Trainer
from shardwise.errors import ConfigError
from shardwise.strategies.data_parallel.ddp import DDP
from shardwise.strategies.expert_parallel import find_experts
from tests.strategies.expert_parallel import moe_zoo
from tests.support import harness, zoo

pytest.importorskip("transformers")


def _check(model: nn.Module, nproc: int, ep: int) -> None:
    t = Trainer(strategy="ddp", strategy_options={"ep": ep}, nproc=nproc, optimizer=harness.sgd, global_batch_size=12, max_steps=1, progress_bar=False)
    t._check(model, moe_zoo.dataset(16))


class HandMoE(nn.Module):
    """A mixture of experts written by hand: a router Linear and a ModuleList of expert MLPs."""

    def __init__(self, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d, n)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.router(x).softmax(-1)
        return sum(w[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))  # type: ignore[return-value]


class Stacked(nn.Module):
    """Stacked experts (E, out, in) behind a forward that is not transformers' experts interface."""

    def __init__(self, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.zeros(n, 2 * d, d))
        self.w_out = nn.Parameter(torch.zeros(n, d, 2 * d))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        return x


class Wrapped(nn.Module):
    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Embedding(zoo.VOCAB, 8)
        self.block = moe

    def forward(self, input_ids: torch.Tensor, labels: Any = None) -> Any:
        return self.block(self.embed(input_ids).double())


def test_the_rule_finds_every_family_and_nothing_else() -> None:
    for family in moe_zoo.FAMILIES + moe_zoo.MORE:
        covered, uncovered = find_experts(moe_zoo.build(family))
        assert len(covered) == 2 and not uncovered, (family, covered, uncovered)
        assert all(c.num_experts == moe_zoo.EXPERTS and set(c.params) == {"gate_up_proj", "down_proj"} for c in covered)
    assert find_experts(zoo.build("llama", layers=2)) == ([], [])


def test_ep_not_dividing_the_experts_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"ep=3 does not divide the number of experts of 'model.layers.0.mlp.experts' \(4 experts\)"):
        _check(moe_zoo.build("mixtral"), nproc=3, ep=3)


def test_ep_not_dividing_dp_is_refused() -> None:
    with pytest.raises(ConfigError, match="ep=2 does not divide the data-parallel degree 3"):
        _check(moe_zoo.build("olmoe"), nproc=3, ep=2)


def test_moe_looking_modules_no_rule_covers_are_named() -> None:
    with pytest.raises(ConfigError, match=r"'block.experts' \(a ModuleList of 4 experts beside a linear router\)"):
        _check(Wrapped(HandMoE()), nproc=2, ep=2)
    with pytest.raises(ConfigError, match=r"'block' \(Stacked: 4 stacked experts behind forward\('x', 'expert_ids'\)\)"):
        _check(Wrapped(Stacked()), nproc=2, ep=2)


def test_a_model_without_experts_is_refused() -> None:
    with pytest.raises(ConfigError, match="ep=2 needs a mixture-of-experts model, and LlamaForCausalLM has no experts layer"):
        _check(zoo.build("llama", layers=2), nproc=2, ep=2)


def test_bad_ep_values_and_ep_with_cp() -> None:
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="ep must be a whole number >= 1"):
            DDP(ep=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="do not compose yet"):
        DDP(ep=2, cp=2).plan(4, moe_zoo.build("mixtral"))


def test_zero1_refuses_ep_and_names_the_strategies_that_take_it() -> None:
    from shardwise.strategies.sharded.zero1 import Zero1

    with pytest.raises(ConfigError, match="strategy 'zero1' does not support ep=2: .* Use strategy 'ddp', 'zero2', 'zero3' or 'hsdp' with ep"):
        Zero1(ep=2)
    with pytest.raises(ConfigError, match="ep=3 does not divide the number of experts"):
        Trainer(strategy="zero3", strategy_options={"ep": 3}, nproc=3, optimizer=harness.sgd, global_batch_size=12, max_steps=1)._check(
            moe_zoo.build("olmoe"), moe_zoo.dataset(16)
        )
