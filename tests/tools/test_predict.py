"""``shardwise predict``: a digits checkpoint over 37 validation samples (no world size divides
37 evenly into 10-row shards) at world sizes 1, 2 and 3; the shards, read back in index order,
equal a forward of the checkpoint's weights written out by hand, row for row (so in order, none
missing, none duplicated); bad paths and another model's checkpoint are one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import load_file
from shardwise.errors import ConfigError
from shardwise.tools.predict import predict_checkpoint
from shardwise.tools.recipes.digits import DigitsMLP, load_digits_split
from shardwise.trainer.loop import Trainer

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
N = 37


@pytest.fixture(scope="module")
def digits_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardwise.tools.recipes import get_recipe

    out = tmp_path_factory.mktemp("digits-run")
    torch.manual_seed(0)
    parts = get_recipe("digits").parts()
    trainer = Trainer(
        optimizer=parts.optimizer, loss_fn=parts.loss_fn, max_steps=3, global_batch_size=64, checkpoint_every=3, out=str(out), model_summary=False
    )
    trainer.fit(parts.model, parts.train)
    (step,) = (out / "checkpoints").glob("step-*")
    return step


def _by_hand(checkpoint: Path) -> torch.Tensor:
    """The checkpoint's MLP on the first N validation images, in one float64 forward."""
    model = DigitsMLP().double().eval()
    model.load_state_dict({k: v.double() for k, v in load_file(checkpoint / "state.pt")["model"].items()})
    _, val = load_digits_split()
    with torch.no_grad():
        return model(val.tensors[0][:N].double())


def _read_shards(out: Path) -> tuple[dict, torch.Tensor]:
    index = json.loads((out / "index.json").read_text())
    parts = [torch.load(out / s["file"], weights_only=True) for s in index["shards"]]
    return index, torch.cat(parts)


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_outputs_in_order_none_duplicated_shards_and_index_consistent(digits_checkpoint: Path, tmp_path: Path, nproc: int) -> None:
    index = predict_checkpoint(digits_checkpoint, "digits", tmp_path, nproc=nproc, limit=N, rows_per_shard=10, batch_size=4)
    on_disk, rows = _read_shards(tmp_path)
    assert on_disk == index
    assert [(s["first_row"], s["rows"]) for s in index["shards"]] == [(0, 10), (10, 10), (20, 10), (30, 7)]
    assert all(torch.load(tmp_path / s["file"], weights_only=True).shape[0] == s["rows"] for s in index["shards"])
    assert index["rows"] == N and index["shape"] == [N, 10] and index["dtype"] == "float32"
    assert index["step"] == 3 and index["checkpoint_strategy"] == "single"
    assert rows.shape == (N, 10)
    torch.testing.assert_close(rows.double(), _by_hand(digits_checkpoint), atol=1e-5, rtol=1e-5)
    t = index["throughput"]
    assert t["nproc"] == nproc and t["samples_per_s"] > 0
    if nproc > 1:  # the 1-process pass ran too and read the same shards back
        assert t["one_process"]["samples_per_s"] > 0 and index["max_abs_diff_vs_one_process"] < 1e-5
    else:
        assert "one_process" not in t


def test_another_models_checkpoint_is_one_line_before_any_process(digits_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not hold the model recipe 'digits' builds: different shapes .*--recipe") as err:
        predict_checkpoint(digits_checkpoint, "digits", tmp_path, nproc=2, recipe_options={"hidden": 32})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"does not hold the model recipe 'charlm' builds: missing") as err:
        predict_checkpoint(digits_checkpoint, "charlm", tmp_path, nproc=2)
    assert not (tmp_path / "predictions").exists()  # refused before anything was written


def test_bad_paths_and_settings_are_one_line_errors(digits_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such directory"):
        predict_checkpoint(tmp_path / "nope", "digits", tmp_path / "out")
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        predict_checkpoint(tmp_path, "digits", tmp_path / "out")
    with pytest.raises(ConfigError, match="predict runs under"):
        predict_checkpoint(digits_checkpoint, "digits", tmp_path / "out", nproc=2, strategy="ps")
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise", "predict", str(tmp_path / "nope"), "--recipe", "digits", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no such directory" in proc.stderr


def test_a_tensor_parallel_checkpoint_predicts_split_under_tp_and_whole_under_ddp(tmp_path: Path) -> None:
    """A charlm checkpoint trained under tp (DCP shards) predicted with ``--strategy tp`` (the model
    split over 2 processes while predicting) and with the default data-parallel ddp: both equal a
    forward of the checkpoint's weights, read whole, by hand."""
    from shardwise.checkpoint.export import model_weights
    from shardwise.tools.recipes import get_recipe

    options = {"d_model": 32, "n_heads": 2, "n_layers": 2, "block_size": 16}
    recipe = get_recipe("charlm")
    torch.manual_seed(0)
    parts = recipe.parts(options)
    run = tmp_path / "run"
    trainer = Trainer(
        strategy="tp", nproc=2, optimizer=parts.optimizer, loss_fn=parts.loss_fn, max_steps=2, global_batch_size=8, checkpoint_every=2,
        out=str(run), model_summary=False,
    )  # fmt: skip
    trainer.fit(parts.model, parts.train)
    (step,) = (run / "checkpoints").glob("step-*")
    n = 12
    model = recipe.parts(options).model.double().eval()
    model.load_state_dict({k: v.double() for k, v in model_weights(step).items()})
    with torch.no_grad():
        expected = model(torch.stack([parts.val[i][0] for i in range(n)]))
    for strategy in ("tp", "ddp"):
        index = predict_checkpoint(
            step, "charlm", tmp_path / strategy, nproc=2, strategy=strategy, recipe_options=options, limit=n, rows_per_shard=5, batch_size=2, baseline=False
        )
        assert index["checkpoint_strategy"] == "tp" and index["throughput"]["strategy"] == strategy
        assert [(s["first_row"], s["rows"]) for s in index["shards"]] == [(0, 5), (5, 5), (10, 2)]
        _, rows = _read_shards(tmp_path / strategy)
        torch.testing.assert_close(rows.double(), expected, atol=1e-4, rtol=1e-4)
