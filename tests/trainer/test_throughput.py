"""FLOPs, FLOP/s, MFU and tokens/s in a fit's summary, records and end line; compile time out of every rate."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shardwise import Trainer
from shardwise.errors import ConfigError
from shardwise.trainer.throughput import Rates, end_line
from tests.support import charlm_model
from tests.support.models import adam, ce, classification, mlp


class _Clock:
    """A compile tracker whose seconds the test sets."""

    def __init__(self) -> None:
        self.s = 0.0

    def seconds(self) -> float:
        return self.s


def test_rates_leave_compile_seconds_out() -> None:
    clock = _Clock()
    counted = {"flops_per_sample": 10.0, "method": "FlopCounterMode", "tokens_per_sample": 4, "seconds": 0.0}
    rates = Rates(counted, peak=1e3, peak_source="test", devices=2, tracker=clock, global_batch=8)
    clock.s = 3.0  # the first window compiled for 3 of its 4 seconds
    w = rates.window(steps=5, seconds=4.0, seq=4)
    assert w == {"samples_per_s": 40.0, "tokens_per_s": 160.0, "mfu": 5 * 80 / 1.0 / (1e3 * 2)}
    clock.s = 4.0  # the second window: 1 of 3 seconds
    assert rates.window(steps=4, seconds=3.0, seq=4)["samples_per_s"] == 16.0
    rates.stop()
    clock.s = 9.0  # a final evaluation's compile comes after training: no step's
    s = rates.summary(steps=9, train_s=10.0, seq=4)
    assert s["throughput"]["compile_s"] == 4.0 and s["throughput"]["step_s"] == 6.0
    assert s["samples_per_s"] == 9 * 8 / 6.0 and s["tokens_per_s"] == 9 * 32 / 6.0
    assert s["flops_per_step"] == 80.0 and s["flops_per_s"] == 9 * 80 / 6.0 and s["mfu"] == 9 * 80 / 6.0 / 2e3
    assert s["throughput"]["tokens_per_step"] == 32 and s["throughput"]["devices"] == 2
    assert end_line({**s, "compile": {"mode": "model"}}) == f"tokens_per_s {9 * 32 / 6.0:.4g}  mfu {100 * 9 * 80 / 6.0 / 2e3:.1f}%  (compile 4.0s)"
    none = Rates(None, None, "no peak figure for X: set peak_tflops", 1, None, 8).summary(2, 1.0, 0)
    assert none["flops_per_step"] is None and none["mfu"] is None and none["tokens_per_s"] is None
    assert none["flops_method"].startswith("not counted")


def test_fit_summary_records_and_line_of_an_mlp(tmp_path, capsys) -> None:
    """No token ids: tokens_per_s is null; MFU against the peak_tflops setting, exactly."""
    trainer = Trainer(optimizer=adam, loss_fn=ce, progress_bar=False, global_batch_size=32, max_steps=4, log_every=2, out=str(tmp_path), peak_tflops=1e-3)
    summary = trainer.fit(mlp(dtype=torch.float32), classification(128, dtype=torch.float32))
    assert summary["flops_per_step"] == 32 * (6 * (6 * 16 + 16 * 3) - 2 * 6 * 16) and summary["flops_method"] == "FlopCounterMode"
    tp = summary["throughput"]
    assert tp["peak_flops_per_s"] == 1e9 and tp["peak_source"].startswith("peak_tflops") and tp["compile_s"] == 0.0
    assert summary["flops_per_s"] == pytest.approx(summary["flops_per_step"] * 4 / tp["step_s"])
    assert summary["mfu"] == pytest.approx(summary["flops_per_s"] / 1e9) and summary["tokens_per_s"] is None
    assert summary["samples_per_s"] == pytest.approx(4 * 32 / tp["step_s"])
    assert tp["count_s"] > 0  # what counting cost in the parent (a time: not compared with anything here)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["mfu"] == summary["mfu"] and written["flops_method"] == "FlopCounterMode"
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "samples_per_s" in r]
    assert len(train) == 2 and all(r["mfu"] > 0 and "tokens_per_s" not in r for r in train)
    assert f"mfu {100 * summary['mfu']:.1f}%" in capsys.readouterr().out.split("done: ")[-1]


def _lm_loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), batch[1].reshape(-1))


def test_fit_of_a_token_model_has_tokens_and_a_measured_cpu_mfu(capsys) -> None:
    from shardwise.tools.recipes.charlm import CharGPT

    torch.manual_seed(0)
    model = CharGPT(charlm_model.vocab_size(), block_size=charlm_model.SEQ, d_model=32, n_heads=2, n_layers=2)
    trainer = Trainer(optimizer=adam, loss_fn=_lm_loss, progress_bar=False, global_batch_size=8, max_steps=3, model_summary=False)
    summary = trainer.fit(model, charlm_model.charlm_data(64))
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * charlm_model.SEQ)
    assert summary["throughput"]["tokens_per_step"] == 8 * charlm_model.SEQ
    assert summary["flops_method"] == "FlopCounterMode" and summary["flops_per_step"] > 6 * 8 * charlm_model.SEQ * 2 * 4 * 32 * 32
    assert 0 < summary["mfu"] < 1 and "measured matmul peak" in summary["throughput"]["peak_source"]
    line = capsys.readouterr().out.split("done: ")[-1]
    assert "tokens_per_s" in line and "mfu" in line and "compile" not in line


def test_peak_tflops_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="peak_tflops must be a positive number"):
        Trainer(peak_tflops=-1.0)
