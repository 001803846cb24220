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
from shardwise.strategies.expert_parallel import dispatch, find_experts
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
    needs = r"ep needs forward\(hidden_states, top_k_index, top_k_weights\) -> \[T, H\]: three tensors, hidden rows \[T, H\]"
    with pytest.raises(ConfigError, match=r"'block' \(Stacked: 4 stacked experts behind forward\('x', 'expert_ids'\); " + needs):
        _check(Wrapped(Stacked()), nproc=2, ep=2)


def test_three_positional_arguments_are_taken_under_any_names_and_their_shapes_checked() -> None:
    covered, uncovered = find_experts(moe_zoo.build("mixtral_renamed"))
    assert [c.name for c in covered] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"] and not uncovered
    covered, uncovered = find_experts(moe_zoo.build("gpt_oss"))  # (hidden_states, router_indices=None, routing_weights=None)
    assert len(covered) == 2 and not uncovered and set(covered[0].params) == {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
    x, idx, w = torch.zeros(6, 8, dtype=torch.float64), torch.zeros(6, 2, dtype=torch.long), torch.ones(6, 2, dtype=torch.float64)
    dispatch.check_call("e", x, idx, w)
    for bad in ((x[None], idx, w), (x, idx.double(), w), (x, idx, w[:, :1]), (x, idx[:5], w[:5])):
        with pytest.raises(ConfigError, match=r"ep: the experts layer 'e' was called with \(.*\); ep needs forward\(hidden_states, top_k_index"):
            dispatch.check_call("e", *bad)


def test_a_library_experts_class_of_another_interface_gets_the_nearest_working_setting() -> None:
    from tests.strategies.tensor_parallel import families

    with pytest.raises(ConfigError) as info:
        _check(families.build("llama4"), nproc=2, ep=2)
    msg = str(info.value)
    assert "'model.layers.0.feed_forward.experts', 'model.layers.1.feed_forward.experts' (Llama4TextExperts, transformers' own class" in msg
    assert "each expert runs on every token" in msg and "strategy 'tp' with ep=1" in msg and "'zero3' with ep=1" in msg
    assert "write the experts" not in msg and "give your experts module" not in msg


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


def test_strategies_without_ep_or_cp_say_why_and_what_takes_them() -> None:
    from shardwise.strategies import get_strategy
    from shardwise.strategies.options import resolve

    for strategy, option in (("pipeline", "ep"), ("pipeline", "cp"), ("tp", "ep"), ("local-sgd", "ep"), ("diloco", "cp")):
        why = rf"does not compose with strategy '{strategy}' yet: {option} runs on strategies 'ddp', .*; or drop {option}; its options are"
        with pytest.raises(ConfigError, match=rf"strategy '{strategy}' has no option '{option}': .* " + why):
            get_strategy(strategy, **{option: 2})
    cp = r"has no option 'cp': context parallelism \(cp\) does not compose .* 'hsdp' and 'tp'; or drop cp \(in trainer.strategy_options\)"
    with pytest.raises(ConfigError, match=cp):
        resolve("pipeline", {"cp": 2})
    ep = r"--ep is an option of .*; strategy 'pipeline' does not take it: expert parallelism \(ep\) does not compose .*under 'tp' with ep=1"
    with pytest.raises(ConfigError, match=ep):
        resolve("pipeline", {"ep": 2}, flags=["ep"])
    with pytest.raises(ConfigError, match=r"strategy 'ddp' has no option 'epp' \(did you mean 'ep'\?\); its options are"):
        get_strategy("ddp", epp=2)
