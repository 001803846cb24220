"""Tensor-parallel plans: automatic discovery across naming conventions, user plans, and the
checks that refuse a split that cannot be exact (no process group needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.strategies.tensor_parallel import TensorParallel, auto_plan, resolve_plan
from shardwise.tools.recipes.charlm import CharGPT
from shardwise.tools.recipes.digits import DigitsMLP


class LlamaAttention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, d // heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)


class LlamaMLP(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, 32), nn.Linear(d, 32), nn.Linear(32, d)


class LlamaLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(16)
        self.self_attn = LlamaAttention()
        self.mlp = LlamaMLP()


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 16)
        self.layers = nn.ModuleList(LlamaLayer() for _ in range(2))
        self.lm_head = nn.Linear(16, 10, bias=False)


class TitanAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads = 2
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(8, 8, bias=False) for _ in range(4))


class TitanFF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(8, 24), nn.Linear(24, 8), nn.Linear(8, 24)


class TitanBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention, self.feed_forward = TitanAttention(), TitanFF()


class Titan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": TitanBlock(), "1": TitanBlock()})


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(6, 32), nn.Linear(32, 6), nn.Linear(6, 3)


class BertSelf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)


class BertAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self = BertSelf()
        self.output = nn.Sequential(nn.Linear(8, 8))  # "output.0": not a name the rules know


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)


def test_charlm_plan_splits_attention_by_heads_and_the_mlp_leaving_embed_and_head_whole():
    plan = auto_plan(CharGPT(11, 8, 16, 2, 2))
    assert plan == {
        f"blocks.{i}.{n}": s
        for i in range(2)
        for n, s in (
            ("attn.q", "colwise"),
            ("attn.k", "colwise"),
            ("attn.v", "colwise"),
            ("attn.proj", "rowwise"),
            ("mlp.fc", "colwise"),
            ("mlp.proj", "rowwise"),
        )
    }
    assert not any(name.startswith(("embed", "head")) for name in plan)


def test_llama_names():
    plan = auto_plan(Llama())
    assert plan == {
        f"layers.{i}.{n}": s
        for i in range(2)
        for n, s in (
            ("self_attn.q_proj", "colwise"),
            ("self_attn.k_proj", "colwise"),
            ("self_attn.v_proj", "colwise"),
            ("self_attn.o_proj", "rowwise"),
            ("mlp.gate_proj", "colwise"),
            ("mlp.up_proj", "colwise"),
            ("mlp.down_proj", "rowwise"),
        )
    }
    assert "lm_head" not in plan


def test_torchtitan_names_in_a_module_dict():
    plan = auto_plan(Titan())
    assert plan["layers.0.attention.wq"] == "colwise" and plan["layers.1.attention.wo"] == "rowwise"
    assert plan["layers.1.feed_forward.w1"] == plan["layers.1.feed_forward.w3"] == "colwise"
    assert plan["layers.1.feed_forward.w2"] == "rowwise"
    assert len(plan) == 14


def test_a_top_level_pair_and_a_lone_linear():
    assert auto_plan(TwoLayer()) == {"fc1": "colwise", "fc2": "rowwise"}  # "out" has no partner here


def test_a_partial_model_keeps_its_names():
    model = CharGPT(11, 8, 16, 2, 4)
    del model.embed, model.head
    model.blocks = nn.ModuleDict({"2": model.blocks[2], "3": model.blocks[3]})  # a pipeline stage's blocks
    plan = auto_plan(model)
    assert sorted({n.rsplit(".", 2)[0] for n in plan}) == ["blocks.2", "blocks.3"]


def test_nothing_to_split_is_a_config_error_with_a_hint():
    with pytest.raises(ConfigError, match=r"found no linear pair to split in BertAttention.*Pass a plan instead"):
        resolve_plan(BertAttention())
    with pytest.raises(ConfigError, match="found no linear pair"):
        resolve_plan(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    """Blocks whose linears no automatic rule knows by name."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.layers, self.out = nn.Linear(4, 8), nn.ModuleList([_Pair(), _Pair()]), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def test_the_hint_names_a_plan_of_the_models_own_layers_that_resolves():
    with pytest.raises(ConfigError, match="found no linear pair") as info:
        resolve_plan(_Stack())
    message = str(info.value)
    assert "strategy_options={'tp_plan': {'layers.*.up': 'colwise', 'layers.*.down': 'rowwise'}}" in message
    assert """--set 'trainer.strategy_options.tp_plan={"layers.*.up" = "colwise", "layers.*.down" = "rowwise"}'""" in message
    assert resolve_plan(_Stack(), {"layers.*.up": "colwise", "layers.*.down": "rowwise"}, 2) == {
        "layers.0.up": "colwise",
        "layers.1.up": "colwise",
        "layers.0.down": "rowwise",
        "layers.1.down": "rowwise",
    }


def test_a_model_with_no_pair_that_splits_alone_gets_the_general_hint():
    # DigitsMLP: every pair leaves the third linear inside the pair's parent (net), so no pair is suggested.
    with pytest.raises(ConfigError, match=r"Pass a plan instead: attention's q, k, v .* No pair of DigitsMLP's own .*data-parallel strategy"):
        resolve_plan(DigitsMLP())


def test_a_fused_qkv_projection_is_refused():
    with pytest.raises(ConfigError, match="qkv is a fused q|k|v projection.*Split it into three linears"):
        auto_plan(Fused())


def test_user_plans_with_patterns():
    plan = resolve_plan(BertAttention(), {"self.[qkv]*": "colwise", "output.0": "rowwise"}, tp=2)
    assert plan == {"self.query": "colwise", "self.key": "colwise", "self.value": "colwise", "output.0": "rowwise"}
    assert resolve_plan(Llama(), {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}) == {
        "layers.0.mlp.up_proj": "colwise",
        "layers.1.mlp.up_proj": "colwise",
        "layers.0.mlp.down_proj": "rowwise",
        "layers.1.mlp.down_proj": "rowwise",
    }


def test_a_plan_naming_a_missing_module_is_a_config_error():
    with pytest.raises(ConfigError, match=r"plan names 'blocks.0.mlp.fc1', which matches no module of CharGPT; close names: \['blocks.0.mlp.fc'"):
        resolve_plan(CharGPT(11, 8, 16, 2, 1), {"blocks.0.mlp.fc1": "colwise"})


def test_a_bad_style_is_a_config_error_before_anything_runs():
    with pytest.raises(ConfigError, match=r"plan\['fc1'\] = 'column' is not a style.*Styles: 'colwise', 'rowwise'"):
        resolve_plan(TwoLayer(), {"fc1": "column"})
    with pytest.raises(ConfigError, match=r"Did you mean 'rowwise'\?"):
        TensorParallel(plan={"fc2": "rowise"})


def test_only_linears_split():
    with pytest.raises(ConfigError, match=r"splits nn.Linear modules \(and Conv1D\); embed_tokens is a Embedding"):
        resolve_plan(Llama(), {"embed_tokens": "colwise"})


def test_heads_must_divide_by_tp():
    resolve_plan(CharGPT(11, 8, 16, 2, 1), tp=2)
    with pytest.raises(ConfigError, match=r"blocks.0.attn.q has 2 attention heads, which do not split across tp=4 ranks.*choose tp in \[1, 2\]"):
        resolve_plan(CharGPT(11, 8, 16, 2, 1), tp=4)
    # Grouped-query attention: 4 query heads but 2 key/value heads (head_dim 4): tp=4 splits q, not k/v.
    with pytest.raises(ConfigError, match="layers.0.self_attn.k_proj has 2 attention heads"):
        resolve_plan(Llama(), tp=4)
    resolve_plan(Llama(), tp=2)
    with pytest.raises(ConfigError, match="layers.0.attention.wq has 2 attention heads"):  # n_heads attribute
        resolve_plan(Titan(), tp=4)


def test_widths_must_divide_by_tp():
    with pytest.raises(ConfigError, match=r"fc1 \(colwise\) has 32 output features, not divisible by tp=3"):
        resolve_plan(TwoLayer(), tp=3)


def test_options_are_checked_in_the_constructor():
    with pytest.raises(ConfigError, match="tp must be a whole number >= 1; got 0"):
        TensorParallel(tp=0)
    with pytest.raises(ConfigError, match="dp_strategy must be 'ddp' or 'fsdp'; got 'fsd'. Did you mean 'fsdp'"):
        TensorParallel(dp_strategy="fsd")
    with pytest.raises(ConfigError, match=r"tp 4 does not divide the world size 6; valid shapes: dp6 x tp1, dp3 x tp2, dp2 x tp3, dp1 x tp6 \(set --tp"):
        TensorParallel(tp=4).plan(6)
    assert TensorParallel().plan(4).degrees == {"dp": 1, "pp": 1, "tp": 4}  # the default degree is the world size
    assert TensorParallel(tp=2, sequence_parallel=True).plan(4).degrees == {"dp": 2, "pp": 1, "tp": 2}


def test_the_options_are_a_frozen_dataclass_with_help_and_fixed_choices():
    import dataclasses
    import typing

    from shardwise.strategies import get_strategy
    from shardwise.strategies.contract import Strategy
    from shardwise.strategies.tensor_parallel import DP_STRATEGIES

    strategy = get_strategy("tp", tp=2, dp_strategy="fsdp")
    assert isinstance(strategy, TensorParallel) and isinstance(strategy, Strategy)
    fields = ["tp", "sequence_parallel", "tp_plan", "dp_strategy", "count_collectives", "check_replicas", "cp", "cp_style"]
    assert [f.name for f in dataclasses.fields(TensorParallel)] == fields
    assert strategy.options() == {
        "tp": 2,
        "sequence_parallel": False,
        "tp_plan": None,
        "dp_strategy": "fsdp",
        "count_collectives": True,
        "check_replicas": False,
        "cp": 1,
        "cp_style": "ring",
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.tp = 4  # type: ignore[misc]
    hints = typing.get_type_hints(TensorParallel)
    assert typing.get_origin(hints["dp_strategy"]) is typing.Literal and typing.get_args(hints["dp_strategy"]) == DP_STRATEGIES
    # Every option has a docstring (its help); the source is the only place it lives.
    import inspect

    source = inspect.getsource(TensorParallel)
    for f in dataclasses.fields(TensorParallel):
        line = next(i for i, text in enumerate(source.splitlines()) if text.strip().startswith(f"{f.name}:"))
        assert source.splitlines()[line + 1].strip().startswith('"""'), f.name
    assert dataclasses.replace(strategy, tp=1).tp == 1  # the generated replace goes through the constructor's checks
    with pytest.raises(ConfigError, match="tp must be a whole number"):
        dataclasses.replace(strategy, tp=-1)


def test_plan_is_the_contract_method_and_the_plan_option_keeps_its_old_name():
    # The option is tp_plan (``plan`` is the contract's method); plan= still names it, as before.
    old, new = TensorParallel(plan={"fc1": "colwise"}), TensorParallel(tp_plan={"fc1": "colwise"})
    assert old == new and old.tp_plan == {"fc1": "colwise"} and callable(old.plan)
    with pytest.raises(ConfigError, match="given twice, as tp_plan and as plan"):
        TensorParallel(plan={"fc1": "colwise"}, tp_plan={"fc1": "colwise"})


def test_plan_settles_the_mesh_and_the_batch_before_launch():
    from shardwise.strategies.contract import Batch

    layout = TensorParallel(tp=2).plan(4, batch=Batch(8, accumulate=2))
    assert (layout.strategy, layout.trainers, layout.data_parallel, layout.micro_batch) == ("tp", 4, 2, 2)
    assert "tp on 4 processes: dp2 x pp1 x tp2 (micro-batch 2)" == layout.describe()
    # tp defaults to the mesh settings' tp, and a conflict with them is refused.
    assert TensorParallel().plan(4, mesh={"tp": 2}).degrees["tp"] == 2
    with pytest.raises(ConfigError, match="strategy 'tp' asks for tp=2 but the mesh settings say tp=4"):
        TensorParallel(tp=2).plan(4, mesh={"tp": 4})
    with pytest.raises(ConfigError, match="strategy 'tp' runs on a dp x tp mesh; got pp=2. Use strategy 'pipeline' with --tp"):
        TensorParallel(tp=2).plan(4, mesh={"pp": 2})
    with pytest.raises(ConfigError, match="global batch"):
        TensorParallel(tp=2).plan(4, batch=Batch(3))  # 3 samples do not split over dp=2


def test_plan_is_pure_no_process_group_and_the_model_untouched():
    import torch.distributed as dist

    model = CharGPT(11, 8, 16, 2, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    TensorParallel(tp=2, sequence_parallel=True).plan(2, model=model)
    assert not dist.is_initialized()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == hooks
    assert not hasattr(model, "_shardwise_tp") and not any(hasattr(p, "_shardwise_tp_sum") for p in model.parameters())


def test_apply_without_a_process_group_is_a_config_error():
    from shardwise.comm.mesh import Mesh
    from shardwise.comm.recorder import Recorder

    with pytest.raises(ConfigError, match="strategy 'tp' needs a process group"):
        TensorParallel().apply(CharGPT(11, 8, 16, 2, 1), lambda p: torch.optim.SGD(p, lr=0.1), Mesh.build(world_size=1), Recorder())


def test_a_plan_from_the_command_line():
    from shardwise.trainer.config import apply_overrides

    for key in ("plan", "tp_plan"):  # the old name and the field's
        sections = apply_overrides({}, [f'trainer.strategy_options.{key}={{"fc1" = "colwise", "fc*2" = "rowwise"}}'])
        strategy = TensorParallel(**sections["trainer"]["strategy_options"])
        assert resolve_plan(TwoLayer(), strategy.tp_plan) == {"fc1": "colwise", "fc2": "rowwise"}
    assert TensorParallel(plan='{"fc1": "colwise"}').tp_plan == {"fc1": "colwise"}  # JSON text
    with pytest.raises(ConfigError, match="or its JSON text; got 'fc1=colwise'"):
        TensorParallel(plan="fc1=colwise")


def test_auto_plan_is_deterministic_and_does_not_touch_the_model():
    model = Llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert auto_plan(model) == auto_plan(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_model_the_plan_does_not_fit_is_refused_in_the_parent_before_launch(monkeypatch):
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from shardwise import Trainer
    from shardwise.trainer import loop

    def no_launch(*args, **kwargs):
        raise AssertionError("launched processes for a model the plan should have refused")

    monkeypatch.setattr(loop, "launch", no_launch)
    ids = torch.randint(0, 11, (16, 9), generator=torch.Generator().manual_seed(0))
    data = TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    trainer = Trainer(
        strategy="tp",
        strategy_options={"tp": 2},
        nproc=2,
        global_batch_size=8,
        max_steps=1,
        progress_bar=False,
        loss_fn=lambda out, batch: F.cross_entropy(out.reshape(-1, out.shape[-1]), batch[1].reshape(-1)),
    )
    with pytest.raises(ConfigError, match=r"blocks.0.attn.q has 3 attention heads, which do not split across tp=2 ranks.*choose tp in \[1, 3\]"):
        trainer.fit(CharGPT(11, 8, 12, 3, 1), data)


def test_the_plan_checks_the_model_at_the_world_size_as_the_default_degree_and_sequence_parallel_blocks():
    strategy = TensorParallel()
    strategy.plan(1, model=TwoLayer())  # tp=1: the plan alone
    with pytest.raises(ConfigError, match=r"fc1 \(colwise\) has 32 output features, not divisible by tp=3"):
        strategy.plan(3, model=TwoLayer())
    with pytest.raises(ConfigError, match="sequence_parallel needs transformer blocks"):
        TensorParallel(tp=2, sequence_parallel=True).plan(2, model=TwoLayer())
    TensorParallel(tp=2, sequence_parallel=True).plan(2, model=CharGPT(11, 8, 16, 2, 1))
    # A stacked q|k|v split by heads is permuted per rank: with FSDP over dp it is refused before launch.
    stacked = nn.Sequential(nn.ModuleList([nn.Module()]))
    stacked[0][0].attn = StackedAttention()
    TensorParallel(tp=2).plan(4, model=stacked)
    with pytest.raises(ConfigError, match="runs with dp_strategy 'ddp' only; got dp_strategy 'fsdp'. Use dp_strategy='ddp'"):
        TensorParallel(tp=2, dp_strategy="fsdp").plan(4, model=stacked)


class StackedAttention(nn.Module):
    """GPT-2's layout: q|k|v stacked in one c_attn, a fixed head width."""

    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, d // heads
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)


# -- real models: declared plans, Conv1D, fused q|k|v, roles and the backstop ---------------------

from shardwise.strategies.tensor_parallel.plan import declared_plan, resolve  # noqa: E402
from shardwise.strategies.tensor_parallel.roles import roles  # noqa: E402
from shardwise.strategies.tensor_parallel.styles import fused_permutation  # noqa: E402


def _zoo(name: str, **kw):  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    from tests.support import zoo

    return zoo.build(name, layers=2, **kw)


def test_a_model_that_declares_its_plan_gets_it():
    model = _zoo("llama")
    plan, grad_sum, source = resolve(model, None, 2)
    assert source == "declared" and not grad_sum
    assert plan["model.layers.1.self_attn.o_proj"] == "rowwise" and plan["model.layers.0.mlp.up_proj"] == "colwise"
    assert "lm_head" not in plan and "model.embed_tokens" not in plan  # embeddings and head stay whole


def test_grouped_query_kv_heads_must_divide_by_tp():
    model = _zoo("llama")  # 4 query heads, 2 key/value heads
    resolve(model, None, 2)
    with pytest.raises(ConfigError, match=r"model.layers.0.self_attn.k_proj has 2 attention heads, which do not split across tp=4 ranks.*key/value heads"):
        resolve(model, None, 4)


def test_a_declared_per_head_norm_has_its_gradient_summed_and_unknown_declared_styles_are_refused():
    tf = pytest.importorskip("transformers")
    cfg = tf.Qwen3Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=16,
    )
    model = tf.Qwen3ForCausalLM(cfg)
    plan, grad_sum, _ = resolve(model, None, 2)
    assert grad_sum == ["model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.k_norm"]
    assert roles(model, plan, grad_sum, False)["sum"] == ["model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"]
    model._tp_plan = {"model.layers.*.mlp": "moe_identity_expert"}  # identity experts: not translated
    with pytest.raises(ConfigError, match=r"style 'moe_identity_expert' for 'model.layers.\*.mlp'.*Nearest working setting: pass tp_plan"):
        declared_plan(model)
    model._tp_plan = {"model.layers.*.self_attn": "made_up"}
    with pytest.raises(ConfigError, match="style 'made_up' .*a style shardwise does not know"):
        declared_plan(model)


def test_gpt2_conv1d_and_its_stacked_c_attn_split_by_heads():
    model = _zoo("gpt2")
    plan, _, source = resolve(model, None, 2)
    assert source == "auto"
    assert plan == {
        f"transformer.h.{i}.{n}": s
        for i in range(2)
        for n, s in (("attn.c_attn", "colwise"), ("attn.c_proj", "rowwise"), ("mlp.c_fc", "colwise"), ("mlp.c_proj", "rowwise"))
    }
    with pytest.raises(ConfigError, match=r"transformer.h.0.attn.c_attn has 4 attention heads, which do not split across tp=8"):
        resolve(model, None, 8)


def test_the_fused_permutation_gives_each_rank_its_heads_q_k_and_v():
    # 3 blocks (q, k, v) of 8 features, 2 ranks: rank 0 holds q[0:4], k[0:4], v[0:4].
    perm = fused_permutation(8, 3, 2)
    assert perm.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    assert torch.equal(torch.argsort(perm)[perm], torch.arange(24))


def test_norms_are_chosen_by_their_place_in_the_block_not_their_class():
    model = _zoo("nanogpt")  # its LayerNorm is its own class, not nn.LayerNorm
    plan, grad_sum, _ = resolve(model, None, 2)
    r = roles(model, plan, grad_sum, True)
    assert r["blocks"] == ["transformer.h.0", "transformer.h.1"]
    assert r["sum"] == [f"transformer.h.{i}.ln_{j}.{p}" for i in range(2) for j in (1, 2) for p in ("weight", "bias")]
    assert r["whole"] == ["transformer.h.0.attn", "transformer.h.1.attn"]  # c // n_head: cannot run on local heads
    assert roles(model, plan, grad_sum, False)["sum"] == []  # without sequence parallelism the norms see whole activations
    llama = _zoo("llama")
    plan, grad_sum, _ = resolve(llama, None, 2)
    assert roles(llama, plan, grad_sum, True)["sum"] == [
        f"model.layers.{i}.{n}.weight" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")
    ]


class ScaledAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = 4
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(8, 8) for _ in range(4))
        self.temperature = nn.Parameter(torch.ones(3))  # not one per head (2 heads; those split with them): no rule


class PositionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = LlamaAttention(8, 2, 2)
        self.register_buffer("positions", torch.arange(4))


def test_the_backstop_names_a_module_no_rule_covers():
    model = nn.Sequential(nn.ModuleList([nn.Module()]))
    model[0][0].attn = ScaledAttention()
    plan = resolve_plan(model, tp=2)
    with pytest.raises(ConfigError, match=r"0.0.attn \(ScaledAttention\) holds parameters \['temperature'\] of its own next to its split linears"):
        roles(model, plan, [], False)
    with pytest.raises(ConfigError, match=r"0.0.attn \(ScaledAttention\) holds parameters"):
        TensorParallel(tp=2).plan(2, model=model)
    blocks = nn.Sequential(nn.ModuleList([PositionBlock()]))
    plan = resolve_plan(blocks, tp=2)
    roles(blocks, plan, [], False)  # without sequence parallelism a block's buffer sees the whole sequence
    with pytest.raises(ConfigError, match=r"0.0 \(PositionBlock\) holds buffers \['positions'\] inside block 0.0.*Turn sequence_parallel off"):
        TensorParallel(tp=2, sequence_parallel=True).plan(2, model=blocks)


def test_a_fused_projection_of_unknown_layout_is_still_refused():
    with pytest.raises(ConfigError, match="qkv is a fused q|k|v projection whose layout"):
        auto_plan(Fused())


def test_other_families_get_a_plan_or_a_true_refusal():
    tf = pytest.importorskip("transformers")
    opt = tf.OPTForCausalLM(
        tf.OPTConfig(vocab_size=32, hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=16)
    )
    plan, grad_sum, source = resolve(opt, None, 2)
    assert source == "auto" and plan["model.decoder.layers.0.fc1"] == "colwise" and plan["model.decoder.layers.0.fc2"] == "rowwise"
    # fc1 sits in the decoder layer next to the norms: it is its own sublayer, and the norms are the layer's.
    assert roles(opt, plan, grad_sum, True)["sum"] == [
        f"model.decoder.layers.0.{n}.{p}" for n in ("self_attn_layer_norm", "final_layer_norm") for p in ("weight", "bias")
    ]
    neox = tf.GPTNeoXForCausalLM(
        tf.GPTNeoXConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16)
    )
    assert resolve(neox, None, 2)[2] == "declared"  # its fused query_key_value is per-head interleaved: colwise gives whole heads
    falcon = tf.FalconForCausalLM(tf.FalconConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ConfigError, match="query_key_value is a fused q|k|v projection whose layout"):
        resolve(falcon, None, 2)
    t5 = tf.T5EncoderModel(tf.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    with pytest.raises(ConfigError, match=r"SelfAttention.relative_attention_bias \(Embedding\) holds parameters"):
        TensorParallel(tp=2).plan(2, model=t5)


def test_a_gathered_sequence_with_a_non_contiguous_local_tensor_is_made_dense_keeping_values_and_gradient(tmp_path) -> None:
    """torch <= 2.12 gathers an uneven sequence shard by padding and narrowing: a non-contiguous local
    view that a linear's ``view`` then refuses. ``_dense`` copies such a tensor, placements kept."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from shardwise.strategies.tensor_parallel.apply import _dense

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        base = torch.randn(2, 8, 4, dtype=torch.float64, requires_grad=True)
        narrowed = DTensor.from_local(base[:, :7], mesh, (Replicate(),), run_check=False)
        assert not narrowed.to_local().is_contiguous()
        dense = _dense(narrowed)
        assert dense.to_local().is_contiguous() and dense.placements == (Replicate(),)
        assert torch.equal(dense.to_local(), base[:, :7].detach())
        (dense.to_local() * torch.arange(7, dtype=torch.float64).view(1, 7, 1)).sum().backward()
        expected = torch.zeros_like(base)
        expected[:, :7] = torch.arange(7, dtype=torch.float64).view(1, 7, 1)
        assert torch.equal(base.grad, expected)
        already = DTensor.from_local(torch.randn(2, 7, 4), mesh, (Replicate(),), run_check=False)
        assert _dense(already) is already  # contiguous (torch 2.13 on): no copy
    finally:
        dist.destroy_process_group()
