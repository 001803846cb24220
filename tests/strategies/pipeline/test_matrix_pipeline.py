"""The pipeline cells of the model matrix: Hugging Face Llama, GPT-2 (tied), BERT, ViT and a
nanoGPT-style GPT (tied, a ModuleDict) split by their block lists under GPipe, 1F1B and
interleaved 1F1B, equal to ``single`` within 1e-9 after 5 clipped steps in float64; tied weights
kept one weight; the model's own loss with no loss_fn; evaluation; checkpoints that resume bit
for bit and load into the original model with its ties; and refusals that are true."""

from __future__ import annotations

import pytest
import torch

from shardwise import launch
from shardwise.errors import ConfigError
from tests.support import harness, zoo

pytest.importorskip("transformers", reason="the model tests need transformers: pip install -e '.[dev]'")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(500)]

MODELS = ("llama", "gpt2", "bert", "vit", "nanogpt")
SCHEDULES = {
    "gpipe": {"pp": 2, "schedule": "gpipe", "microbatches": 2},
    "1f1b": {"pp": 2, "schedule": "1f1b", "microbatches": 4},
    "interleaved": {"pp": 2, "schedule": "interleaved", "microbatches": 2},  # 4 stages of one block
}
CELLS = [(n, "pipeline", opts) for opts in SCHEDULES.values() for n in MODELS]
OWN_LOSS = [(n, "pipeline", SCHEDULES["1f1b"], {"own_loss": True}) for n in ("llama", "bert")]


@pytest.fixture(scope="module")
def results():
    return harness.run_cells(CELLS + OWN_LOSS, nproc=2)


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"{c[0]}-{c[2]['schedule']}")
def test_cell_matches_single(results, cell):
    summary, state = harness.result(results, cell)
    harness.assert_matches_single(cell[0], state, what=f"pipeline {cell[2]['schedule']}")
    section = summary["pipeline"]
    assert len(section["stage_layers"]) == cell[2]["pp"] * (2 if cell[2]["schedule"] == "interleaved" else 1)


@pytest.mark.parametrize("name", ["gpt2", "nanogpt"])
def test_weights_tied_across_stages_stay_one_weight(results, name):
    for opts in SCHEDULES.values():
        _, state = harness.result(results, (name, "pipeline", opts))
        assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"]), opts["schedule"]


@pytest.mark.parametrize("cell", OWN_LOSS, ids=lambda c: c[0])
def test_the_models_own_loss_trains_with_no_loss_fn(results, cell):
    """No loss_fn: the last stage takes the loss the model computes from the batch's labels.
    (transformers computes a causal LM's loss in float32, hence Llama's looser tolerance.)"""
    _, state = harness.result(results, cell)
    tol = 1e-6 if cell[0] == "llama" else harness.TOL
    harness.assert_matches_single(cell[0], state, tol=tol, what="own loss", own_loss=True)


def _resume_worker(root: str) -> list[dict]:
    """gpt2 under 1f1b: 5 steps with a checkpoint at 3, then a resume from it to 5; and
    evaluation through the pipeline."""
    opts = SCHEDULES["1f1b"]
    full, full_state = harness.train("gpt2", "pipeline", opts, out=f"{root}/a", checkpoint_every=3, val=8)
    _, resumed_state = harness.train("gpt2", "pipeline", opts, out=f"{root}/b", resume=f"{root}/a/checkpoints/step-00000003")
    return [full, full_state, resumed_state]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    out = launch(_resume_worker, str(root), nproc=2, threads_per_proc=1, timeout=300)[0]
    return root, out


def test_a_tied_checkpoint_resumes_bit_for_bit_and_loads_into_the_hf_model(resumed):
    root, (summary, full_state, resumed_state) = resumed
    for k, v in full_state.items():
        assert torch.equal(v, resumed_state[k]), k
    fresh = zoo.build("gpt2")
    fresh.load_state_dict(full_state, strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # the model's own tie survives the load
    assert torch.equal(fresh.lm_head.weight, full_state["transformer.wte.weight"])


def test_evaluation_through_the_pipeline_equals_single(resumed):
    _, (summary, _, _) = resumed
    single, _ = harness.train("gpt2", val=8)
    assert summary["val_samples"] == single["val_samples"] == 8
    assert abs(summary["val_loss"] - single["val_loss"]) < 1e-12


def test_batchnorm_models_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="BatchNorm.*micro-batch statistics"):
        harness.trainer("resnet", "pipeline", SCHEDULES["gpipe"], nproc=2).fit(zoo.build("resnet"), zoo.dataset("resnet", 16))


def test_too_few_blocks_for_the_stages_is_refused_naming_the_block_list():
    model = zoo.build("llama", layers=2)
    with pytest.raises(ConfigError, match=r"has 2 blocks in model\.layers but the pipeline needs 4 stages"):
        harness.trainer("llama", "pipeline", SCHEDULES["interleaved"], nproc=2).fit(model, zoo.dataset("llama", 16))


def test_a_layers_path_that_is_not_a_module_list_is_refused():
    with pytest.raises(ConfigError, match="layers='transformer.wte'.*not an nn.ModuleList"):
        harness.trainer("gpt2", "pipeline", dict(SCHEDULES["gpipe"], layers="transformer.wte"), nproc=2).fit(zoo.build("gpt2"), zoo.dataset("gpt2", 16))
