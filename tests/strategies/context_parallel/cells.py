"""The context-parallel parity cells' models: the zoo's, with attention that is exact in float64.

transformers' eager attention takes its softmax in float32 (Llama, Qwen2), which caps float64
parity at float32 rounding whatever the strategy; the reference and every cp cell here run the
same model with ``sdpa`` attention (float64 throughout). Qwen2 is the third family (q/k/v biases,
grouped key/value heads, rotary), built here from a small config.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers as tf
from torch import nn

from tests.support import harness, zoo

FAMILIES = ("llama", "gpt2", "qwen2", "nanogpt")


class LlamaStep(tf.LlamaForCausalLM):
    """Llama with the README's alternative to loss_fn: ``training_step`` returning ``self(**batch).loss``."""

    def training_step(self, batch: Any) -> torch.Tensor:
        return self(**batch).loss  # type: ignore[no-any-return]


def _llama_step() -> nn.Module:
    """`LlamaStep` with the weights of the cells' Llama."""
    base = build("llama")
    model = LlamaStep(base.config).to(torch.float64)
    model.load_state_dict(base.state_dict())
    return model


def build(name: str) -> nn.Module:
    """``name``'s model in float64 from seed 0, 2 layers, attention in float64."""
    if name == "qwen2":
        torch.manual_seed(0)
        cfg = tf.Qwen2Config(
            vocab_size=zoo.VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=zoo.SEQ,
            tie_word_embeddings=False,
            use_sliding_window=False,
            attn_implementation="sdpa",
        )
        return tf.Qwen2ForCausalLM(cfg).to(torch.float64)
    if name == "llama_step":
        return _llama_step()
    model = zoo.build(name, layers=2)  # "nanogpt_targets": Karpathy's forward(idx, targets), training_step calls self(x, y)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        cfg._attn_implementation = "sdpa"
    return model


def data_name(name: str) -> str:
    return "llama" if name in ("qwen2", "llama_step") else name


def train(name: str, strategy: str = "single", options: dict[str, Any] | None = None, **settings: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """One cell, as `harness.train` trains it, on `build`'s model; (summary, rank 0's final state)."""
    model = build(name)
    t = harness.trainer(data_name(name), strategy, options, **settings)
    data = zoo.dataset(data_name(name), harness.SAMPLES)
    t._check(model, data)
    summary, state = t._fit(model, data, None, return_state=True)
    if strategy == "single":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return summary, state


def run(cells: list[tuple[Any, ...]]) -> list[tuple[dict[str, Any], dict[str, torch.Tensor] | None]]:
    """Every cell in this process (one rank of a launch), ring attention's query tiles smaller than a
    rank's share of the sequence (4 rows of 8), so the tiled path runs."""
    from shardwise.strategies.context_parallel import ring

    ring.TILE = 4
    return [train(c[0], c[1], c[2], **(c[3] if len(c) > 3 else {})) for c in cells]
