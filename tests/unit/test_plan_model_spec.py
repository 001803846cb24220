"""What the planner reads from a model: parameters, FLOPs and activations, checked by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from shardwise.plan.model_spec import measured_spec, transformer_spec


def test_measured_spec_of_an_mlp_counts_its_matmuls() -> None:
    """Forward 2 w FLOPs per sample per weight matrix; backward 4 w, except the first layer's input gradient (2 w)."""
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    spec = measured_spec("mlp", model, torch.randn(8, 64), 8)
    w1, w2 = 64 * 32, 32 * 10
    assert spec.params == w1 + 32 + w2 + 10
    assert spec.flops_per_sample == 6 * (w1 + w2) - 2 * w1
    # activations: what autograd saves, 4 bytes an element: the first Linear's input (64 per sample)
    # and ReLU's output (32), which the second Linear saves too (one storage, counted once); the
    # logits are saved by nothing inside the model
    assert spec.layers == 2
    assert spec.act_bytes_per_layer_sample * spec.layers + spec.act_bytes_other_sample == (64 + 32) * 4
    half = measured_spec("mlp", model, torch.randn(8, 64), 8, act_bytes=2)
    assert half.act_bytes_per_layer_sample * half.layers + half.act_bytes_other_sample == (64 + 32) * 2


def test_saved_bytes_follow_what_autograd_still_holds() -> None:
    """The peak is what is alive at once: two graphs in turn, the first freed before the second."""
    from shardwise.plan.saved import SavedBytes

    w = nn.Parameter(torch.randn(16, 16))
    saved = SavedBytes([w])
    x = torch.randn(4, 16, requires_grad=True)
    for _ in range(2):
        with saved.hooks():
            y = torch.tanh(x @ w)  # saves x (weight excluded) and tanh's output
        y.sum().backward()
        del y
    assert saved.total == 4 * 16 * 4 + 2 * (4 * 16 * 4)  # x once (the same storage both times), a tanh output per graph
    assert saved.peak == 2 * (4 * 16 * 4)  # x and one tanh output alive at once, never both outputs


def test_transformer_flops_are_narayanan_eq_3() -> None:
    """Narayanan et al. 2021, eq. 3 (without recomputation, 72 in place of 96): 72 s L h^2 (1 + s/(6h) + V/(12 L h))."""
    s, layers, h, v = 128, 4, 256, 1000
    spec = transformer_spec("gpt", layers=layers, hidden=h, heads=4, vocab=v, seq=s)
    assert spec.flops_per_sample == pytest.approx(72 * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h)), rel=1e-12)


def test_parameter_tensors_are_counted_on_a_module_and_from_a_llama_config(tmp_path) -> None:
    """Per-tensor work (DDP's hooks, a codec's encode) scales with parameter tensors: a module's
    trainable ones are counted; a config's are its weights and norms, as the model builds them."""
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    model[0].bias.requires_grad_(False)  # frozen: no gradient, no per-tensor work
    assert measured_spec("mlp", model, torch.randn(8, 64), 8).tensors == 3
    transformers = pytest.importorskip("transformers")
    from shardwise.plan.model_spec import from_hf_config

    for tied in (False, True):
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied
        )
        path = tmp_path / f"llama-{tied}.json"
        config.to_json_file(str(path))
        built = transformers.LlamaForCausalLM(config)
        assert from_hf_config(path).tensors == len(list(built.parameters())) == 3 * 9 + (2 if tied else 3)
    # without a count, an estimate from the layers: 12 a transformer layer (GPT-2's) and 4 outside
    bare = transformer_spec("gpt", layers=2, hidden=64, heads=4, vocab=100, seq=16)
    assert replace(bare, tensors=0).parameter_tensors() == 28 and bare.parameter_tensors() == bare.tensors
