"""Data-parallel checkpoints of real models: a zero3 (sharded) and a ddp checkpoint of GPT-2
(tied embeddings) resume bit for bit, and export to a safetensors file that transformers'
``from_pretrained`` loads back with its tie, equal to the run's weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise import launch
from shardwise.checkpoint import export_safetensors
from tests.support import harness, zoo

pytest.importorskip("transformers", reason="the model tests need transformers: pip install -e '.[dev]'")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]


def _worker(root: str) -> list:
    out = []
    for strategy in ("ddp", "zero3"):
        _, whole = harness.train("gpt2", strategy, out=f"{root}/{strategy}", checkpoint_every=3)
        _, resumed = harness.train("gpt2", strategy, out=f"{root}/{strategy}-resumed", resume=f"{root}/{strategy}/checkpoints/step-00000003")
        out.append((strategy, whole, resumed))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    return root, launch(_worker, str(root), nproc=2, threads_per_proc=1, timeout=300)[0]


def test_ddp_and_zero3_checkpoints_of_gpt2_resume_bit_for_bit(runs):
    _, results = runs
    for strategy, whole, resumed in results:
        assert set(whole) == set(resumed)
        for k, v in whole.items():
            assert torch.equal(v, resumed[k]), f"{strategy}: {k}"
        harness.assert_matches_single("gpt2", whole, what=strategy)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_the_export_loads_with_from_pretrained_tied(runs, tmp_path, strategy):
    transformers = pytest.importorskip("transformers")
    root, results = runs
    whole = dict((s, w) for s, w, _ in results)[strategy]
    model_dir = tmp_path / "export"
    model_dir.mkdir()
    export_safetensors(Path(root) / strategy / "checkpoints" / "step-00000005", model_dir / "model.safetensors")
    zoo.build("gpt2").config.save_pretrained(model_dir)  # the config next to the weights, as transformers expects
    loaded = transformers.GPT2LMHeadModel.from_pretrained(model_dir, torch_dtype=torch.float64)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    state = loaded.state_dict()
    for k, v in whole.items():
        assert torch.equal(state[k], v), k
    assert json.loads((model_dir / "config.json").read_text())["n_layer"] == 4
