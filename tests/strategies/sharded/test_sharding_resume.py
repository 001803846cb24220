"""Sharded checkpoints reshard: saved under zero3 at world size 2, resumed at 1, at 4 and under
ddp (and a ddp checkpoint under zero3), each continued run equal to an uninterrupted one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardwise import Trainer, launch
from shardwise.checkpoint import read_sharded_full, verify
from shardwise.checkpoint.rundir import new_run_id
from shardwise.trainer.loop import _fit_worker
from tests.support.models import adam, ce, classification, max_diff, mlp, params, step_lr

# One module fixture runs every fit (three launches, 1 to 4 processes): more than the 180 s a
# single dist test gets on a busy two-core machine.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(480)]

N = 8  # 100 samples in global batches of 16: step 8 is in the middle of epoch 1


def _trainer(strategy: str, nproc: int, out: Path, max_steps: int, resume: str | None) -> Trainer:
    return Trainer(
        strategy=strategy,
        nproc=nproc,
        precision="64",
        global_batch_size=16,
        accumulate=2,
        max_steps=max_steps,
        clip_grad_norm=0.5,
        optimizer=adam,
        loss_fn=ce,
        lr_scheduler=step_lr,
        out=str(out),
        checkpoint_every=N,
        resume=resume,
        log_every=4,
        progress_bar=False,
    )


def _fit(strategy: str, nproc: int, out: Path, max_steps: int, resume: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model = mlp()  # no dropout: RNG streams are per rank and do not carry across world sizes
    summary = _trainer(strategy, nproc, out, max_steps, resume).fit(model, classification(100))
    return params(model), summary


def _fit_as_a_rank(strategy: str, out: Path, max_steps: int, resume: str | None = None) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
    """One fit as one rank of the running job, as ``Trainer.fit`` runs it: the checks and the run's
    id first (the same id on every rank, as fit sends it), then what each process it starts runs
    (rank 0 returns the whole model's state)."""
    trainer, model, data = _trainer(strategy, 2, out, max_steps, resume), mlp(), classification(100)
    trainer._check(model, data, None)
    ids = [new_run_id()]
    dist.broadcast_object_list(ids, src=0)
    trainer._run_id = ids[0]
    summary, state = _fit_worker(trainer, model, data, None)
    return state, summary


def _fits_at_two(root: Path) -> dict[str, Any]:
    """The fits at world size 2, one after another in one launch (process start-up, not the steps,
    is most of each fit's time: 5 launches took ~30 s); each a fresh Trainer and model."""
    out: dict[str, Any] = {}
    out["first"] = _fit_as_a_rank("zero3", root / "z3", N)
    # The zero3 checkpoint resumed under ddp.
    out["ddp"] = _fit_as_a_rank("ddp", root / "ddp", 2 * N, str(root / "z3/checkpoints/step-00000008"))
    # zero2 keeps its parameters gathered between steps: its checkpoints reshard first, then gather again.
    out["z2_first"] = _fit_as_a_rank("zero2", root / "z2", N)
    out["z2_resumed"] = _fit_as_a_rank("zero2", root / "z2", 2 * N, "auto")
    # The ddp run's own (plain, unsharded) checkpoint at step 16, resumed under zero3.
    out["from_ddp"] = _fit_as_a_rank("zero3", root / "from_ddp", 3 * N, str(root / "ddp/checkpoints/step-00000016"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reshard")
    out: dict[str, Any] = {"root": root}
    # The uninterrupted runs: single, in this process (zero3 equals it to ~1e-16, tested elsewhere).
    out["full"] = _fit("single", 1, root / "full", 2 * N)
    out["full3"] = _fit("single", 1, root / "full3", 3 * N)
    out.update(launch(_fits_at_two, root, nproc=2)[0])
    ckpt = root / "z3/checkpoints/step-00000008"
    for name, strategy, nproc in (("at1", "zero3", 1), ("at4", "zero3", 4)):
        out[name] = _fit(strategy, nproc, root / name, 2 * N, str(ckpt))
    return out


def test_the_zero3_checkpoint_is_sharded_atomic_and_verified(runs):
    ckpt = runs["root"] / "z3/checkpoints/step-00000008"
    manifest = verify(ckpt)  # every file, the DCP shards included, matches its checksum
    assert manifest["sharded"] == {"dir": "dcp", "keys": ["model", "optimizer"]}
    assert manifest["strategy"] == "zero3" and manifest["world_size"] == 2 and manifest["step"] == N
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "state.pt", "rank-00000.pt"} <= set(manifest["files"])
    assert not any(p.name.startswith(".tmp-") for p in ckpt.parent.iterdir())
    # Read whole in one process: the model, and the optimizer keyed by parameter name.
    full = read_sharded_full(ckpt)
    assert set(full["model"]) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert full["model"]["0.weight"].shape == (16, 6)
    assert set(full["optimizer"]["state"]) == set(full["model"])
    # The same fingerprint as a ddp checkpoint of the same model: they are interchangeable.
    ddp_manifest = json.loads((runs["root"] / "ddp/checkpoints/step-00000016/manifest.json").read_text())
    assert ddp_manifest["model_fingerprint"] == manifest["model_fingerprint"] and "sharded" not in ddp_manifest


@pytest.mark.parametrize("name", ["at1", "at4", "ddp"])
def test_a_zero3_checkpoint_resumes_at_another_world_size_and_strategy(runs, name):
    full, full_summary = runs["full"]
    resumed, summary = runs[name]
    assert summary["resumed_from"].endswith("step-00000008") and summary["steps"] == 2 * N and summary["steps_this_run"] == N
    assert max_diff(full, resumed) < 1e-9
    assert summary["train_loss"] == pytest.approx(full_summary["train_loss"], abs=1e-9)
    assert max_diff(runs["first"][0], resumed) > 1e-3  # it trained on


def test_zero2_saves_and_resumes_exactly_and_measures_its_memory_after_resuming(runs):
    full, _ = runs["full"]
    resumed, summary = runs["z2_resumed"]
    assert summary["resumed_from"].endswith("step-00000008") and summary["steps_this_run"] == N
    assert max_diff(full, resumed) < 1e-9
    assert "sharded" in verify(runs["root"] / "z2/checkpoints/step-00000008")
    # Measured at the first training step after the resume, not at the step that loading
    # runs to create optimizer state: the same bytes as the run that started fresh.
    fresh = runs["z2_first"][1]["memory_per_rank"]
    assert summary["memory_per_rank"] == fresh
    assert fresh["params"]["measured"] == 8 * 163  # whole parameters between steps (float64)


def test_a_ddp_checkpoint_resumes_under_zero3(runs):
    full, _ = runs["full3"]
    resumed, summary = runs["from_ddp"]
    assert summary["resumed_from"].endswith("step-00000016") and summary["steps_this_run"] == N
    assert max_diff(full, resumed) < 1e-9
    # ... and its own checkpoint is sharded.
    manifest = verify(runs["root"] / "from_ddp/checkpoints/step-00000024")
    assert "sharded" in manifest


def _crash_before_manifest(root: str) -> str:
    """A sharded write that dies after the shards, before the manifest: nothing appears under a final name."""
    import shardwise.checkpoint.files as ckpt  # where write() hashes the files
    from shardwise import Engine

    engine = Engine(strategy="zero3", precision="64")
    model, opt = engine.setup(mlp(), adam)
    real = ckpt.sha256

    def boom(path: Path) -> str:
        raise RuntimeError("simulated crash while hashing")

    ckpt.sha256 = boom  # type: ignore[assignment]
    try:
        engine.save(Path(root) / "step-00000001", {"model": model, "optimizer": opt})
    except RuntimeError:
        pass
    finally:
        ckpt.sha256 = real  # type: ignore[assignment]
    return ""


def test_a_crash_during_a_sharded_write_leaves_no_checkpoint(tmp_path):
    launch(_crash_before_manifest, str(tmp_path), nproc=1, threads_per_proc=1)
    from shardwise.checkpoint import latest_valid, list_checkpoints

    assert list_checkpoints(tmp_path) == [] and latest_valid(tmp_path) is None
    assert (tmp_path / ".tmp-step-00000001/dcp/.metadata").exists()  # the shards were written, never published
    shutil.rmtree(tmp_path / ".tmp-step-00000001")
