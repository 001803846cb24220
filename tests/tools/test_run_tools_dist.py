"""Callbacks, the other loops and the profiler on every family at world size 2 (and 3), on digits.

- EarlyStopping stops every rank after the same step on ddp, zero2, pipeline, tp, local-sgd and ps,
  even when the monitored value differs across ranks (each rank adds its own; `agree` makes one).
- validate / test / predict are exact over a set that no world size divides (37 samples): the
  loss, accuracy and outputs equal a hand computation over the whole set in one process.
- ModelCheckpoint's best checkpoints hold the best scores: each one, validated again, gives the
  score it was kept for; a resumed run restores the callbacks' state exactly.
- The profiler's parts sum to each rank's traced step, and the traced steps are the loop's (within 5% of
  its own clock on the median step), on ddp and on the pipeline.

One launch per world size runs every check of that size (a process start costs seconds here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sklearn.datasets  # noqa: F401  # digits' data package sets KMP_* once per interpreter: before the hygiene fixture's snapshot
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Trainer, launch
from shardwise.tools.recipes.digits import load_digits_split
from shardwise.trainer.callbacks import Callback, EarlyStopping, ModelCheckpoint
from tests.support.models import assert_traced_steps_are_the_loop_steps

pytestmark = pytest.mark.dist

N_EVAL = 41  # divides by none of 2, 3 (nor by the batch of 4): at world size 2 one rank makes 5 calls, the other 6
FAMILIES = {
    "ddp": {},
    "zero2": {},
    "pipeline": {"strategy_options": {"pp": 2, "microbatches": 2}},
    "tp": {"strategy_options": {"plan": {"0": "colwise", "2": "rowwise"}}},  # the flat MLP names no pair: the plan says which
    "local-sgd": {"strategy_options": {"sync_every": 2}},
    "ps": {},
}


def digits() -> tuple[TensorDataset, TensorDataset]:
    train, val = load_digits_split(dtype=torch.float64)
    return train, TensorDataset(*(t[:N_EVAL] for t in val.tensors))


def mlp() -> nn.Module:
    """A flat Sequential (the pipeline cuts it into stages), float64."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10)).double()


def ce(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output, batch[1])


def accuracy(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return (output.argmax(-1) == batch[1]).double().mean()


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def trainer(strategy: str, **settings: Any) -> Trainer:
    base = dict(precision="64", global_batch_size=16, val_batch_size=4, progress_bar=False, timeout_s=40, model_summary=False, log_every=1)
    return Trainer(strategy=strategy, optimizer=adam, loss_fn=ce, metrics={"accuracy": accuracy}, **FAMILIES.get(strategy, {}), **{**base, **settings})


class RankScore(Callback):
    """Adds ``score`` to each training record, a different value on each rank: rank 0's rises by
    0.5 a step (alone, it never improves: it stops after step 2), rank 1's falls by 1 a step
    (alone, it improves every step and never stops). Only an agreed value stops both at once."""

    def on_metrics(self, trainer: Any, engine: Any, record: Any) -> None:
        if "train_loss" in record:
            record["score"] = 0.5 * record["step"] if engine.rank == 0 else -float(record["step"])


class Steps(Callback):
    """Each rank's step when fit ended."""

    step = -1

    def on_fit_end(self, trainer: Any, engine: Any, summary: dict[str, Any]) -> None:
        self.step = trainer.step
        summary[f"stopped_at_rank_{engine.rank}"] = trainer.step


def _world2(out: Path) -> dict[str, Any]:
    train, val = digits()
    results: dict[str, Any] = {}
    for strategy in FAMILIES:
        # The agreed score is the mean of the two, (0.5 s - s) / 2 = -s/4: it falls by 0.25 a step,
        # less than min_delta 0.3, so step 2 does not improve on step 1 and patience 1 stops both
        # ranks after step 2. (ps at world size 2 has one worker, rank 0: its own score stops it
        # after step 2 too, and the server must stop with it.)
        steps = Steps()
        t = trainer(strategy, max_steps=12, callbacks=[RankScore(), EarlyStopping("score", "min", patience=1, min_delta=0.3), steps])
        summary = t.fit(mlp(), train)
        results[f"stop/{strategy}"] = (steps.step, summary.get("early_stopping"))
        t = trainer(strategy)
        results[f"validate/{strategy}"] = t.validate(mlp(), val)
        results[f"test/{strategy}"] = t.test(mlp(), val)
        results[f"predict/{strategy}"] = t.predict(mlp(), val)
    # zero3 gathers its parameters in every forward: the rank with 5 calls runs a 6th on padding,
    # or the other's gathers wait for it (a hang until the timeout)
    results["validate/zero3"] = trainer("zero3").validate(mlp(), val)
    for strategy in ("ddp", "pipeline"):
        t = trainer(strategy, max_steps=8, profile=True, profile_skip=1, profile_steps=4, out=str(out / f"profile-{strategy}"), log_every=100)
        results[f"profile/{strategy}"] = t.fit(mlp(), train)["profile"]
    return results


def _world3() -> dict[str, Any]:
    _, val = digits()
    t = trainer("ddp", global_batch_size=18)
    return {"validate": t.validate(mlp(), val), "test": t.test(mlp(), val), "predict": t.predict(mlp(), val)}


def hand() -> tuple[float, float, torch.Tensor]:
    """Loss and accuracy over the whole evaluation set, and the outputs, in this process."""
    _, val = digits()
    model = mlp().eval()
    with torch.no_grad():
        out = model(val.tensors[0])
    return F.cross_entropy(out, val.tensors[1]).item(), (out.argmax(-1) == val.tensors[1]).double().mean().item(), out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    out = tmp_path_factory.mktemp("world2")
    return launch(_world2, out, nproc=2, timeout=420)[0], out


@pytest.mark.timeout(480)
@pytest.mark.parametrize("strategy", list(FAMILIES))
def test_early_stopping_stops_every_rank_after_the_same_step(world2, strategy):
    results, _ = world2
    step, section = results[f"stop/{strategy}"]
    assert step == 2 and section["stopped_step"] == 2, (step, section)
    assert section["best"] == (0.5 if strategy == "ps" else -0.25)  # the agreed value at step 1: (0.5 - 1) / 2


@pytest.mark.timeout(480)
@pytest.mark.parametrize("strategy", list(FAMILIES))
def test_validate_test_and_predict_are_exact_at_world_size_2(world2, strategy):
    results, _ = world2
    loss, acc, outputs = hand()
    val = results[f"validate/{strategy}"]
    assert val["val_samples"] == N_EVAL
    assert val["val_loss"] == pytest.approx(loss, rel=1e-12) and val["val_accuracy"] == pytest.approx(acc, rel=1e-12)
    test = results[f"test/{strategy}"]
    assert test["test_samples"] == N_EVAL and test["test_loss"] == pytest.approx(loss, rel=1e-12)
    predicted = results[f"predict/{strategy}"]
    assert predicted.shape == outputs.shape
    torch.testing.assert_close(predicted, outputs, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(480)
def test_an_uneven_evaluation_runs_the_padding_forward_under_zero3(world2):
    results, _ = world2
    loss, acc, _ = hand()
    val = results["validate/zero3"]
    assert val["val_samples"] == N_EVAL
    assert val["val_loss"] == pytest.approx(loss, rel=1e-12) and val["val_accuracy"] == pytest.approx(acc, rel=1e-12)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_the_profile_breakdown_sums_to_the_measured_step(world2, strategy):
    results, out = world2
    section = results[f"profile/{strategy}"]
    assert section["steps_recorded"] == 4 and section["window"] == [3, 6]
    for rank, row in enumerate(section["per_rank"]):
        parts = sum(row[k] for k in section["parts"])
        assert parts == pytest.approx(row["traced_step"], rel=1e-6), (rank, row)
        assert len(row["steps"]) == 4
        assert_traced_steps_are_the_loop_steps(row["steps"])
        assert row["comm_total"] > 0 and row["forward"] > 0 and row["backward"] > 0 and row["optimizer"] > 0, row
        assert row["comm_exposed"] <= row["comm_total"] + 1e-9
        trace = json.loads((out / f"profile-{strategy}" / "profile" / f"rank-{rank:05d}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"shardwise/data", "shardwise/forward_backward", "shardwise/optimizer"} <= names


@pytest.mark.timeout(300)
def test_validate_test_and_predict_are_exact_at_world_sizes_1_and_3():
    loss, acc, outputs = hand()
    _, val = digits()
    one = trainer("single")
    assert one.validate(mlp(), val)["val_loss"] == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(one.predict(mlp(), val), outputs, rtol=1e-12, atol=1e-12)
    three = launch(_world3, nproc=3, timeout=240)[0]
    assert three["validate"]["val_samples"] == N_EVAL and three["test"]["test_samples"] == N_EVAL
    assert three["validate"]["val_loss"] == pytest.approx(loss, rel=1e-12)
    assert three["validate"]["val_accuracy"] == pytest.approx(acc, rel=1e-12)
    torch.testing.assert_close(three["predict"], outputs, rtol=1e-12, atol=1e-12)


# -- best checkpoints and resume, on ddp ------------------------------------------------------------


def _best_and_resume(out: Path) -> dict[str, Any]:
    train, val = digits()

    def run(directory: Path, max_steps: int, resume: str | None) -> tuple[dict[str, Any], ModelCheckpoint, EarlyStopping]:
        best, stop = ModelCheckpoint("val_loss", "min", save_top_k=2), EarlyStopping("val_loss", patience=50)
        t = trainer("ddp", max_steps=max_steps, val_every=2, checkpoint_every=6, keep_last=1, out=str(directory), resume=resume, callbacks=[best, stop])
        return t.fit(mlp(), train, val), best, stop

    full, best, stop = run(out / "full", 12, None)
    run(out / "split", 6, None)
    resumed, best_r, stop_r = run(out / "split", 12, "auto")
    checks = {"full": full, "resumed": resumed, "best_k": best.best_k, "best_k_resumed": best_r.best_k}
    checks["stop"] = (stop.best, stop.wait)
    checks["stop_resumed"] = (stop_r.best, stop_r.wait)
    # Each best checkpoint, validated again, gives the score it was kept for.
    checks["revalidated"] = [trainer("ddp").validate(mlp(), val, ckpt_path=entry["path"])["val_loss"] for entry in best.best_k]
    return checks


@pytest.mark.timeout(400)
def test_best_checkpoints_hold_the_best_scores_and_a_resume_restores_callback_state(tmp_path):
    checks = launch(_best_and_resume, tmp_path, nproc=2, timeout=360)[0]
    lines = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    scores = {r["step"]: r["val_loss"] for r in lines if "val_loss" in r}
    assert sorted(scores) == [2, 4, 6, 8, 10, 12]
    two_best = sorted(scores.items(), key=lambda kv: kv[1])[:2]
    assert [(e["step"], e["score"]) for e in checks["best_k"]] == two_best
    assert checks["full"]["best_model_score"] == two_best[0][1]
    kept = sorted(p.name for p in (tmp_path / "full" / "checkpoints" / "best").iterdir())
    assert kept == sorted(f"step-{s:08d}" for s, _ in two_best)
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == ["best", "step-00000012"]  # keep_last=1 spares best/
    assert checks["revalidated"] == pytest.approx([s for _, s in two_best], rel=1e-12)
    # The resumed run (6 steps, then 6 more from the step-6 checkpoint) ends with the same callback state.
    assert checks["best_k_resumed"] == [{**e, "path": e["path"].replace("/full/", "/split/")} for e in checks["best_k"]]
    assert checks["stop_resumed"] == checks["stop"]
    assert checks["resumed"]["early_stopping"] == checks["full"]["early_stopping"]
