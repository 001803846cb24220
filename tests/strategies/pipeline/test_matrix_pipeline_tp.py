"""The pp x tp cells of the model matrix: HF Llama, HF GPT-2 (tied, fused Conv1D q|k|v), the
nanoGPT-style GPT (tied, ModuleDict), BERT and ViT under pipeline pp=2 x tp=2 (4 processes, 1f1b),
each stage split by tensor parallelism with the model's own plan or the automatic one, equal to
``single`` within 1e-9 after 5 clipped SGD steps in float64. Llama, nanoGPT and ViT run with
sequence parallelism (norm gradients summed over tp by role), GPT-2 and BERT without.

GPT-2's fused c_attn is permuted in the run (each tp rank's shard holds whole heads): its pipeline
checkpoint holds the model's own layout (equal to single's after 3 steps, loads into the HF class
with strict=True, tied), and a run resumed from it goes on bit for bit.

The hidden states crossing the stage boundary are in the recorder: each tp rank of the first
stage sends its whole copy of every micro-batch's activation to its peer on the second stage
and receives the gradient back, the bytes of the unsplit model's hidden states after the
first stage's last block.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from shardwise import launch
from shardwise.data.batches import call_model
from tests.support import harness, zoo

pytest.importorskip("transformers", reason="the model tests need transformers: pip install -e '.[dev]'")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

SP = {"llama": True, "gpt2": False, "nanogpt": True, "bert": False, "vit": True}


def _opts(name: str) -> dict[str, Any]:
    return {"pp": 2, "tp": 2, "schedule": "1f1b", "sequence_parallel": SP[name]}


def _worker(root: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name in SP:
        extra = {"out": os.path.join(root, name), "checkpoint_every": 3} if name == "gpt2" else {}
        out[name] = harness.train(name, "pipeline", _opts(name), **extra)
    step3 = os.path.join(root, "gpt2", "checkpoints", "step-00000003")
    out["gpt2 resumed"] = harness.train("gpt2", "pipeline", _opts("gpt2"), out=os.path.join(root, "gpt2-r"), resume=step3)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[Any, Any], str]:
    root = str(tmp_path_factory.mktemp("pipeline_tp_matrix"))
    return launch(_worker, root, nproc=4, threads_per_proc=1, timeout=600)[0], root


@pytest.mark.parametrize("name", list(SP))
def test_pp2_x_tp2_matches_single(runs: tuple[dict[Any, Any], str], name: str) -> None:
    summary, state = runs[0][name]
    harness.assert_matches_single(name, state, what=f"pp2 x tp2{' + sp' if SP[name] else ''}")
    assert summary["world_size"] == 4 and summary["pipeline"]["pp"] == 2
    assert summary["pipeline"]["tp"] == 2 and summary["pipeline"]["dp"] == 1 and summary["pipeline"]["sequence_parallel"] == SP[name]
    if name in ("gpt2", "nanogpt"):  # the tied head and embedding, on different stages, are still one weight
        assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


def test_a_pp_x_tp_checkpoint_of_gpt2_is_in_the_models_layout_and_resumes_bit_exact(runs: tuple[dict[Any, Any], str]) -> None:
    from shardwise.checkpoint import load_shared

    uninterrupted, resumed = runs[0]["gpt2"][1], runs[0]["gpt2 resumed"][1]
    for k, v in uninterrupted.items():
        assert torch.equal(resumed[k], v), f"gpt2: {k} differs after resume"
    saved = load_shared(os.path.join(runs[1], "gpt2", "checkpoints", "step-00000003"))["model"]  # written in parts, one per pipeline rank
    assert harness.max_difference(saved, harness.train("gpt2", max_steps=3)[1]) <= harness.TOL  # c_attn not permuted
    model = zoo.build("gpt2", seed=1)
    model.load_state_dict(saved, strict=True)
    assert model.lm_head.weight is model.transformer.wte.weight


def boundary_bytes(name: str, block: str, rows: int) -> int:
    """Bytes of the hidden states ``block`` outputs for ``rows`` samples, as the unsplit float64 model computes them."""
    model = zoo.build(name).eval()
    seen: list[torch.Tensor] = []
    handle = model.get_submodule(block).register_forward_hook(lambda mod, args, out: seen.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        call_model(model, zoo.batch(name, rows))
    handle.remove()
    return seen[0].numel() * seen[0].element_size()


@pytest.mark.parametrize("name", list(SP))
def test_stage_to_stage_bytes_under_pp2_x_tp2_are_the_hidden_states(runs: tuple[dict[Any, Any], str], name: str) -> None:
    """Rank 0 is tp rank 0 of the first stage: per step it sends microbatches (2) x an activation of
    GLOBAL_BATCH / 2 rows (dp is 1) and receives as many gradient bytes: the whole hidden states of
    the step's batch each way, sequence parallel or not (the stage ends on the gathered sequence)."""
    summary, _ = runs[0][name]
    block = summary["pipeline"]["stage_layers"][0][-1]
    per_step = boundary_bytes(name, block, harness.GLOBAL_BATCH)
    send, recv = summary["comm"]["by_op"]["pp/send"], summary["comm"]["by_op"]["pp/recv"]
    assert send["sent_bytes"] == harness.STEPS * per_step, (name, block, send, per_step)
    assert recv["received_bytes"] == harness.STEPS * per_step, (name, block, recv, per_step)
    assert send["count"] == recv["count"] == harness.STEPS * summary["pipeline"]["microbatches"]
