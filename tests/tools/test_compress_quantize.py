"""int8 quantization (`shardwise.tools.compress.quantize`) and the model loading of `shardwise compress`."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.cli import main
from shardwise.errors import CheckpointError, ConfigError
from shardwise.tools.compress.load import load_recipe_model
from shardwise.tools.compress.measure import batches, evaluate
from shardwise.tools.compress.quantize import dynamic_int8, int8_layers, linear_weight_bytes, static_int8
from shardwise.tools.recipes.digits import DigitsMLP, load_digits_split


@pytest.fixture(scope="module")
def trained() -> tuple[DigitsMLP, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits MLP after 40 full-batch Adam steps (about 96% on validation), and the data."""
    torch.manual_seed(0)
    train, val = load_digits_split()
    x, y = train.tensors
    model = DigitsMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval(), x, *val.tensors


def _agreement(a: nn.Module, b: nn.Module, x: torch.Tensor) -> float:
    with torch.inference_mode():
        return float((a(x).argmax(-1) == b(x).argmax(-1)).float().mean())


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_int8_digits_matches_float_and_stores_int8_weights(trained, kind):
    model, x_train, x_val, y_val = trained
    q = dynamic_int8(model) if kind == "dynamic" else static_int8(model, [(x_train[i : i + 64],) for i in range(0, 512, 64)])
    assert _agreement(model, q, x_val) >= 0.95
    assert int8_layers(q) == (["net.0", "net.3", "net.6"] if kind == "dynamic" else ["net.0.module", "net.3.module", "net.6.module"])
    assert not any(type(m) is nn.Linear for m in q.modules())  # no float Linear left
    # By hand: 64x128 + 128x128 + 128x10 weights, 4 bytes each in fp32, 1 in int8.
    n = 64 * 128 + 128 * 128 + 128 * 10
    assert linear_weight_bytes(model) == 4 * n and linear_weight_bytes(q) == n
    acc_f = float((model(x_val).argmax(-1) == y_val).float().mean())
    with torch.inference_mode():
        acc_q = float((q(x_val).argmax(-1) == y_val).float().mean())
    assert acc_f > 0.9 and acc_q >= acc_f - 0.02
    assert all(p.requires_grad for p in model.parameters())  # the float model is left as it was


def test_static_int8_runs_on_charlm_sequences():
    from shardwise.tools.recipes.charlm import CharGPT

    torch.manual_seed(0)
    model = CharGPT(20, block_size=8, d_model=32, n_heads=4, n_layers=1).eval()
    idx = torch.randint(0, 20, (16, 8))
    q = static_int8(model, [(idx,)])
    assert len(int8_layers(q)) == 7  # q, k, v, proj, fc, proj, head.out
    with torch.inference_mode():
        assert q(idx).shape == (16, 8, 20)


def test_a_model_without_linear_layers_is_refused():
    with pytest.raises(ConfigError, match="no nn.Linear layer to quantize"):
        dynamic_int8(nn.Sequential(nn.Conv1d(1, 1, 3)))


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    from shardwise.tools.recipes import get_recipe
    from shardwise.trainer.loop import Trainer

    out = tmp_path_factory.mktemp("run") / "digits"
    parts = get_recipe("digits").parts()
    settings = {"out": str(out), "max_steps": 2, "global_batch_size": 64, "checkpoint_every": 2, "progress_bar": False, "model_summary": False}
    Trainer(optimizer=parts.optimizer, loss_fn=parts.loss_fn, **settings).fit(parts.model, parts.train)
    return out, parts.model


def test_load_a_run_and_refuse_another_model(digits_run):
    out, trained_model = digits_run
    model, parts, path = load_recipe_model(out, "digits")
    assert path.name == "step-00000002" and not model.training
    for a, b in zip(model.state_dict().values(), trained_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(CheckpointError, match="saved from another model"):
        load_recipe_model(out, "digits", {"hidden": 64})
    with pytest.raises(CheckpointError, match="saved from another model") as refused:
        load_recipe_model(out, "charlm")
    # the fix is the one this command takes (the recipe and its options), not a training run's "resume"
    assert "pass the --recipe and the --set recipe.KEY=VALUE it was trained with" in str(refused.value) and "Resume" not in str(refused.value)


def test_cli_quantize_writes_the_report(digits_run, tmp_path, capsys):
    out, _ = digits_run
    argv = ["compress", "quantize", str(out), "--recipe", "digits", "--to", "int8", "--out", str(tmp_path), "--repeats", "2", "--calibration-batches", "2"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    fp32, dyn = report["models"]["fp32"], report["models"]["dynamic_int8"]
    assert fp32["bytes"] == (tmp_path / "fp32.pt").stat().st_size and dyn["bytes"] < fp32["bytes"] / 3
    assert fp32["int8_layers"] == 0 and dyn["int8_layers"] == 3
    model, parts, _ = load_recipe_model(out, "digits")  # the report's float accuracy, recomputed
    assert fp32["val_accuracy"] == pytest.approx(evaluate(model, batches(parts.val, 64), parts.loss_fn, parts.metrics)["val_accuracy"])
    assert "dynamic_int8" in capsys.readouterr().out


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    assert main(["compress", "quantize", str(tmp_path / "missing"), "--recipe", "digits", "--out", str(tmp_path)]) != 0
    assert "does not exist" in capsys.readouterr().err


def test_cli_prune_and_distill_write_their_reports(digits_run, tmp_path, capsys):
    out, _ = digits_run
    argv = ["compress", "prune", str(out), "--recipe", "digits", "--sparsity", "0.5", "--finetune-steps", "3", "--out", str(tmp_path / "p")]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "p" / "report.json").read_text())["models"]
    n = 64 * 128 + 128 * 128 + 128 * 10
    assert rows["dense"]["zeros"] == 0 and rows["pruned"]["zeros"] == rows["pruned_finetuned"]["zeros"] == n // 2
    assert rows["pruned_finetuned"]["prune_at_steps"] == [1, 2, 3]
    assert main(["compress", "distill", "--recipe", "digits", "--teacher", str(out), "--steps", "3", "--out", str(tmp_path / "d")]) == 0
    rows = json.loads((tmp_path / "d" / "report.json").read_text())["models"]
    assert rows["student_alone"]["parameters"] == rows["student_distilled"]["parameters"] == 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    assert rows["student_alone"]["val_loss"] != rows["student_distilled"]["val_loss"]  # same start, other loss
    assert "student_distilled" in capsys.readouterr().out


def test_cli_sparsity_out_of_range_is_refused_before_work(digits_run, tmp_path, capsys):
    out, _ = digits_run
    assert main(["compress", "prune", str(out), "--recipe", "digits", "--sparsity", "1", "--out", str(tmp_path / "p")]) != 0
    err = capsys.readouterr().err
    assert "sparsity must be a fraction in [0, 1)" in err and "Traceback" not in err and not (tmp_path / "p").exists()
