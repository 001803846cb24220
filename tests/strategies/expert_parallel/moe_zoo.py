"""Mixture-of-experts causal LMs of transformers' families from small configs (random weights, float64),
their data, and one cell's training (as tests/support/harness.py, with a float64 loss).

Families: Mixtral (router + experts), Qwen2-MoE (plus a shared expert and its gate), OLMoE,
GraniteMoE (``block_sparse_moe``); ``MORE``: Qwen3-MoE, DeepSeek-V3. Tiny: 2 layers, hidden 16, 4 experts top-2, seq 16, vocab 64;
the experts in transformers' ``eager`` implementation (its grouped_mm has no float64 CPU kernel).
``mixtral_renamed``: Mixtral whose experts' forward is ``(rows, chosen, weights)`` (other names, the same
interface: ep matches it by position); ``gpt_oss``: GPT-OSS (its experts' index and weights arguments
default to None, their biases stacked too). ``*_aux``: the same model with ``output_router_logits`` on, its loss the language-model loss plus
``router_aux_loss_coef`` x the load-balancing loss, as the model defines it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise import Trainer
from tests.support import harness, zoo

FAMILIES = ("mixtral", "qwen2_moe", "olmoe", "granitemoe")
MORE = ("qwen3_moe", "deepseek_v3")
"""Two more families, in the 2-process parity launch only (DeepSeek-V3: latent attention, a shared expert)."""
EXPERTS = 4


def _config(family: str, aux: bool) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=zoo.VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=zoo.SEQ, intermediate_size=24, num_experts_per_tok=2, output_router_logits=aux,
        router_aux_loss_coef=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if family == "mixtral":
        return tf.MixtralConfig(num_local_experts=EXPERTS, **common)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(num_experts=EXPERTS, moe_intermediate_size=24, shared_expert_intermediate_size=24, decoder_sparse_step=1, **common)
    if family == "olmoe":
        return tf.OlmoeConfig(num_experts=EXPERTS, **common)
    if family == "granitemoe":
        return tf.GraniteMoeConfig(num_local_experts=EXPERTS, **common)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(num_experts=EXPERTS, moe_intermediate_size=24, decoder_sparse_step=1, head_dim=8, **common)
    if family == "deepseek_v3":  # multi-head latent attention, a shared expert, group-limited routing (one group)
        mla = dict(q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
        moe = dict(n_routed_experts=EXPERTS, moe_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1)
        return tf.DeepseekV3Config(**moe, **mla, **common)
    raise KeyError(f"unknown MoE family {family!r}; known: {FAMILIES}")


def build(name: str, seed: int = 0) -> nn.Module:
    """``name`` is a family, or a family + ``_aux`` (the router's load-balancing loss on)."""
    import transformers as tf

    if name == "gpt_oss":  # experts forward(hidden_states, router_indices=None, routing_weights=None), biases (E, ...)
        from tests.strategies.tensor_parallel import families

        return families.build("gpt_oss", seed)
    renamed = name == "mixtral_renamed"
    family, aux = ("mixtral", False) if renamed else (name.removesuffix("_aux"), name.endswith("_aux"))
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(_config(family, aux), experts_implementation="eager").to(torch.float64)
    if renamed:
        for module in model.modules():
            if hasattr(module, "gate_up_proj"):
                module.__class__ = _renamed(type(module))
    return model  # type: ignore[no-any-return]


def _renamed(cls: type) -> type:
    """``cls`` (a transformers experts class) with its forward's arguments renamed, defined here (not a library class)."""

    def forward(self: nn.Module, rows: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return cls.forward(self, rows, chosen, weights)  # type: ignore[no-any-return]

    return type("RenamedExperts", (cls,), {"forward": forward, "__module__": __name__})


def dataset(n: int, seed: int = 0) -> zoo.Samples:
    return zoo.dataset("llama", n, seed=seed)  # token ids with labels: any causal LM's data


def loss_fn(output: Any, batch: Any) -> torch.Tensor:
    """The causal-LM loss in float64, plus the router's auxiliary loss where the model returns one."""
    loss = zoo.causal_lm_loss64(output, batch)
    aux = getattr(output, "aux_loss", None)
    return loss if aux is None else loss + 0.1 * aux


def train(name: str, strategy: str = "single", options: dict[str, Any] | None = None, *, val: int = 0, **settings: Any) -> dict[str, torch.Tensor] | None:
    """One cell, 5 float64 SGD steps with an acting clip (and an evaluation on ``val`` samples at the
    end when not 0); rank 0's whole final state (None elsewhere)."""
    model = build(name)
    base: dict[str, Any] = dict(
        strategy=strategy, strategy_options=dict(options or {}), global_batch_size=harness.GLOBAL_BATCH, max_steps=harness.STEPS,
        precision="64", clip_grad_norm=harness.CLIP, seed=0, progress_bar=False, log_every=1,
    )  # fmt: skip
    base.update(settings)
    t = Trainer(optimizer=harness.sgd, loss_fn=loss_fn, **base)
    data = dataset(harness.SAMPLES)
    t._check(model, data)
    _, state = t._fit(model, data, dataset(val, seed=1) if val else None, return_state=True)
    if strategy == "single":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state  # type: ignore[no-any-return]


def run_cells(cells: list[tuple[str, str, dict[str, Any], dict[str, Any]]]) -> list[dict[str, torch.Tensor] | None]:
    return [train(n, s, o, **kw) for n, s, o, kw in cells]


def first_grad_norm(name: str) -> float:
    model = build(name)
    data = dataset(harness.SAMPLES)
    batch = torch.utils.data.default_collate([data[i] for i in range(harness.GLOBAL_BATCH)])
    loss_fn(model(**batch), batch).backward()
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))
