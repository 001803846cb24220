"""Factories (``module:factory`` for ``shardwise plan --model``) of the option costs' tests: a Llama on long sequences
(context parallelism's candidates) and a Mixtral (expert parallelism's), tiny, random weights, float32."""

from __future__ import annotations

import torch
from torch import nn

LONG_SEQ = 256
"""Tokens a sample of `llama_long`: the shortest the planner proposes cp for (`context_parallel.cost.MIN_SEQ`)."""
SAMPLES = 2


def llama_long() -> tuple[nn.Module, torch.Tensor]:
    """Llama, 2 layers, hidden 16, 4 heads over 2 key/value heads, on `LONG_SEQ`-token samples."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=LONG_SEQ, tie_word_embeddings=False,
    )  # fmt: skip
    return tf.LlamaForCausalLM(cfg), torch.randint(0, 64, (SAMPLES, LONG_SEQ))


def mixtral() -> tuple[nn.Module, torch.Tensor]:
    """Mixtral, 2 layers, hidden 16, 4 experts top-2 (transformers' eager experts), on 16-token samples."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    return model, torch.randint(0, 64, (4, 16))
