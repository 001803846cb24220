"""Token shards on CUDA: a Trainer run on `TokenShards` (pinned batches, a loader worker) trains a GPT on the
GPU to the float64 weights the same run reaches on the CPU, and the document mask is exact under CUDA's
sdpa: each packed document gets the logits it gets alone. Skipped without a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data._utils.collate import default_collate

from shardwise import Trainer
from shardwise.data import TokenShards, write_token_shards
from tests.support import zoo

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
transformers = pytest.importorskip("transformers")


def _docs() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, zoo.VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (60,), generator=g)]


def _fit(data: TokenShards, accelerator: str) -> dict[str, torch.Tensor]:
    model = zoo.build("nanogpt", layers=2)
    Trainer(
        accelerator=accelerator,
        precision="64",
        global_batch_size=8,
        max_steps=6,
        num_workers=1,
        pin_memory=accelerator == "cuda",
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        loss_fn=zoo.nanogpt_loss,
        progress_bar=False,
    ).fit(model, data)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_token_shards_train_on_the_gpu_as_on_the_cpu(tmp_path: Path) -> None:
    write_token_shards(_docs(), tmp_path, sep=1, shard_tokens=300)
    data = TokenShards(tmp_path, zoo.SEQ)
    gpu, cpu = _fit(data, "cuda"), _fit(data, "cpu")
    worst = max((gpu[k] - cpu[k]).abs().max().item() for k in cpu)
    assert worst < 1e-9, f"CUDA run {worst:.3g} off the CPU run"


def test_the_document_mask_is_exact_under_cuda_sdpa(tmp_path: Path) -> None:
    write_token_shards([[5, 9, 13, 2, 40, 33, 7], [11, 12, 60], [21, 22, 23, 24, 25, 26]], tmp_path, sep=1)
    batch = default_collate([TokenShards(tmp_path, 16, labels="hf", document_mask=True)[0]])
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float64).cuda().eval()
    ids, pos = batch["input_ids"].cuda(), batch["position_ids"].cuda()
    with torch.no_grad():
        packed = model(input_ids=ids, attention_mask=batch["attention_mask"].cuda(), position_ids=pos).logits[0]
        start = 0
        for end in [i + 1 for i, t in enumerate(ids[0].tolist()) if t == 1] + [ids.shape[1]]:
            alone = model(input_ids=ids[:, start:end]).logits[0]
            assert (packed[start:end] - alone).abs().max().item() < 1e-9, f"document at {start}:{end} differs from it alone"
            start = end
