"""Non-finite losses and gradients (`shardwise.trainer.nonfinite`), one process: stop, skip, warn,
the checkpoints they leave, resume='auto' and pruning around them."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Trainer
from shardwise import checkpoint as ckpt
from shardwise.errors import ConfigError
from shardwise.trainer.nonfinite import NonFiniteError


class NanAt(nn.Module):
    """A linear classifier whose training forward returns ``x * nan`` at the given steps (one forward a
    step); ``where="grad"`` instead makes only the gradient of ``head.weight`` NaN (finite loss)."""

    def __init__(self, bad: tuple[int, ...] = (5,), where: str = "loss") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8).double()
        self.head = nn.Linear(8, 3).double()
        self.bad, self.where, self.calls = bad, where, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        hit = self.training and self.calls in self.bad
        h = torch.tanh(self.body(x))
        if hit and self.where == "loss":
            return self.head(h) * float("nan")
        if hit and self.where == "zero":
            return self.head(h) * 0.0  # the reference for 'skip': a zero gradient, an unchanged SGD step
        if hit and self.where == "grad":
            h = h + _NanGrad.apply(h)
        return self.head(h)  # type: ignore[no-any-return]


class _NanGrad(torch.autograd.Function):
    """Zero forward, NaN backward: a finite loss whose gradient is not finite (into ``body``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g, dtype=torch.float64)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def _ce(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _fit(model: nn.Module, out: Path | None, **settings: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(global_batch_size=8, max_steps=10, log_every=2, progress_bar=False, model_summary=False, optimizer=_sgd, loss_fn=_ce)
    if out is not None:
        base.update(out=str(out), checkpoint_every=1, keep_last=3)
    base.update(settings)
    return Trainer(**base).fit(model, _data())


def _steps(out: Path) -> list[int]:
    return [int(p.name[5:]) for p in ckpt.list_checkpoints(out / "checkpoints")]


def test_stop_names_step_keeps_checkpoints_and_resume_auto(tmp_path: Path) -> None:
    model = NanAt()
    with pytest.raises(NonFiniteError) as err:
        _fit(model, tmp_path / "run")
    text = str(err.value)
    assert "step 5: non-finite loss and gradients on rank 0" in text and "first non-finite tensor: the loss (nan) on rank 0" in text
    assert "step-00000004" in text and "on_nonfinite='skip'" in text
    assert _steps(tmp_path / "run") == [2, 3, 4]  # nothing saved at or after the bad step
    assert all(p.isfinite().all() for p in model.parameters())  # step 5's optimizer step was not taken
    manifest = json.loads((tmp_path / "run/checkpoints/step-00000004/manifest.json").read_text())
    assert manifest["finite"] is True and math.isfinite(manifest["loss"])
    # resume='auto' from the newest finite checkpoint: the model is healthy now and trains to the end
    summary = _fit(NanAt(bad=()), tmp_path / "run", resume="auto")
    assert summary["resumed_from"].endswith("step-00000004") and summary["steps"] == 10 and math.isfinite(summary["train_loss"])


def test_stop_names_the_first_nonfinite_gradient() -> None:
    with pytest.raises(NonFiniteError, match=r"step 3: non-finite gradients on rank 0; first non-finite tensor: the gradient of body.weight on rank 0"):
        _fit(NanAt(bad=(3,), where="grad"), None)
    # with clipping too: the check runs before clipping multiplies every gradient by the NaN norm
    with pytest.raises(NonFiniteError, match=r"the gradient of body.weight"):
        _fit(NanAt(bad=(3,), where="grad"), None, clip_grad_norm=1.0)


def test_skip_equals_a_run_without_the_bad_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    skipped = NanAt(bad=(5, 7))
    summary = _fit(skipped, tmp_path / "skip", on_nonfinite="skip", lr_scheduler=_decay)
    # The reference: the same data with a zero gradient at steps 5 and 7 (plain SGD then moves nothing).
    reference = NanAt(bad=(5, 7), where="zero")
    _fit(reference, None, lr_scheduler=_skips_5_and_7)
    for a, b in zip(skipped.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    assert summary["nonfinite_skipped"] == 2 and summary["on_nonfinite"] == "skip" and math.isfinite(summary["train_loss"])
    records = [json.loads(line) for line in (tmp_path / "skip/metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train_loss" in r]
    assert [r.get("nonfinite_skipped") for r in train] == [None, None, 1, 2, 2]
    assert all(r["train_loss"] is not None for r in train)  # the skipped steps' losses are left out of the mean
    assert train[-1]["lr"] == pytest.approx(0.1 * 0.9**8, rel=1e-12)  # the scheduler did not step on the 2 skipped steps
    assert json.loads((tmp_path / "skip/summary.json").read_text())["nonfinite_skipped"] == 2
    err = capsys.readouterr().err
    assert (
        "step 5: non-finite loss and gradients on rank 0; first non-finite tensor: the loss (nan) on rank 0; on_nonfinite='skip': step skipped (1 so far)"
        in err
    )


def _decay(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 0.9**done)


def _skips_5_and_7(optimizer: torch.optim.Optimizer) -> Any:
    # the reference's schedule: 0.9 a step, but not after steps 5 and 7 (what 'skip' does to a scheduler)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 0.9 ** (done - (done >= 5) - (done >= 7)))


def test_warn_trains_on_and_pruning_keeps_the_newest_finite_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = NanAt()
    summary = _fit(model, tmp_path / "run", on_nonfinite="warn")
    err = capsys.readouterr().err
    assert err.count("on_nonfinite='warn': trained on it") == 6  # step 5, then the NaN weights' every step
    assert summary["nonfinite_trained"] == 6 and math.isnan(summary["train_loss"])
    # keep_last=3 kept steps 8, 9, 10 (NaN weights) and the newest finite one, step 4
    assert _steps(tmp_path / "run") == [4, 8, 9, 10]
    finite = {s: json.loads((tmp_path / f"run/checkpoints/step-{s:08d}/manifest.json").read_text())["finite"] for s in (4, 8)}
    assert finite == {4: True, 8: False}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.latest_valid(tmp_path / "run/checkpoints", finite=True).name == "step-00000004"
    assert sum("saved after a non-finite step" in str(w.message) for w in caught) == 3
    assert ckpt.latest_valid(tmp_path / "run/checkpoints").name == "step-00000010"  # without finite=: the newest, as before
    # the Trainer's resume='auto' goes back to the finite step 4, not onto step 10's NaN weights
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        again = _fit(NanAt(bad=()), tmp_path / "run", on_nonfinite="warn", max_steps=6, resume="auto")
    assert again["resumed_from"].endswith("step-00000004") and math.isfinite(again["train_loss"])
    # each skipped checkpoint is a line of the run's own, not a Python warning pointing into shardwise's source
    out = capsys.readouterr().out
    assert out.count("shardwise: resume='auto': skipping checkpoint") == 3 and not [w for w in raised if "non-finite" in str(w.message)]


def test_bad_setting_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"on_nonfinite must be 'stop', 'skip' or 'warn'; got 'ignore'"):
        Trainer(on_nonfinite="ignore")


def test_huge_but_finite_float32_gradients_and_losses_are_not_stopped() -> None:
    # A diverging run (the planner's timing at lr 1.0) reaches finite values whose float32 squares overflow:
    # the check must judge finiteness, not the range of its own arithmetic.
    from shardwise.comm.collectives import WORLD
    from shardwise.trainer.nonfinite import NonFiniteCheck

    model = nn.Linear(4, 4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e30)
    check = NonFiniteCheck(model, WORLD, None, check_grads=True, agree=False)
    assert check.verdict(1, torch.tensor(3e38)) is None
    model.bias.grad[1] = float("inf")
    verdict = check.verdict(2, torch.tensor(1.0))
    assert verdict is not None and verdict.first == "the gradient of bias on rank 0"
