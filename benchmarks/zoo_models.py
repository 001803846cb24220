"""transformers' causal language models from small configs, for `benchmarks/zoo.py` and its tests.

`catalogue()` lists every ``*ForCausalLM`` class transformers maps a config to (its auto mapping of
causal LMs, so new families join by themselves); `small_config(model_type)` is that family's
default config with its sizes shrunk by one generic table of field names (`OVERRIDES`: 2 layers,
hidden 32, 4 heads, 2 key/value heads, vocabulary 64, MoE with 4 experts of which 2 per token,
latent attention ranks of 16, sliding windows of 8 tokens so they act on 16-token
sequences), lists of one value per layer cut to 2 layers keeping one of each kind (a per-layer
pattern of attention kinds stays a pattern), every dropout 0; `build(model_type)` is the model in
float64 from seed 0. Nothing is downloaded. `describe(model)` says what it declares: a
tensor-parallel plan (its config's ``base_model_tp_plan``) and the styles of the model's
``_tp_plan`` (that plan and the class's own, the output head's), a pipeline plan
(``base_model_pp_plan``), and MoE layers (found from structure: a module holding a 3-D stacked
expert parameter or a list of expert MLPs beside a router). Multi-head latent attention takes
the rotary part as its head width and one key/value per head; the state-space hybrids get 8 heads
of 8 (expand 2 x hidden 32).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

VOCAB = 64
SEQ = 16
LAYERS = 2

OVERRIDES: dict[str, Any] = {
    # sizes, in every spelling the families use
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "n_embd": 32,
    "n_layer": LAYERS,
    "n_head": 4,
    "n_positions": 64,
    "n_ctx": 64,
    "d_model": 32,
    "n_layers": LAYERS,
    "n_heads": 4,
    "num_layers": LAYERS,
    "num_heads": 4,
    "decoder_layers": LAYERS,
    "decoder_attention_heads": 4,
    "decoder_ffn_dim": 64,
    "encoder_layers": LAYERS,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "ffn_dim": 64,
    "n_inner": 64,
    "d_ff": 64,
    "kv_channels": 8,
    # mixture of experts: few experts, two per token, small expert MLPs
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "router_jitter_noise": 0.0,
    "expert_layer_period": 1,
    "expert_layer_offset": 0,
    # multi-head latent attention and linear attention
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 4,
    "qk_head_dim": 8,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    # per-layer embeddings, windows, caches
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": VOCAB,
    "laurel_rank": 8,
    "sliding_window": 8,
    "attention_chunk_size": 8,
    "use_cache": False,
    "rotary_dim": 4,
    "num_kv_shared_layers": 0,
    "num_experts_per_token": 2,
    # state-space layers of the hybrids (heads x head width = expand x hidden)
    "mamba_n_heads": 8,
    "mamba_d_head": 8,
    "mamba_n_groups": 1,
    "mamba_d_state": 8,
    "mamba_chunk_size": 16,
    "mamba_expand": 2,
    "mamba_d_conv": 4,
    "mamba_num_heads": 8,
    "mamba_head_dim": 8,
    "ssm_state_size": 8,
    "n_groups": 1,
    "chunk_size": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
NONE_TOO = ("head_dim", "num_key_value_heads", "use_cache", "num_experts_per_tok")
"""Overridden even where the default is None (None there means "derive it from the other sizes")."""
PER_LAYER_KINDS = ("layer_types", "attention_types", "block_types", "layers_block_type")


def catalogue() -> dict[str, str]:
    """``{model_type: class name}`` of every causal LM transformers maps a config to."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def default_config(model_type: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]()


def _per_layer(values: list[Any], layers: int) -> list[Any]:
    """A per-layer list cut to ``layers`` entries, one of each kind first (alternating patterns stay)."""
    kinds: list[Any] = []
    for v in values:
        if v not in kinds:
            kinds.append(v)
    out = (kinds + list(values))[:layers]
    return out + [values[0]] * (layers - len(out))


def _shrink(d: dict[str, Any], default_layers: int | None) -> dict[str, Any]:
    """The overrides that apply to one config's dict ``d`` (keys it has)."""
    kw: dict[str, Any] = {k: v for k, v in OVERRIDES.items() if k in d and (d[k] is not None or k in NONE_TOO)}
    if d.get("kv_lora_rank"):  # latent attention: the rotary part is the head width, every head has its own key/value
        kw.update(head_dim=OVERRIDES["qk_rope_head_dim"], num_key_value_heads=OVERRIDES["num_attention_heads"])
    for k, v in d.items():
        if isinstance(v, dict) and v and all(str(i).isdigit() for i in v):  # per-layer settings keyed by layer index
            kw[k] = {i: x for i, x in v.items() if int(i) < LAYERS}
    for k, v in d.items():
        if ("dropout" in k or "pdrop" in k or k.endswith("_drop")) and isinstance(v, float):
            kw[k] = 0.0
        elif isinstance(v, list) and default_layers and len(v) == default_layers and k not in kw:
            kw[k] = _per_layer(v, LAYERS) if k in PER_LAYER_KINDS else v[:LAYERS]
        elif k in ("intermediate_size",) and isinstance(v, list):
            kw[k] = [64] * LAYERS
    if isinstance(d.get("eos_token_id"), list):
        kw["eos_token_id"] = [2]
    return kw


def small_config(model_type: str) -> Any:
    """``model_type``'s default config, shrunk (see the module's docstring); composite configs
    (a ``text_config``) shrink their text part too."""
    default = default_config(model_type)
    d = default.to_dict()
    layers = next((d[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers") if isinstance(d.get(k), int)), None)
    kw = _shrink(d, layers)
    for sub in ("text_config", "decoder"):
        if isinstance(d.get(sub), dict):
            inner = d[sub]
            inner_layers = next((inner[k] for k in ("num_hidden_layers", "num_layers") if isinstance(inner.get(k), int)), None)
            kw[sub] = {**inner, **_shrink(inner, inner_layers)}
    kw = {k: v for k, v in kw.items() if k not in ("mlp_only_layers",) or v}
    cfg = type(default)(**{**_keep_types(d), **kw})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # grouped_mm takes no float64
    return cfg


def _keep_types(d: dict[str, Any]) -> dict[str, Any]:
    """The default's own fields worth passing back (not bookkeeping the constructor recomputes)."""
    skip = {"transformers_version", "architectures", "_name_or_path", "model_type", "id2label", "label2id", "dtype"}
    return {k: v for k, v in d.items() if k not in skip}


def build(model_type: str, *, seed: int = 0) -> nn.Module:
    """The causal LM of ``model_type`` from its small config, float64, weights drawn from ``seed``."""
    import transformers

    cls = getattr(transformers, catalogue()[model_type])
    cfg = small_config(model_type)
    torch.manual_seed(seed)
    model = cls(cfg)
    return model.to(torch.float64)


def sample(i: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100_003 + i)
    ids = torch.randint(3, VOCAB, (SEQ,), generator=g)  # above the special tokens (pad 0, bos 1, eos 2)
    return {"input_ids": ids, "labels": ids.clone()}


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return sample(i, self.seed)


def causal_lm_loss64(output: Any, batch: Any) -> torch.Tensor:
    """Next-token cross-entropy in the logits' dtype (transformers' own loss runs in float32); the
    router's auxiliary loss stays out (``output_router_logits`` is off by default in every MoE config)."""
    logits = output.logits
    labels = batch["labels"]
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(), labels[:, 1:].reshape(-1))


def tp_plan_of(config: Any) -> dict[str, str]:
    """The tensor-parallel plan a config declares (``base_model_tp_plan``; its text config's for a composite)."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan and getattr(config, "text_config", None) is not None:
        plan = getattr(config.text_config, "base_model_tp_plan", None)
    return dict(plan or {})


def pp_plan_of(config: Any) -> dict[str, Any]:
    """The pipeline plan a config declares (``base_model_pp_plan``; its text config's for a composite)."""
    plan = getattr(config, "base_model_pp_plan", None)
    if not plan and getattr(config, "text_config", None) is not None:
        plan = getattr(config.text_config, "base_model_pp_plan", None)
    return dict(plan or {})


def moe_modules(model: nn.Module) -> list[str]:
    """Modules that look like a mixture of experts, from structure: a stacked expert parameter
    (3-D, experts first) or a ModuleList of MLPs next to a router-like linear with that many outputs."""
    found = []
    for name, m in model.named_modules():
        params = [p for p in m.parameters(recurse=False) if p.dim() == 3]
        lists = [c for c in m.children() if isinstance(c, nn.ModuleList) and len(c) > 1]
        if params and re.search(r"expert", name.split(".")[-1] or "", re.I):
            found.append(name)
        elif lists and any(isinstance(c, nn.Linear) and c.out_features == len(lists[0]) for c in m.children()):
            found.append(name)
    return found


def describe(model: nn.Module) -> dict[str, Any]:
    """What ``model`` declares: its tp plan's styles, whether it has a pp plan, its MoE modules."""
    tp = dict(getattr(model, "_tp_plan", None) or {})  # the config's plan under the model's prefix, and the head's
    return {
        "class": type(model).__name__,
        "tp_plan": bool(tp_plan_of(model.config)),
        "tp_styles": sorted(set(map(str, tp.values()))),
        "pp_plan": bool(pp_plan_of(model.config)),
        "moe": moe_modules(model),
        "params": sum(p.numel() for p in model.parameters()),
    }
