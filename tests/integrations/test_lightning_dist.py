"""The Lightning-written classifier of tests/integrations/test_lightning.py trains under ddp, zero3 and
tp at world size 2 (float64): every rank ends with the parameters of the plain PyTorch loop over the
same global batches (within 1e-9), and metrics.jsonl holds its logged values: the epoch means and the
validation numbers the plain loop computes, reduced over both ranks, and so does the csv logger.

One launch runs the three fits (the Trainer inside a launched worker joins its process group)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shardwise import Trainer, launch
from tests.integrations.test_lightning import SETTINGS, VAL, LitClassifier, check_run, data, hand_loop

pytestmark = pytest.mark.dist

STRATEGIES = {"ddp": {}, "zero3": {}, "tp": {"tp": 2}}  # tp's automatic plan splits fc1 (columns) and fc2 (rows)


def _world_of_two(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy, options in STRATEGIES.items():
        model = LitClassifier()
        trainer = Trainer(strategy=strategy, strategy_options=options, out=str(Path(root) / strategy), loggers="csv", **SETTINGS)
        summary = trainer.fit(model, data(), data(VAL, seed=5))
        params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}
        out[strategy] = (params, summary["mesh"], summary["val_acc"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("lit")
    return root, launch(_world_of_two, str(root), nproc=2, threads_per_proc=1)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_lightning_module_equals_the_plain_loop(strategy, runs):
    root, results = runs
    ref = hand_loop()
    for rank in range(2):  # every rank holds the plain loop's parameters and agrees on the synced values
        params, mesh, val_acc = results[rank][strategy]
        holder = torch.nn.Module()
        holder.state_dict = lambda params=params: params  # type: ignore[method-assign]
        check_run(holder, root / strategy, ref, per_step_loss=strategy == "tp")
        assert val_acc == pytest.approx(ref["val_acc"], abs=1e-12)
    assert (mesh.get("dp", 1), mesh.get("tp", 1)) == ((1, 2) if strategy == "tp" else (2, 1))  # tp really split the layers
    # the values the module logged (self.log) reach the loggers too: the csv rows are metrics.jsonl's
    jsonl = [json.loads(x) for x in (root / strategy / "metrics.jsonl").read_text().splitlines() if x.strip()]
    with open(root / strategy / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(jsonl)
    for key in ("train_loss_avg", "val_loss", "val_acc"):
        logged = [r for r in jsonl if key in r]
        in_csv = [r for r in rows if r.get(key)]
        assert logged and [int(r["step"]) for r in in_csv] == [r["step"] for r in logged], key
        assert [float(r[key]) for r in in_csv] == pytest.approx([r[key] for r in logged], abs=1e-12), key
