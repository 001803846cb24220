"""What the planner reads from a model: parameters, FLOPs and activations, checked by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from shardwise.strategies.cost.model_spec import measured_spec, transformer_spec


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
    from shardwise.strategies.cost.saved import SavedBytes

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
    from shardwise.strategies.cost.model_spec import from_hf_config

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


class _Block(nn.Module):
    """A gated MLP block whose two colwise linears read two norms of the input (as a cross-attention's
    q and k/v read two tensors), with a norm after the residual: ln2(x + proj(gelu(fc(ln1 x)) * gate(lnb x)))."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.ln1, self.lnb, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h), nn.LayerNorm(h)
        self.fc, self.gate, self.proj = nn.Linear(h, 4 * h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.ln1(x), self.lnb(x)
        return self.ln2(x + self.proj(nn.functional.gelu(self.fc(a)) * self.gate(b)))


class _Net(nn.Module):
    def __init__(self, h: int, v: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(h), _Block(h)])
        self.head = nn.Linear(h, v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_tensor_parallelism_splits_only_what_is_saved_between_the_colwise_and_the_rowwise_linear() -> None:
    """Per block and sample (fp32), whole on every tp rank: the input and ln2's (with the three
    norms' mean and rstd, 2 s each), fc's input and gate's (saved after fc's output, still whole);
    split: gelu's input, the product's two operands and proj's input (4 s h each). Outside the
    blocks: the head's input and what the loss keeps (log-softmax's output, s v)."""
    s, h, v, samples = 6, 8, 5, 3
    model = _Net(h, v)
    example = torch.randn(samples, s, h)
    plan = {f"blocks.{i}.{n}": "colwise" for i in range(2) for n in ("fc", "gate")} | {f"blocks.{i}.proj": "rowwise" for i in range(2)}
    spec = measured_spec("net", model, example, samples, tp_plan=plan, loss=lambda out: torch.log_softmax(out, -1).mean())
    split = 16 * s * h * 4
    whole = (4 * s * h + 6 * s) * 4
    assert spec.act_bytes_tp_split_per_layer_sample == split
    # tp splits fc's and gate's weights and biases and proj's weight; proj's bias, the norms and the head stay whole
    per_block = 2 * (h * 4 * h + 4 * h) + 4 * h * h
    assert spec.tp_split_params == 2 * per_block and spec.tp_rank_params(2) == spec.params - per_block
    assert spec.act_bytes_per_layer_sample == split + whole
    assert spec.act_bytes_other_sample == (s * h + s * v) * 4
    assert spec.layer_activation_bytes(samples, tp=2) == (whole + split / 2) * samples
    # sequence parallelism splits the rest along the sequence; fp16 halves both parts
    assert spec.layer_activation_bytes(samples, tp=2, sequence_parallel=True) == (whole + split) / 2 * samples
    assert spec.with_act_bytes(2).act_bytes_tp_split_per_layer_sample == split / 2
    # without a plan, nothing is known to stay whole: tp splits it all (and no loss: the output is summed)
    bare = measured_spec("net", model, example, samples)
    assert bare.act_bytes_tp_split_per_layer_sample is None and bare.act_bytes_other_sample == s * h * 4
    assert bare.tp_split_params is None and bare.tp_rank_params(2) == bare.params / 2
    assert bare.layer_activation_bytes(samples, tp=2) == (whole + split) / 2 * samples


def test_the_planned_charlm_keeps_its_norms_and_the_split_linears_inputs_whole() -> None:
    """The recipe's own tp plan (q, k, v, fc colwise; proj rowwise): about 4 of its 16 s h tensors a
    block stay whole (the two norms' inputs and outputs), and the loss's log-softmax is counted."""
    from shardwise.tools.advisor.models import recipe_model

    spec = recipe_model("charlm").spec
    sh = spec.seq * spec.hidden * 4
    assert spec.act_bytes_tp_split_per_layer_sample is not None
    assert spec.act_bytes_tp_split_per_layer_sample / sh == pytest.approx(12, abs=0.1)
    assert (spec.act_bytes_per_layer_sample - spec.act_bytes_tp_split_per_layer_sample) / sh == pytest.approx(4, abs=0.1)
    assert spec.act_bytes_other_sample >= spec.seq * (2 * spec.hidden + spec.vocab) * 4  # the head's norm and linear inputs, log-softmax
