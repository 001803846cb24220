"""FLOPs, FLOP/s, MFU and tokens/s in a fit's summary, records and end line; compile time out of every rate."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

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


def _ids(b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long)


def test_rates_leave_compile_seconds_out() -> None:
    clock = _Clock()
    counted = {"flops_per_sample": 10.0, "method": "FlopCounterMode", "tokens_per_sample": 4, "seconds": 0.0}
    rates = Rates(counted, peak=1e3, peak_source="test", devices=2, tracker=clock, global_batch=8)
    for _ in range(5):
        rates.saw([_ids(4, 4)])  # this rank's 4 of the global batch's 8 samples, T = 4
    clock.s = 3.0  # the first window compiled for 3 of its 4 seconds
    w = rates.window(steps=5, seconds=4.0)
    assert w == {"samples_per_s": 40.0, "tokens_per_s": 160.0, "mfu": 5 * 80 / 1.0 / (1e3 * 2)}
    for _ in range(4):
        rates.saw([_ids(4, 4)])
    clock.s = 4.0  # the second window: 1 of 3 seconds
    assert rates.window(steps=4, seconds=3.0)["samples_per_s"] == 16.0
    rates.stop()
    clock.s = 9.0  # a final evaluation's compile comes after training: no step's
    s = rates.summary(steps=9, train_s=10.0)
    assert s["throughput"]["compile_s"] == 4.0 and s["throughput"]["step_s"] == 6.0
    assert s["samples_per_s"] == 9 * 8 / 6.0 and s["tokens_per_s"] == 9 * 32 / 6.0
    assert s["flops_per_step"] == 80.0 and s["flops_per_s"] == 9 * 80 / 6.0 and s["mfu"] == 9 * 80 / 6.0 / 2e3
    assert s["throughput"]["tokens_per_step"] == 32 and s["throughput"]["devices"] == 2
    assert end_line({**s, "compile": {"mode": "model"}}) == f"tokens_per_s {9 * 32 / 6.0:.4g}  mfu {100 * 9 * 80 / 6.0 / 2e3:.1f}%  (compile 4.0s)"
    none = Rates(None, None, "no peak figure for X: set peak_tflops", 1, None, 8).summary(2, 1.0)
    assert none["flops_per_step"] is None and none["mfu"] is None and none["tokens_per_s"] is None
    assert none["flops_method"].startswith("not counted")


def test_the_slowest_ranks_compile_seconds_leave_every_ranks_rates() -> None:
    """A rank that compiled 1 s waits inside its first step for one that compiled 3 s: the rates take out the
    largest compile seconds of the loop's ranks (the summary's `longest`, the window's ``compiled``), not its own."""
    clock = _Clock()
    counted = {"flops_per_sample": 10.0, "method": "FlopCounterMode", "tokens_per_sample": 0, "seconds": 0.0}
    rates = Rates(counted, peak=1e3, peak_source="test", devices=2, tracker=clock, global_batch=8, longest=lambda own: max(own, 3.0))
    clock.s = 1.0
    assert rates.window(steps=2, seconds=5.0, compiled=3.0)["samples_per_s"] == 2 * 8 / 2.0
    assert rates.window(steps=2, seconds=1.0, compiled=0.0)["samples_per_s"] == 16.0  # the window's mark moved on
    rates.stop()
    s = rates.summary(steps=4, train_s=6.0)
    assert s["throughput"]["compile_s"] == 3.0 and s["throughput"]["step_s"] == 3.0 and s["samples_per_s"] == 4 * 8 / 3.0
    # the slowest's seconds do not fit in this rank's clock (it started after they began): its own come out
    clock = _Clock()
    late = Rates(counted, 1e3, "test", 2, clock, 8, longest=lambda own: 7.0)
    clock.s = 1.0
    late.stop()
    assert late.summary(steps=4, train_s=6.0)["throughput"]["step_s"] == 6.0 - 1.0


def test_an_achieved_rate_above_the_peak_raises_the_peak_not_the_mfu() -> None:
    """A CPU peak measured under load is low: MFU never exceeds 1; the summary says the peak was raised to what the run did."""
    counted = {"flops_per_sample": 1e6, "method": "FlopCounterMode", "tokens_per_sample": 0, "seconds": 0.0}
    rates = Rates(counted, peak=1e6, peak_source="measured matmul peak (X)", devices=2, tracker=None, global_batch=8)
    assert rates.window(steps=1, seconds=1.0)["mfu"] == 1.0  # 8e6 FLOP/s done on 2 devices of 1e6
    assert rates.window(steps=1, seconds=16.0)["mfu"] == 0.25  # the next window: against the peak again
    s = rates.summary(steps=2, train_s=2.0)
    assert s["mfu"] == 1.0 and s["flops_per_s"] == 8e6 and s["throughput"]["peak_flops_per_s"] == 4e6
    assert s["throughput"]["peak_source"].startswith("measured matmul peak (X); raised to 4e+06 FLOP/s, what this run achieved per device")
    low = Rates(counted, 1e7, "measured", 2, None, 8).summary(steps=2, train_s=2.0)
    assert low["mfu"] == 8e6 / 2e7 and low["throughput"]["peak_flops_per_s"] == 1e7 and low["throughput"]["peak_source"] == "measured"


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


def test_count_flops_false_counts_nothing_and_runs_no_forward_in_the_caller() -> None:
    """count_flops=False (the tools' probe runs: their memory and loss measurements): no FLOPs, no MFU, and the
    caller's process runs the model no extra time."""
    calls: list[str] = []

    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.device.type)
            return self.fc(x)

    trainer = Trainer(optimizer=adam, loss_fn=ce, progress_bar=False, global_batch_size=32, max_steps=2, count_flops=False)
    summary = trainer.fit(Counted(), classification(64, dtype=torch.float32))
    assert summary["flops_per_step"] is None and summary["mfu"] is None and summary["flops_per_s"] is None
    assert "meta" not in calls and len(calls) == 2
    assert Trainer().config.probe(3).count_flops is False


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


class _VarLen(torch.utils.data.Dataset):
    """Token samples of length 4 (the first 8) and 16 (the next 8); labels of 3 classes per token."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        n = 4 if i < 8 else 16
        return torch.randint(1, 10, (n,), generator=g), torch.randint(0, 3, (n,), generator=g)


def _pad(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(x) for x, _ in items)
    xs = torch.stack([F.pad(x, (0, n - len(x))) for x, _ in items])
    return xs, torch.stack([F.pad(y, (0, n - len(y)), value=-100) for _, y in items])


def test_tokens_and_flops_follow_each_steps_batches_where_lengths_vary(tmp_path) -> None:
    """The count sees sample 0 (T = 4); the run trains a batch of T = 4 and then one of T = 16 (no shuffle:
    overfit_batches). Tokens are each step's own, FLOPs the counted FLOPs per token times them (exact here:
    no attention, so FLOPs grow with T)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    loader = torch.utils.data.DataLoader(_VarLen(), batch_size=8, collate_fn=_pad)
    trainer = Trainer(optimizer=adam, loss_fn=_lm_loss, progress_bar=False, max_steps=2, overfit_batches=2, log_every=1, out=str(tmp_path), peak_tflops=1.0)
    summary = trainer.fit(model, loader)
    per_token = 3 * 2 * (6 * 16 + 16 * 3)  # forward and backward of both linears, for each token
    assert summary["throughput"]["tokens_per_step"] == (8 * 4 + 8 * 16) / 2
    assert summary["flops_per_step"] == per_token * (8 * 4 + 8 * 16) / 2 and summary["flops_method"] == "FlopCounterMode"
    step_s = summary["throughput"]["step_s"]
    assert summary["tokens_per_s"] == pytest.approx(160 / step_s) and summary["flops_per_s"] == pytest.approx(per_token * 160 / step_s)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if "samples_per_s" in x]
    seconds = [8 / r["samples_per_s"] for r in rows]  # each window's step seconds, from its samples
    assert [r["tokens_per_s"] * t for r, t in zip(rows, seconds, strict=True)] == pytest.approx([32, 128])
    assert [r["mfu"] * 1e12 * t for r, t in zip(rows, seconds, strict=True)] == pytest.approx([per_token * 32, per_token * 128])


class _OwnStep(torch.nn.Module):
    """A module with a ``training_step`` that calls ``self(x)``: its FLOPs are counted through that step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


def test_a_training_step_models_flops_are_counted_through_its_step() -> None:
    trainer = Trainer(optimizer=adam, progress_bar=False, global_batch_size=8, max_steps=2, model_summary=False, peak_tflops=1.0)
    summary = trainer.fit(_OwnStep(), classification(32, dtype=torch.float32))
    assert summary["flops_method"] == "FlopCounterMode"
    assert summary["flops_per_step"] == 8 * 4 * 6 * 10  # forward 2 in out, the weight's gradient 2 in out (the input needs none)


def _ce_rank_one_compiles_more(output: torch.Tensor, batch: Any) -> torch.Tensor:
    """The mlp's loss; rank 1 also compiles a function of its own at its second step (the first step's compile of
    the model may wait for the other rank inside its backward: it would count the wait as compile time)."""
    import torch.distributed as dist

    _CALLS.append(True)
    if dist.get_rank() == 1 and len(_CALLS) == 2:

        def chain(t: torch.Tensor) -> torch.Tensor:
            for i in range(300):
                t = torch.sin(t * 1.0001 + i)
            return t.sum()

        torch.compile(chain, backend="aot_eager")(torch.randn(3))
    return ce(output, batch)


_CALLS: list[bool] = []


def test_two_ranks_rates_leave_out_the_slowest_ranks_compile(tmp_path) -> None:
    """Rank 1 compiles seconds longer than rank 0, which waits for it inside its first step: rank 0's summary
    and log windows take rank 1's compile seconds out (one all-reduce at the summary; the log's own)."""
    trainer = Trainer(strategy="ddp", nproc=2, optimizer=adam, loss_fn=_ce_rank_one_compiles_more, progress_bar=False, global_batch_size=8, max_steps=4,
                      log_every=1, compile="on:aot_eager", out=str(tmp_path), model_summary=False, peak_tflops=1.0)  # fmt: skip
    summary = trainer.fit(mlp(dtype=torch.float32), classification(64, dtype=torch.float32))
    slowest, own, step_s = summary["throughput"]["compile_s"], summary["compile"]["compile_s"], summary["throughput"]["step_s"]
    assert slowest > own + 0.1, (slowest, own)  # rank 1's, not rank 0's
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if "samples_per_s" in x]
    windows = sum(8 / r["samples_per_s"] for r in rows)  # each window's step seconds
    assert abs(windows - step_s) < (slowest - own) / 2, (windows, step_s, slowest, own)  # rank 1's compile left every window too
