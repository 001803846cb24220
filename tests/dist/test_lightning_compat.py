"""The Lightning-written classifier of tests/unit/test_lightning_compat.py trains under ddp, zero3 and
tp at world size 2 (float64): every rank ends with the parameters of the plain PyTorch loop over the
same global batches (within 1e-9), and metrics.jsonl holds its logged values: the epoch means and the
validation numbers the plain loop computes, reduced over both ranks.

One launch runs the three fits (the Trainer inside a launched worker joins its process group)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardwise import Trainer, launch
from tests.unit.test_lightning_compat import SETTINGS, VAL, LitClassifier, check_run, data, hand_loop

STRATEGIES = {"ddp": {}, "zero3": {}, "tp": {"tp": 2}}  # tp's automatic plan splits fc1 (columns) and fc2 (rows)


def _world_of_two(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy, options in STRATEGIES.items():
        model = LitClassifier()
        summary = Trainer(strategy=strategy, strategy_options=options, out=str(Path(root) / strategy), **SETTINGS).fit(model, data(), data(VAL, seed=5))
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
