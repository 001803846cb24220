"""Small transformers causal LMs for the declared-style tp cells (tests/strategies/tensor_parallel/test_styles.py).

Each family is built from a tiny config (2 layers, hidden 16-32, vocab 64, seq 16, float64, random
weights) and trained by the harness's settings (5 SGD steps, a clip that acts) with a float64
causal-LM loss; `train` is one cell, `cells` many in one launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardwise import Trainer, launch
from tests.support import harness, zoo

COMMON: dict[str, Any] = {"vocab_size": zoo.VOCAB, "num_hidden_layers": 2, "attn_implementation": "eager", "tie_word_embeddings": False, "pad_token_id": 0}
ATTN: dict[str, Any] = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": zoo.SEQ}
GEMMA3N: dict[str, Any] = {
    "vocab_size": zoo.VOCAB + 1,  # a padding id the data never holds
    "pad_token_id": zoo.VOCAB,
    "vocab_size_per_layer_input": zoo.VOCAB + 1,
    "hidden_size_per_layer_input": 8,
    "intermediate_size": 32,
    "head_dim": 4,
    "laurel_rank": 4,
    "num_kv_shared_layers": 0,
    "activation_sparsity_pattern": [0.95, 0.0],
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 8,
}
"""Per-layer inputs fed to every block; the first layer's MLP keeps its top 5% of gate activations (a statistic over the hidden units)."""
MLA_SETTINGS: dict[str, Any] = {
    "q_lora_rank": 8,
    "kv_lora_rank": 8,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 4,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
    "num_key_value_heads": 4,
}
"""Multi-head latent attention (q and k/v through low-rank latents; a rotary key shared by the heads); layer 0 dense, layer 1 MoE."""
MOE: dict[str, Any] = {"num_experts_per_tok": 2, "intermediate_size": 32}

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (config class, model class, config settings)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**ATTN, **MOE, "num_local_experts": 4}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {**ATTN, **MOE, "num_experts": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32},
    ),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**ATTN, **MOE, "num_experts": 4, "moe_intermediate_size": 16, "head_dim": 4}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {**ATTN, **MOE, "num_experts": 4}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {**ATTN, **MOE, "num_local_experts": 4}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**ATTN, "intermediate_size": 32}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {**ATTN, "intermediate_size": 32, "head_dim": 4}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {**ATTN, "intermediate_size": 32}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {**ATTN, **MOE, **MLA_SETTINGS, "n_routed_experts": 4, "n_shared_experts": 1}),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", {**ATTN, **MLA_SETTINGS, "intermediate_size": 32}),
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {**ATTN, **MOE, "intermediate_size_mlp": 32, "num_local_experts": 4, "num_experts_per_tok": 1, "head_dim": 4, "interleave_moe_layer_step": 1},
    ),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"hidden_size": 16, "n_head": 4, "hidden_dropout": 0.0, "attention_dropout": 0.0}),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        {"hidden_size": 16, "num_attention_heads": 4, "multi_query": False, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    ),
    "falcon_new": (
        "FalconConfig",
        "FalconForCausalLM",
        {"hidden_size": 16, "num_attention_heads": 4, "num_kv_heads": 2, "new_decoder_architecture": True, "hidden_dropout": 0.0},
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {**ATTN, **MOE, "num_local_experts": 4, "head_dim": 4, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
    ),
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        {**ATTN, "intermediate_size": 32, "layer_types": ["full_attention", "full_attention"], "block_auto_adjust_ff_dim": False},
    ),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {**ATTN, "intermediate_size": 32}),
    # declares colwise on its fused qkv_proj, which its forward reshapes into 4 fixed blocks of q|v|k
    "codegen": (
        "CodeGenConfig",
        "CodeGenForCausalLM",
        {"n_embd": 32, "n_head": 4, "rotary_dim": 4, "n_inner": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    ),
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", {**ATTN, **GEMMA3N}),
    "gemma3n_dense": ("Gemma3nTextConfig", "Gemma3nForCausalLM", {**ATTN, **GEMMA3N, "activation_sparsity_pattern": [0.0, 0.0]}),
}


def build(name: str, seed: int = 0) -> nn.Module:
    import transformers as tf

    cfg_cls, model_cls, settings = FAMILIES[name]
    torch.manual_seed(seed)
    cfg = getattr(tf, cfg_cls)(**{**COMMON, **settings})
    cfg._experts_implementation = "eager"  # grouped_mm takes no float64
    return getattr(tf, model_cls)(cfg).to(torch.float64)  # type: ignore[no-any-return]


def _trainer(strategy: str, options: dict[str, Any] | None) -> Trainer:
    return Trainer(
        optimizer=harness.sgd,
        loss_fn=zoo.causal_lm_loss64,
        strategy=strategy,
        strategy_options=dict(options or {}),
        global_batch_size=harness.GLOBAL_BATCH,
        max_steps=harness.STEPS,
        precision="64",
        clip_grad_norm=harness.CLIP,
        seed=0,
        progress_bar=False,
        log_every=1,
    )


def train(name: str, strategy: str = "single", options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """One cell: ``name`` trained under ``strategy``; (summary, rank 0's consolidated state)."""
    model = build(name)
    data = zoo.dataset("llama", harness.SAMPLES)  # token ids and labels, vocabulary 64, 16 positions
    t = _trainer(strategy, options)
    t._check(model, data)
    summary, state = t._fit(model, data, None, return_state=True)
    if strategy == "single":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return summary, state


def _worker(cells: Sequence[tuple[str, str, dict[str, Any]]]) -> list[Any]:
    return [train(*c) for c in cells]


def cells(cells: Sequence[tuple[str, str, dict[str, Any]]], nproc: int = 2) -> list[Any]:
    """Run ``cells`` (name, strategy, options) one after another in one launch; rank 0's results."""
    return launch(_worker, list(cells), nproc=nproc, threads_per_proc=1, timeout=600)[0]  # type: ignore[no-any-return]
