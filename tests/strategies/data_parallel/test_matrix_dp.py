"""The data-parallel cells of the model matrix: real models under ddp and ZeRO-1/2/3, equal to
``single`` within 1e-9 after 5 clipped SGD steps in float64; BatchNorm over the global batch
with ``sync_batchnorm`` (and a different model without it, with a warning)."""

from __future__ import annotations

import pytest
import torch

from tests.support import harness, zoo

pytest.importorskip("transformers", reason="the model tests need transformers: pip install -e '.[dev]'")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

TRANSFORMERS = ("llama", "gpt2", "bert", "vit", "nanogpt")
CELLS = (
    [(n, "ddp", {}) for n in TRANSFORMERS]
    + [(n, "zero3", {}) for n in TRANSFORMERS]
    + [(n, s, {}) for n in ("gpt2", "nanogpt") for s in ("zero1", "zero2")]  # tied embeddings
    + [("resnet", s, {}, {"sync_batchnorm": True}) for s in ("ddp", "zero3")]
    + [("resnet", "ddp", {})]
)


@pytest.fixture(scope="module")
def results():
    return harness.run_cells(CELLS, nproc=2)


@pytest.mark.parametrize("cell", [c for c in CELLS if c[0] != "resnet" or len(c) > 3], ids=lambda c: f"{c[0]}-{c[1]}" + ("-syncbn" if len(c) > 3 else ""))
def test_cell_matches_single(results, cell):
    summary, state = harness.result(results, cell)
    harness.assert_matches_single(cell[0], state, what=cell[1])
    assert summary["world_size"] == 2 and summary["steps"] == harness.STEPS


def test_tied_embeddings_stay_tied_in_the_consolidated_state(results):
    for name in ("gpt2", "nanogpt"):
        for strategy in ("ddp", "zero1", "zero2", "zero3"):
            _, state = harness.result(results, (name, strategy, {}))
            head = "lm_head.weight"
            embed = "transformer.wte.weight"
            assert torch.equal(state[head], state[embed]), f"{name} {strategy}: lm_head and wte differ after training"


def test_batchnorm_without_sync_is_a_different_model(results):
    """Per-rank statistics (4 samples each) are not the global batch's (8): the run differs from
    single by far more than rounding, which is why the Trainer warns and sync_batchnorm exists."""
    _, state = harness.result(results, ("resnet", "ddp", {}))
    assert harness.max_difference(state, harness.reference("resnet")) > 1e-4


def test_sync_batchnorm_all_reduces_statistics_once_per_layer_forward_and_backward(results):
    """Per step: one all-reduce of (sum x, sum x^2, count) per BatchNorm layer in forward, the same
    in backward, and ddp's one gradient all-reduce; bytes exactly those tensors' (float64)."""
    summary, _ = harness.result(results, ("resnet", "ddp", {}, {"sync_batchnorm": True}))
    model = zoo.build("resnet")
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    dp = summary["comm"]["by_op"]["dp/all_reduce"]
    assert dp["count"] == harness.STEPS * (2 * len(norms) + 1)
    stats_bytes = sum(2 * m.num_features + 1 for m in norms) * 8 * 2
    grad_bytes = sum(p.numel() for p in model.parameters()) * 8
    assert dp["payload_bytes"] == harness.STEPS * (stats_bytes + grad_bytes)


def test_unsynced_batchnorm_warning_names_the_fix():
    from shardwise.strategies.batchnorm import unsynced_batchnorm_warning

    message = unsynced_batchnorm_warning(zoo.build("resnet"), dp=2, micro_batch=4)
    assert message is not None and "sync_batchnorm=True" in message and "4 samples" in message
    assert unsynced_batchnorm_warning(zoo.build("resnet"), dp=1) is None
    assert unsynced_batchnorm_warning(zoo.build("llama"), dp=2) is None


def test_sync_batchnorm_under_local_sgd_is_refused_before_launch():
    from shardwise.errors import ConfigError

    with pytest.raises(ConfigError, match="sync_batchnorm=True needs replicas that take every step together"):
        harness.trainer("resnet", "local-sgd", nproc=2, sync_batchnorm=True).fit(zoo.build("resnet"), zoo.dataset("resnet", 16))
