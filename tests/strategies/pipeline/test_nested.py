"""Pipeline cells beyond tests/strategies/pipeline/test_matrix_pipeline.py (which runs the five models under the
three schedules): other transformers families (Mistral, Qwen2 with tied embeddings, GPT-NeoX, Phi,
OPT, whose final norm is declared before its layers) under 1f1b, equal to ``single`` within 1e-9
after 5 clipped float64 steps; ResNet exact with one micro-batch (BatchNorm buffers included);
``layers=`` and ``split_points=`` from the user; nanoGPT's tied weight resumed bit for bit; tied
pipeline checkpoints that hold single's keys, load into a fresh model with strict=True and ties
intact, and export to a file transformers' ``from_pretrained`` loads tied. One 2-process launch.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from shardwise import launch
from shardwise.errors import ConfigError
from shardwise.strategies.pipeline import Pipeline
from tests.support import harness, zoo

pytest.importorskip("transformers", reason="the model tests need transformers: pip install -e '.[dev]'")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

TIED = ("gpt2", "nanogpt")
SCHEDULES = {
    "gpipe": {"pp": 2, "schedule": "gpipe"},
    "1f1b": {"pp": 2, "schedule": "1f1b"},
    "interleaved": {"pp": 2, "schedule": "interleaved", "virtual_stages": 2},
}
FAMILIES = ("mistral", "qwen2", "neox", "phi", "opt")


def family(name: str) -> torch.nn.Module:
    """A small float64 causal LM of another transformers family (4 layers, seed 0)."""
    import transformers as tf

    torch.manual_seed(0)
    c: dict[str, Any] = dict(
        vocab_size=zoo.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=zoo.SEQ,
        attn_implementation="eager",
    )
    if name == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, tie_word_embeddings=False, **c))
    elif name == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **c))
    elif name == "neox":
        model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**c))
    elif name == "phi":
        model = tf.PhiForCausalLM(tf.PhiConfig(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **c))
    else:  # OPT declares its final norm before its layers (the forward runs it after them)
        model = tf.OPTForCausalLM(
            tf.OPTConfig(
                vocab_size=zoo.VOCAB,
                hidden_size=32,
                ffn_dim=64,
                num_hidden_layers=4,
                num_attention_heads=4,
                max_position_embeddings=zoo.SEQ,
                dropout=0.0,
                attention_dropout=0.0,
                word_embed_proj_dim=32,
                attn_implementation="eager",
            )
        )
    return model.double()


def train_family(name: str, strategy: str = "single", options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    model = family(name)
    t = harness.trainer("llama", strategy, options)  # Llama's float64 causal-LM loss and data fit every causal LM
    data = zoo.dataset("llama", harness.SAMPLES)
    t._check(model, data)
    _, state = t._fit(model, data, None, return_state=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()} if strategy == "single" else state


def _worker(root: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name in TIED:  # 5 steps with a checkpoint at step 3; nanoGPT also resumed from it (GPT-2's resume: the matrix file)
        out[(name, "1f1b")] = harness.train(name, "pipeline", SCHEDULES["1f1b"], out=os.path.join(root, name), checkpoint_every=3)
    step3 = os.path.join(root, "nanogpt", "checkpoints", "step-00000003")
    out[("nanogpt", "resumed")] = harness.train("nanogpt", "pipeline", SCHEDULES["1f1b"], out=os.path.join(root, "nanogpt-r"), resume=step3)
    out[("resnet", "gpipe")] = harness.train("resnet", "pipeline", {"pp": 2, "schedule": "gpipe", "microbatches": 1})
    out[("nanogpt", "layers")] = harness.train("nanogpt", "pipeline", {**SCHEDULES["gpipe"], "layers": "transformer.h", "split_points": ["transformer.h.1"]})
    for name in FAMILIES:
        out[(name, "family")] = train_family(name, "pipeline", SCHEDULES["1f1b"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[Any, Any], str]:
    root = str(tmp_path_factory.mktemp("pipeline_nested"))
    return launch(_worker, root, nproc=2, threads_per_proc=1, timeout=600)[0], root


def test_user_layers_and_split_points_give_an_uneven_split_equal_to_single(runs: tuple[dict[Any, Any], str]) -> None:
    summary, state = runs[0][("nanogpt", "layers")]
    assert summary["pipeline"]["stage_layers"] == [["transformer.h.0"], ["transformer.h.1", "transformer.h.2", "transformer.h.3"]]
    harness.assert_matches_single("nanogpt", state, what="pipeline layers=transformer.h")


@pytest.mark.parametrize("name", TIED)
def test_a_tied_pipeline_checkpoint_has_singles_keys_and_loads_tied(runs: tuple[dict[Any, Any], str], name: str) -> None:
    summary, uninterrupted = runs[0][(name, "1f1b")]
    harness.assert_matches_single(name, uninterrupted, what="pipeline 1f1b")
    assert summary["pipeline"]["stage_layers"] == [[f"transformer.h.{i}" for i in (0, 1)], [f"transformer.h.{i}" for i in (2, 3)]]
    assert list(uninterrupted) == list(zoo.build(name).state_dict()), "the checkpoint's keys are not single's, in single's order"
    assert torch.equal(uninterrupted["lm_head.weight"], uninterrupted["transformer.wte.weight"])
    if name == "nanogpt":
        resumed = runs[0][(name, "resumed")][1]
        for k, v in uninterrupted.items():
            assert torch.equal(resumed[k], v), f"{name}: {k} differs after resume"
    # the step-3 checkpoint (written by the pipeline) loads into a fresh model, ties intact
    from shardwise.checkpoint import load_file, load_shared

    step3 = os.path.join(runs[1], name, "checkpoints", "step-00000003")
    assert "model" not in load_file(os.path.join(step3, "state.pt")), "no rank gathers the whole model to save it: each writes its part"
    saved = load_shared(step3)["model"]  # a pipeline writes its model in parts
    fresh = zoo.build(name, seed=1)
    fresh.load_state_dict(saved, strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(fresh.lm_head.weight, saved["transformer.wte.weight"])
    single3 = harness.train(name, max_steps=3)[1]
    assert harness.max_difference(saved, single3) <= harness.TOL


def test_a_tied_pipeline_checkpoint_exports_to_a_file_transformers_loads_tied(runs: tuple[dict[Any, Any], str], tmp_path: Any) -> None:
    pytest.importorskip("safetensors")
    import transformers as tf

    from shardwise.checkpoint import export_safetensors

    export_safetensors(os.path.join(runs[1], "gpt2", "checkpoints", "step-00000003"), tmp_path / "model.safetensors")
    zoo.build("gpt2").config.save_pretrained(tmp_path)
    loaded = tf.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float64)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert harness.max_difference(loaded.state_dict(), harness.train("gpt2", max_steps=3)[1]) <= harness.TOL


def test_resnet_trains_exactly_with_one_microbatch_and_is_refused_with_more(runs: tuple[dict[Any, Any], str]) -> None:
    harness.assert_matches_single("resnet", runs[0][("resnet", "gpipe")][1], what="pipeline gpipe microbatches=1")
    with pytest.raises(ConfigError, match=r"ResNetForImageClassification has BatchNorm layers .* micro-batch statistics"):
        harness.trainer("resnet", "pipeline", {"pp": 2, "schedule": "1f1b"}, nproc=2).fit(zoo.build("resnet"), zoo.dataset("resnet", 16))


@pytest.mark.parametrize("name", FAMILIES)
def test_other_causal_lm_families_match_single(runs: tuple[dict[Any, Any], str], name: str) -> None:
    diff = harness.max_difference(runs[0][(name, "family")], train_family(name))
    assert diff <= harness.TOL, f"{name}: {diff:.3g}"


def test_what_cannot_be_split_is_refused_before_launch() -> None:
    llama = zoo.build("llama")
    with pytest.raises(ConfigError, match=r"layers='model.nope' is not a module of LlamaForCausalLM; its module lists are \['model.layers'\]"):
        Pipeline(pp=2, layers="model.nope").plan(2, model=llama)
    with pytest.raises(ConfigError, match=r"has 4 blocks in model.layers but the pipeline needs 8 stages"):
        Pipeline(pp=2, schedule="interleaved", virtual_stages=4, microbatches=4).plan(2, model=llama)
    with pytest.raises(ConfigError, match=r"ties lm_head.weight to transformer.wte.weight.*dp_strategy='ddp'"):
        Pipeline(pp=2, dp_strategy="fsdp").plan(4, model=zoo.build("nanogpt"))
    with pytest.raises(ConfigError, match="pipeline needs 8 stages"):  # through the Trainer: in the parent, no process started
        harness.trainer("llama", "pipeline", {"pp": 2, "schedule": "interleaved", "virtual_stages": 4, "microbatches": 4}, nproc=2).fit(
            llama, zoo.dataset("llama", 16)
        )
