"""Every tensor-parallel style transformers declares: translated and exact, or refused before launch.

One 2-process launch trains the families that declare the newer styles (tests/strategies/tensor_parallel/
families.py: 2 layers, hidden 16, float64, 5 SGD steps with a clip that acts) under tp=2 with
``check_replicas`` on, against ``single`` within 1e-9: MoE experts (``moe_tp_experts`` with
``packed_colwise`` gate|up and ``rowwise`` down on Mixtral, Qwen2-MoE, OLMoE, GraniteMoE; ``packed_rowwise``
and 3-D ``colwise`` on Llama 4), multi-head latent attention (``mla_kv_a_proj``, DeepSeek-V2 with its
shared experts), the gathered pair (``colwise_gather_output`` + ``rowwise_split_input``: Phi-3's fused
q|k|v and gate|up, OLMo-2's whole-width q/k norms) and a user plan with ``packed_colwise`` (GLM-4). The
consolidated state is compared with single's, so the packed weights come back in their original layout.
Fused q|k|v of the per-head layouts (BLOOM with ALiBi, Falcon) split by heads with no declared plan, and
Gemma 3n (per-layer inputs; activation sparsity, a statistic over the MLP's hidden units, was 8.8e-4 off
single before its MLP was gathered) join the launch.
The refusals (a user's column split of a fused projection, patterns across dots, shapes that cannot
pair, sequence parallelism with the styles that take whole inputs) need no launch.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from typing import Any

import pytest

from shardwise.errors import ConfigError
from shardwise.strategies.tensor_parallel import check_model_fits, resolve
from shardwise.strategies.tensor_parallel.plan import _HF_GRAD_SUM, _HF_MODULE_STYLES, _HF_PARAM_STYLES, _HF_REFUSED, _HF_SKIPPED
from tests.strategies.tensor_parallel import families
from tests.support import harness, zoo

pytest.importorskip("transformers")

TP = {"tp": 2, "check_replicas": True}
GLM4_PACKED = {
    "model.layers.*.self_attn.[qkv]_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_up_proj": "packed_colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
CELLS: list[tuple[str, str, dict[str, Any]]] = [
    ("mixtral", "tp", TP),
    ("qwen2_moe", "tp", TP),
    ("olmoe", "tp", TP),
    ("granitemoe", "tp", TP),
    ("llama4", "tp", TP),
    ("deepseek_v2", "tp", TP),
    ("phi3", "tp", TP),
    ("olmo2", "tp", TP),
    ("glm4", "tp", {**TP, "tp_plan": GLM4_PACKED}),
    ("bloom", "tp", TP),
    ("falcon", "tp", TP),
    ("falcon_new", "tp", TP),
    ("gemma3n", "tp", TP),
    ("apertus", "tp", TP),
    ("gpt_oss", "tp", TP),
    ("lfm2", "tp", TP),
    ("codegen", "tp", TP),
]
STYLE_SEEN = {
    "mixtral": "moe_tp_experts",
    "qwen2_moe": "moe_tp_experts",
    "olmoe": "rowwise_split_input",
    "granitemoe": "moe_tp_experts",
    "llama4": "moe_tp_experts",
    "deepseek_v2": "mla_kv_a_proj",
    "phi3": "colwise_gather_output",
    "olmo2": "rowwise_split_input",
    "glm4": "packed_colwise",
    "bloom": "colwise",  # query_key_value, interleaved per head, split by heads (ALiBi sliced to the rank's heads)
    "falcon": "colwise",
    "falcon_new": "colwise",  # grouped per key/value head
    "apertus": "colwise",  # XIELU's scalar alphas inside the MLP: their gradients summed over tp
    "lfm2": "colwise",  # per-head q/k norms (undeclared): replicated, gradients summed over tp
    "gpt_oss": "colwise",  # its attention sinks (one per head) split with the heads
    "codegen": "colwise_gather_output",  # its declared colwise qkv_proj, a layout shardwise cannot tell: gathered
    "gemma3n": "colwise_gather_output",  # layer 0's MLP cuts its activations at a statistic over its hidden units: gathered
}


def test_declared_styles_train_like_single_under_tp2() -> None:
    results = families.cells(CELLS)
    for (name, _, _), (summary, state) in zip(CELLS, results, strict=True):
        assert STYLE_SEEN[name] in summary["tp"]["plan"].values(), (name, summary["tp"]["plan"])
        if name == "gpt_oss":
            assert summary["tp"]["plan"]["model.layers.1.self_attn.q_proj"] == "colwise"
        if name == "apertus":
            assert summary["tp"]["plan"]["model.layers.0.mlp.up_proj"] == "colwise"
        if name.startswith(("bloom", "falcon")):
            assert summary["tp"]["plan"]["transformer.h.1.self_attention.query_key_value"] == "colwise"
        diff = harness.max_difference(state, families.train(name)[1])
        assert diff < harness.TOL, f"{name}: {diff:.3e} off single under tp=2"


def test_every_declared_style_is_translated_skipped_or_refused_by_name() -> None:
    """Scans transformers' configs: a style in a declared plan that shardwise neither translates, keeps whole
    (embeddings, heads) nor refuses by name fails here (a new transformers release adds one)."""
    import transformers.models as models

    known = _HF_MODULE_STYLES | _HF_PARAM_STYLES | _HF_SKIPPED | set(_HF_REFUSED) | {_HF_GRAD_SUM}
    seen: dict[str, str] = {}
    for info in pkgutil.iter_modules(models.__path__):
        folder = os.path.join(models.__path__[0], info.name)
        for file in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if not (file.startswith("configuration_") and file.endswith(".py")):
                continue
            try:
                module = importlib.import_module(f"transformers.models.{info.name}.{file[:-3]}")
            except Exception:  # an optional dependency missing: that family is not built here either
                continue
            for cls in vars(module).values():
                plan = getattr(cls, "base_model_tp_plan", None)
                if isinstance(plan, dict):
                    seen.update({style: cls.__name__ for style in plan.values()})
    assert {"moe_tp_experts", "packed_colwise", "mla_kv_a_proj", "rowwise_split_input"} <= set(seen)
    unknown = {style: cls for style, cls in seen.items() if style not in known}
    assert not unknown, f"declared styles neither translated nor refused by name: {unknown}"


def test_a_users_column_split_of_a_fused_projection_is_refused_with_the_layout_to_use() -> None:
    phi3 = families.build("phi3")
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.gate_up_proj'\] = 'colwise' splits a fused gate\|up .*'packed_colwise'"):
        resolve(phi3, {"model.layers.*.mlp.gate_up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}, 2)
    with pytest.raises(ConfigError, match=r"qkv_proj'\] = 'colwise' splits a fused q\|k\|v .*'colwise_gather_output'"):
        resolve(phi3, {"model.layers.*.self_attn.qkv_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}, 2)
    plan, _, _ = resolve(phi3, {"model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise"}, 2)
    assert plan["model.layers.1.mlp.gate_up_proj"] == "packed_colwise"


def test_a_pattern_star_matches_one_path_segment() -> None:
    bert = zoo.build("bert", layers=2)
    plan = {"bert.encoder.layer.*.intermediate.dense": "colwise", "bert.encoder.layer.*.output.dense": "rowwise"}
    resolved, _, _ = resolve(bert, plan, 2)
    assert sorted(resolved) == [f"bert.encoder.layer.{i}.{m}.dense" for i in (0, 1) for m in ("intermediate", "output")]
    with pytest.raises(ConfigError, match=r"matches no module .*each '\*' matches one dotted segment.*bert.encoder.layer.0.intermediate.dense"):
        resolve(bert, {"bert.encoder.*.intermediate.dense": "colwise", "bert.encoder.*.output.dense": "rowwise"}, 2)


def test_a_plan_whose_shapes_cannot_pair_is_refused_naming_the_module() -> None:
    bert = zoo.build("bert", layers=2)  # attention.output.dense reads 32 features; intermediate.dense gives 64
    plan = {"bert.encoder.layer.*.intermediate.dense": "colwise", "bert.encoder.layer.*.attention.output.dense": "rowwise"}
    with pytest.raises(ConfigError, match=r"bert.encoder.layer.0.attention.output.dense'\] = 'rowwise' takes 32 input features, but no column-split"):
        check_model_fits(bert, plan, 2, False, "ddp")


def test_sequence_parallel_and_fsdp_with_the_new_styles_are_refused_before_launch() -> None:
    mixtral = families.build("mixtral")
    with pytest.raises(
        ConfigError, match=r"sequence parallelism with tensor-parallel style 'moe_tp_experts' \(model.layers.0.mlp.experts\).*sequence_parallel=False"
    ):
        check_model_fits(mixtral, None, 2, True, "ddp")
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.experts \(moe_tp_experts\) .* dp_strategy='ddp'"):
        check_model_fits(mixtral, None, 2, False, "fsdp")
    with pytest.raises(ConfigError, match=r"gate_up_proj \(packed_colwise\) has 32 output features per half.*tp=3"):
        check_model_fits(
            families.build("phi3"), {"model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise"}, 3, False, "ddp"
        )


def test_falcons_multi_query_fused_qkv_is_refused_with_the_exact_alternative() -> None:
    import transformers as tf

    cfg = tf.FalconConfig(vocab_size=64, hidden_size=16, num_attention_heads=4, num_hidden_layers=1)  # multi_query by default
    with pytest.raises(ConfigError, match=r"query_key_value is a fused q\|k\|v projection with Falcon's multi-query layout.*'colwise_gather_output'"):
        resolve(tf.FalconForCausalLM(cfg), None, 2)


def test_undeclared_per_head_norms_and_scalars_inside_a_sublayer_have_their_gradients_summed() -> None:
    from shardwise.strategies.tensor_parallel import roles

    for name, expected in (("lfm2", "model.layers.1.self_attn.q_layernorm.weight"), ("apertus", "model.layers.0.mlp.act_fn.alpha_p")):
        model = families.build(name)
        plan, grad_sum, _ = resolve(model, None, 2)
        assert expected in roles(model, plan, grad_sum, False)["sum"]


def test_an_in_proj_outside_attention_is_not_taken_for_a_fused_qkv() -> None:
    from torch import nn

    from shardwise.strategies.tensor_parallel import auto_plan

    class Mixer(nn.Module):  # a short-convolution / state-space mixer: in_proj, out_proj and no heads
        def __init__(self) -> None:
            super().__init__()
            self.in_proj, self.out_proj = nn.Linear(8, 24), nn.Linear(8, 8)

    class Attention(Mixer):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads = 2

    assert auto_plan(nn.Sequential(Mixer())) == {}
    with pytest.raises(ConfigError, match=r"0.in_proj is a fused q\|k\|v projection"):
        auto_plan(nn.Sequential(Attention()))
