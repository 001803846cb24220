"""Activation checkpointing changes no gradient, under every strategy, on other people's models.

Each cell trains ``STEPS`` clipped float64 SGD steps twice, with ``activation_checkpointing`` off and
on (``blocks``, ``blocks:2`` or ``ops``), and the two final states must be equal bit for bit (a
step is a function of the clipped gradients, so equal states mean equal gradients). Models: HF
Llama and GPT-2 from the zoo, and HF Qwen3 (not in the zoo: q/k norms, tied embeddings, attention
dropout 0.1, so the recompute must draw the same dropout masks), and the zoo's nanoGPT under the
pipeline's fx-traced route (the HF models take its nested route). One 2-process launch runs ddp,
zero1, zero2, zero3, tp, tp + sp and pipeline cells; one 4-process launch runs hsdp 2x2 and
pipeline pp2 x tp2 (with sequence parallelism); ``single`` runs here.

The runs with it on say which blocks recompute, and their names (checkpoints, tp plans, pipeline
stages) are those of the model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardwise import launch
from shardwise.strategies.checkpointing import checkpointed
from tests.support import harness, zoo

pytest.importorskip("transformers", reason="the model tests need transformers: pip install -e '.[dev]'")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

STEPS = 2


def qwen3() -> nn.Module:
    """A small HF Qwen3 in float64 from seed 0 (no download); dropout on, so recomputation must replay it."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3Config(
        vocab_size=zoo.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=zoo.SEQ,
        attention_dropout=0.1,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    return tf.Qwen3ForCausalLM(cfg).to(torch.float64)


def build(name: str) -> nn.Module:
    return qwen3() if name == "qwen3" else zoo.build(name)


def train(name: str, strategy: str, options: dict[str, Any], ac: str) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """One cell's run (``ac`` the activation_checkpointing value); rank 0's consolidated state."""
    data = zoo.dataset("llama" if name == "qwen3" else name, harness.SAMPLES)  # token ids and labels: any causal LM's batch
    t = harness.trainer("llama" if name == "qwen3" else name, strategy, options, max_steps=STEPS, activation_checkpointing=ac)
    model = build(name)
    t._check(model, data)
    summary, state = t._fit(model, data, None, return_state=True)
    if strategy == "single":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    summary["recomputed"] = checkpointed(model)  # the Engine patched this process's model in place
    return summary, state


TP = {"tp": 2, "check_replicas": True}
CELLS_2 = [
    ("llama", "ddp", {}, "blocks"),
    ("llama", "zero1", {}, "ops"),
    ("llama", "zero2", {}, "blocks:2"),
    ("llama", "zero3", {}, "blocks"),
    ("llama", "tp", TP, "ops"),
    ("llama", "tp", {**TP, "sequence_parallel": True}, "blocks"),
    ("llama", "pipeline", {"pp": 2, "microbatches": 2}, "blocks"),
    ("gpt2", "zero3", {}, "ops"),
    ("gpt2", "tp", TP, "blocks"),
    ("gpt2", "pipeline", {"pp": 2, "microbatches": 2}, "ops"),
    ("qwen3", "ddp", {}, "blocks"),
    ("qwen3", "zero3", {}, "blocks:2"),
    ("qwen3", "tp", {**TP, "sequence_parallel": True}, "ops"),
    ("qwen3", "pipeline", {"pp": 2, "microbatches": 2, "schedule": "gpipe"}, "blocks"),
    ("nanogpt", "pipeline", {"pp": 2, "microbatches": 2}, "blocks"),  # fx's traced route (the HF models take the nested one)
]
CELLS_4 = [
    ("llama", "hsdp", {"replicate": 2, "shard": 2}, "blocks"),
    ("llama", "pipeline", {"pp": 2, "tp": 2, "sequence_parallel": True}, "blocks"),
    ("gpt2", "pipeline", {"pp": 2, "tp": 2}, "ops"),
]


def _worker(cells: list[tuple[Any, ...]]) -> list[Any]:
    return [(train(n, s, o, "off"), train(n, s, o, ac)) for n, s, o, ac in cells]


@pytest.fixture(scope="module")
def two() -> list[Any]:
    return launch(_worker, CELLS_2, nproc=2, threads_per_proc=1, timeout=600)[0]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def four() -> list[Any]:
    return launch(_worker, CELLS_4, nproc=4, threads_per_proc=1, timeout=600)[0]  # type: ignore[no-any-return]


def _assert_same(cell: tuple[Any, ...], off: Any, on: Any) -> None:
    (summary_off, plain), (summary_on, recomputed) = off, on
    blocks = "model.layers" if cell[0] in ("llama", "qwen3") else "transformer.h"
    every = int(cell[3].partition(":")[2] or 1)
    assert summary_off["recomputed"] == [], cell
    assert summary_on["recomputed"] == [f"{blocks}.{i}" for i in range(0, 4, every)], f"{cell}: blocks recomputed {summary_on['recomputed']}"
    assert plain is not None and recomputed is not None
    assert set(plain) == set(recomputed), f"{cell}: state names differ with activation checkpointing"
    diff = harness.max_difference(recomputed, plain)
    assert diff <= 1e-12, f"{cell}: activation checkpointing changed the trained weights by {diff:.3g}"
    moved = harness.max_difference(plain, build(cell[0]).state_dict(), integers=False)
    assert moved > 1e-4, f"{cell}: training did not move the weights"


@pytest.mark.parametrize("name,ac", [("llama", "blocks"), ("gpt2", "ops"), ("qwen3", "blocks:2")])
def test_single_trains_the_same_weights_with_activation_checkpointing(name: str, ac: str) -> None:
    _assert_same((name, "single", {}, ac), train(name, "single", {}, "off"), train(name, "single", {}, ac))


@pytest.mark.parametrize("i", range(len(CELLS_2)), ids=[f"{c[0]}-{c[1]}{'-sp' if c[2].get('sequence_parallel') else ''}-{c[3]}" for c in CELLS_2])
def test_two_process_strategies_train_the_same_weights_with_activation_checkpointing(two: list[Any], i: int) -> None:
    _assert_same(CELLS_2[i], *two[i])


@pytest.mark.parametrize("i", range(len(CELLS_4)), ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CELLS_4])
def test_hsdp_and_pp_x_tp_train_the_same_weights_with_activation_checkpointing(four: list[Any], i: int) -> None:
    _assert_same(CELLS_4[i], *four[i])
