"""A document mask (bool, one row per query) given to a transformers model with eager attention is refused
before launch: eager adds the mask to its scores, so a bool mask would mask nothing, silently. Under sdpa
the same data trains."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from shardwise import Trainer
from shardwise.data import TokenShards, write_token_shards
from shardwise.errors import ConfigError

transformers = pytest.importorskip("transformers")


def _llama(attn: str) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32
    )
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn)


def test_eager_attention_with_a_bool_document_mask_is_refused_sdpa_trains(tmp_path: Path) -> None:
    write_token_shards([[5, 9, 13, 2, 40], [11, 12, 60, 3], [21, 22, 23]] * 8, tmp_path, sep=1)
    data = TokenShards(tmp_path, 8, labels="hf", document_mask=True)
    trainer = Trainer(global_batch_size=4, max_steps=2, progress_bar=False)
    with pytest.raises(ConfigError, match=r"eager attention, which adds attention_mask.*bool \(1, 1, 8, 8\).*attn_implementation='sdpa'"):
        trainer.fit(_llama("eager"), data)
    summary = trainer.fit(_llama("sdpa"), data)
    assert math.isfinite(summary["train_loss"])  # the steps ran on the packed, masked blocks
