"""Exact resume: N steps, a new process resuming, N more == 2N uninterrupted, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise import Trainer, launch
from tests.support.models import adam, ce, classification, mlp, params, step_lr

pytestmark = pytest.mark.dist

# 100 samples in global batches of 16: 6 steps an epoch, so step 8 is in the middle of epoch 1.
N = 8


def _trainer(strategy: str, nproc: int, out: Path, max_steps: int, resume: str | None, precision: str = "32") -> Trainer:
    return Trainer(
        strategy=strategy,
        nproc=nproc,
        precision=precision,
        global_batch_size=16,
        accumulate=2,
        max_steps=max_steps,
        clip_grad_norm=1.0,
        optimizer=adam,
        loss_fn=ce,
        lr_scheduler=step_lr,
        out=str(out),
        checkpoint_every=4,
        resume=resume,
        deterministic=True,
        log_every=4,
        progress_bar=False,
        timeout_s=60,  # a hung collective fails with its name, before the test's own 180 s limit
    )


def _fit(strategy: str, nproc: int, out: Path, max_steps: int, resume: str | None, precision: str = "32"):
    # Dropout draws from the RNG each step: a resume that lost the RNG state would differ.
    model = mlp(dropout=0.2, dtype=torch.float32)
    summary = _trainer(strategy, nproc, out, max_steps, resume, precision).fit(model, classification(100, dtype=torch.float32))
    return params(model), summary


def _fit_in_new_process(*args):
    return launch(_fit, *args, nproc=1, timeout=150)[0]  # below the test's 180 s: a hang is reported with its ranks


def _check_exact_resume(tmp_path: Path, strategy: str, nproc: int, precision: str = "32") -> None:
    run = _fit if nproc > 1 else _fit_in_new_process  # nproc > 1: fit starts new processes itself
    full, full_summary = run(strategy, nproc, tmp_path / "full", 2 * N, None, precision)
    first, first_summary = run(strategy, nproc, tmp_path / "split", N, None, precision)
    assert first_summary["steps"] == N
    manifest = json.loads((tmp_path / "split/checkpoints/step-00000008/manifest.json").read_text())
    assert manifest["step"] == N and manifest["world_size"] == nproc
    resumed, summary = run(strategy, nproc, tmp_path / "split", 2 * N, "auto", precision)
    assert summary["resumed_from"].endswith("step-00000008") and summary["steps"] == 2 * N
    assert summary["steps_this_run"] == N and summary["samples"] == 2 * N * 16
    for name in full:
        assert torch.equal(full[name], resumed[name]), f"{name} differs after resume"
    assert summary["train_loss"] == full_summary["train_loss"]
    assert not torch.equal(first["0.weight"], resumed["0.weight"])


def test_single_resumes_exactly_mid_epoch(tmp_path):
    _check_exact_resume(tmp_path, "single", 1)


def test_ddp_resumes_exactly_mid_epoch(tmp_path):
    _check_exact_resume(tmp_path, "ddp", 2)


def test_fp16_with_its_grad_scaler_resumes_exactly(tmp_path):
    _check_exact_resume(tmp_path, "single", 1, precision="16-mixed")


def test_auto_resume_skips_a_damaged_newest_checkpoint(tmp_path, capfd):
    full, _ = _fit_in_new_process("single", 1, tmp_path / "full", 2 * N, None)
    _fit_in_new_process("single", 1, tmp_path / "split", N, None)
    newest = tmp_path / "split/checkpoints/step-00000008/state.pt"
    newest.write_bytes(newest.read_bytes()[:-10])  # torn after writing
    capfd.readouterr()
    resumed, summary = _fit("single", 1, tmp_path / "split", 2 * N, "auto")
    # said as a line of the run (rank 0), not as a Python warning pointing into shardwise's source
    assert "shardwise: resume='auto': skipping damaged checkpoint" in capfd.readouterr().out
    assert summary["resumed_from"].endswith("step-00000004")
    for name in full:
        assert torch.equal(full[name], resumed[name])


def test_resume_under_another_model_is_a_clear_error(tmp_path):
    from shardwise.errors import CheckpointError

    _fit("single", 1, tmp_path / "run", 4, None)
    other = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    with pytest.raises(CheckpointError, match="saved from another model"):
        _trainer("single", 1, tmp_path / "run", 8, "auto").fit(other, classification(100, dtype=torch.float32))
