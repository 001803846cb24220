"""Issue 40's two pipeline cells. A nanoGPT written as Karpathy writes it (``forward(idx, targets)``
returning ``(logits, loss)``, an assert torch.fx cannot trace, ``training_step`` calling ``self(x, y)``)
under GPipe and 1F1B: the targets reach the last stage and the model's own forward computes the loss
there; and Qwen2 with sliding and full attention alternating by layer (``config.layer_types``) under
1F1B with a stage boundary after block 0, so the second stage's blocks sit at odd positions: each
block keeps its own mask kind. Both equal to ``single`` within 1e-9 after 5 clipped float64 steps (one
2-process launch). And the refusals of a training_step the pipeline cannot run, with their reasons."""

from __future__ import annotations

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.strategies.pipeline.own_step import probe_call
from tests.support import harness, zoo

pytest.importorskip("transformers", reason="the model tests need transformers: pip install -e '.[dev]'")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

GPIPE = {"pp": 2, "schedule": "gpipe", "microbatches": 2}
ONE_F_ONE_B = {"pp": 2, "schedule": "1f1b", "microbatches": 4}
CELLS = [
    ("nanogpt_targets", "pipeline", GPIPE),
    ("nanogpt_targets", "pipeline", ONE_F_ONE_B),
    ("qwen2_alt", "pipeline", {**ONE_F_ONE_B, "split_points": ("model.layers.1",)}),
]


@pytest.fixture(scope="module")
def results():
    return harness.run_cells(CELLS, nproc=2)


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"{c[0]}-{c[2]['schedule']}")
def test_cell_matches_single(results, cell):
    _, state = harness.result(results, cell)
    ref = harness.reference(cell[0])
    diff = harness.max_difference(state, ref)
    assert diff <= harness.TOL, f"{cell[0]} {cell[2]}: {diff:.3g} off single"
    assert harness.max_difference(ref, zoo.build(cell[0]).state_dict(), integers=False) > 1e-4  # training moved it


def test_the_per_layer_pattern_is_what_the_cell_tests():
    model = zoo.build("qwen2_alt")
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert model.config.sliding_window < zoo.SEQ  # the two kinds of mask differ on these sequences


class _Shifted(zoo.NanoGPTTargets):
    def training_step(self, batch):
        x, y = batch
        _, loss = self(x, y.roll(1, dims=1))  # a tensor computed in the step: not an element of the batch
        return loss


class _NoCall(zoo.NanoGPTTargets):
    def training_step(self, batch):
        return self.lm_head.weight.sum()


def test_how_training_step_calls_the_model_is_read_from_the_batch():
    b = zoo.batch("nanogpt_targets", 2)
    call = probe_call(zoo.build("nanogpt_targets"), b)
    assert call.args == (("batch", 0), ("batch", 1)) and not call.kwargs
    args, _ = call.bind(b)
    assert args[0] is b[0] and args[1] is b[1]


def test_a_call_with_a_tensor_computed_in_training_step_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"training_step calls the model with a tensor that is not an element of the batch \(shape \(2, 16\)"):
        probe_call(_Shifted(), zoo.batch("nanogpt_targets", 2))


def test_a_training_step_that_never_calls_the_model_is_refused():
    with pytest.raises(ConfigError, match=r"training_step returned without calling the model"):
        probe_call(_NoCall(), zoo.batch("nanogpt_targets", 2))


def test_the_model_is_untraceable_so_the_block_list_split_is_proven_on_the_first_batch():
    from shardwise.strategies.pipeline import Pipeline

    with pytest.raises(ConfigError, match="torch.fx cannot trace its forward"):
        Pipeline(**GPIPE).route(zoo.build("nanogpt_targets"))


def _gemma3n():
    import transformers as tf

    cfg = tf.Gemma3nTextConfig(
        vocab_size=zoo.VOCAB,
        vocab_size_per_layer_input=zoo.VOCAB,
        hidden_size=32,
        hidden_size_per_layer_input=8,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=0,
        laurel_rank=4,
        activation_sparsity_pattern=[0.0] * 4,
        attn_implementation="eager",
        use_cache=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return tf.Gemma3nForCausalLM(cfg).double()


def test_per_layer_input_embeddings_are_refused_before_launch_by_the_proof():
    """Gemma3n feeds embeddings of the tokens to every block (per-layer inputs), which a stage boundary
    does not carry: the float64 proof of a transformers model's split on the Trainer's sample refuses it
    in the parent, naming the module (it used to fail inside the workers)."""
    from shardwise.strategies.pipeline import Pipeline

    model = _gemma3n()
    with pytest.raises(ConfigError, match=r"stage 0 raises ConfigError: the pipeline took model\.embed_tokens_per_layer .*per-layer input"):
        Pipeline(**ONE_F_ONE_B).check_sample(model, zoo.batch("llama", 2), None)
