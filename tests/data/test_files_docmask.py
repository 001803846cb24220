"""The document mask is exact: a tiny transformers Llama (float64, random weights) on a packed block
with `TokenShards`' block-diagonal mask and restarting position ids gives each document the logits
it gets run alone: under sdpa attention with the sample's bool mask as collated, under eager
attention (which adds the mask to the scores) with `additive_mask` in the model's dtype; without
the mask the documents see each other (the check can fail)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data._utils.collate import default_collate

from shardwise.data import TokenShards, write_token_shards
from shardwise.data.files import additive_mask

transformers = pytest.importorskip("transformers")


def _llama(attn: str):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn, dtype=torch.float64)
    return model.eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_block_gives_each_document_its_logits_alone(tmp_path, attn):
    sep = 1
    docs = [[5, 9, 13, 2, 40, 33, 7], [11, 12, 60], [21, 22, 23, 24, 25, 26], [30, 31, 32, 34, 35, 36, 37, 38, 39]]
    write_token_shards(docs, tmp_path, sep=sep)
    data = TokenShards(tmp_path, 16, labels="hf", document_mask=True)  # block 0: docs 0-2 whole, doc 3 cut
    batch = default_collate([data[0], data[0]])
    assert batch["attention_mask"].shape == (2, 1, 16, 16) and batch["input_ids"].shape == (2, 16)
    model = _llama(attn)
    with torch.no_grad():
        mask = batch["attention_mask"] if attn == "sdpa" else additive_mask(batch["attention_mask"], torch.float64)
        packed = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"]).logits[0]
        unmasked = model(input_ids=batch["input_ids"][:1]).logits[0]
        ids = batch["input_ids"][0]
        ends = [i + 1 for i, t in enumerate(ids.tolist()) if t == sep]
        segments = list(zip([0, *ends], [*ends, 16], strict=True))
        assert [b - a for a, b in segments] == [8, 4, 4]  # 7+sep, 3+sep, the first 4 of the third document
        worst, seen = 0.0, 0.0
        for a, b in segments:
            alone = model(input_ids=ids[None, a:b]).logits[0]
            worst = max(worst, (packed[a:b] - alone).abs().max().item())
            seen = max(seen, (unmasked[a:b] - alone).abs().max().item())
    # eager attention takes its softmax in float32 (transformers' Llama): 1e-16 differences in the
    # float64 scores can round apart there, so eager is held to float32's precision
    assert worst < (1e-12 if attn == "sdpa" else 1e-6), worst
    assert seen > 1e-3  # the check has teeth: without the mask, later documents see the earlier ones
