"""DDP equals the single-process reference; gradient sync happens once per step."""

from __future__ import annotations

import pytest
import torch

from shardwise import Trainer
from tests.support.models import WithTrainingStep, accuracy, adam, ce, classification, max_diff, mlp, params

pytestmark = pytest.mark.dist

# timeout_s: a collective that hangs fails with its rank and operation named, well before the
# test's own 180 s limit (the Trainer's default, 300 s, would let the test limit fire first, silently).
COMMON = dict(precision="64", global_batch_size=16, accumulate=2, max_steps=10, log_every=5, progress_bar=False, timeout_s=90)


def _fit(strategy: str, nproc: int, *, clip: float | None = 0.05, model=None, loss=ce, val=None):
    model = model if model is not None else mlp()
    trainer = Trainer(
        strategy=strategy, nproc=nproc, clip_grad_norm=clip, optimizer=adam, loss_fn=loss, metrics={"accuracy": accuracy} if loss else None, **COMMON
    )
    summary = trainer.fit(model, classification(), val)
    return params(model), summary


def test_ddp_at_world_size_two_equals_single_with_accumulation_and_clipping():
    ref, ref_summary = _fit("single", 1)
    ddp, summary = _fit("ddp", 2)
    assert max_diff(ref, ddp) < 1e-10
    assert abs(ref_summary["train_loss"] - summary["train_loss"]) < 1e-10
    # Clipping was active: without it the parameters differ.
    unclipped, _ = _fit("single", 1, clip=None)
    assert max_diff(ref, unclipped) > 1e-4
    # Accumulation 2: the second micro-batch alone syncs, so one bucket allreduce per step.
    assert summary["comm"]["by_op"]["dp/all_reduce"]["count"] == 10
    n_bytes = sum(p.numel() for p in mlp().parameters()) * 8
    assert summary["comm"]["by_op"]["dp/all_reduce"]["payload_bytes"] == 10 * n_bytes
    assert summary["world_size"] == 2 and summary["samples"] == 160 and summary["strategy"] == "ddp"


def test_training_step_method_goes_through_ddp_and_matches():
    ref, _ = _fit("single", 1, clip=None, model=WithTrainingStep(), loss=None)
    ddp, summary = _fit("ddp", 2, clip=None, model=WithTrainingStep(), loss=None)
    assert max_diff(ref, ddp) < 1e-10
    assert summary["comm"]["by_op"]["dp/all_reduce"]["count"] == 10  # the gradients did sync


def test_evaluation_counts_each_sample_once_at_an_odd_size():
    val = classification(n=37, seed=5)
    _, ref = _fit("single", 1, val=val)
    _, ddp = _fit("ddp", 2, val=val)
    assert ref["val_samples"] == ddp["val_samples"] == 37
    assert ddp["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-10)
    assert ddp["val_accuracy"] == pytest.approx(ref["val_accuracy"], abs=1e-12)
    # The reference value, computed here by hand over the 37 samples.
    model = mlp()
    _fit("single", 1, model=model)
    with torch.no_grad():
        x, y = val.tensors
        expected = torch.nn.functional.cross_entropy(model(x), y).item()
    assert ref["val_loss"] == pytest.approx(expected, abs=1e-12)
