"""Non-finite steps under ddp, world 2, the NaN on rank 1 only: both ranks agree (stop, skip, warn); and
drop_last=False under ddp equal to a loop over the whole data set (in the same launch)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Trainer, launch
from shardwise import checkpoint as ckpt
from shardwise.data import epoch_permutation
from shardwise.trainer.nonfinite import NonFiniteError

pytestmark = pytest.mark.dist


class NanOnRank(nn.Module):
    """``x * nan`` from the training forward of ``rank`` at ``steps`` (``zero``: ``x * 0`` on every rank there)."""

    def __init__(self, steps: tuple[int, ...] = (5,), rank: int = 1, zero: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        self.steps, self.rank, self.zero, self.calls = steps, rank, zero, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        out = self.net(x)
        if self.training and self.calls in self.steps:
            if self.zero:
                return out * 0.0  # type: ignore[no-any-return]
            if dist.get_rank() == self.rank:
                return out * float("nan")  # type: ignore[no-any-return]
        return out  # type: ignore[no-any-return]


class LossOnlyNan(NanOnRank):
    """A NaN loss on rank 1 at step 3 whose gradients stay finite (zero: the loss replaced by a NaN constant): the
    gradients' all-reduce cannot carry it to rank 0; only the check's own agreement does."""

    def training_step(self, batch: Any) -> torch.Tensor:
        self.calls += 1
        loss = _ce(self.net(batch[0]), batch)
        if self.calls in self.steps and dist.get_rank() == self.rank:
            loss = loss + torch.tensor(float("nan"), dtype=loss.dtype)  # d/d(loss) is still 1: finite gradients
        return loss


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def _ce(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _trainer(**settings: Any) -> Trainer:
    base: dict[str, Any] = dict(strategy="ddp", global_batch_size=8, max_steps=8, log_every=4, progress_bar=False, model_summary=False)
    return Trainer(optimizer=_sgd, loss_fn=_ce, timeout_s=60, **{**base, **settings})


def test_stop_on_both_ranks_one_report_newest_finite_checkpoint_kept(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError) as err:
        _trainer(nproc=2, out=str(out), checkpoint_every=2, keep_last=3).fit(NanOnRank(), _data())
    text = str(err.value)
    assert text.startswith("step 5: non-finite loss on rank 1 and gradients on ranks 0, 1; first non-finite tensor: the loss (nan) on rank 1")
    report = str(err.value.__cause__)
    assert re.match(r"ranks (0, 1|1, 0) failed: NonFiniteError: step 5: ", report) and "then:" not in report  # both agreed: one block
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step-00000002", "step-00000004"]
    assert "checkpoints/step-00000004, is finite and kept" in text


def _in_workers(out: str) -> dict[str, Any]:
    # skip, its reference (zero gradients at the same steps: plain SGD moves nothing) and warn, in one launch
    skipped = NanOnRank(steps=(3, 5))
    summary = _trainer(on_nonfinite="skip", out=out + "/skip").fit(skipped, _data())
    reference = NanOnRank(steps=(3, 5), zero=True)
    _trainer().fit(reference, _data())
    warned = NanOnRank(steps=(5,))
    warn_summary = _trainer(on_nonfinite="warn").fit(warned, _data())
    # drop_last=False under ddp: 66 samples in batches of 16 over 2 ranks x 2 micro-batches; the last step's 2
    # samples leave two parts a weight-0 copy. Equal to a loop over the whole data set by hand.
    kept = NanOnRank(steps=())
    x, y = _data(66).tensors
    _trainer(global_batch_size=16, accumulate=2, max_epochs=1, max_steps=None, drop_last=False).fit(kept, TensorDataset(x, y))
    ref = NanOnRank(steps=())
    opt = _sgd(ref.parameters())
    perm = epoch_permutation(66, 0, 0)
    for start in range(0, 66, 16):
        idx = perm[start : start + 16]
        _ce(ref(x[idx]), (None, y[idx])).backward()
        opt.step()
        opt.zero_grad()
    loss_only = LossOnlyNan(steps=(3,))
    only = Trainer(strategy="ddp", global_batch_size=8, max_steps=4, log_every=4, progress_bar=False, model_summary=False, on_nonfinite="skip", optimizer=_sgd)
    return {
        "loss_only_skipped": only.fit(loss_only, _data())["nonfinite_skipped"],
        "drop_last_diff": max((a - b).abs().max().item() for a, b in zip(kept.parameters(), ref.parameters(), strict=True)),
        "skipped": summary["nonfinite_skipped"],
        "train_loss": summary["train_loss"],
        "equal": all(torch.equal(a, b) for a, b in zip(skipped.parameters(), reference.parameters(), strict=True)),
        "warned": warn_summary["nonfinite_trained"],
        "warn_finite": all(bool(p.isfinite().all()) for p in warned.parameters()),
    }


def test_skip_and_warn_agree_across_ranks(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    results = launch(_in_workers, str(tmp_path), nproc=2, timeout=150)
    for r in results:
        assert r["skipped"] == 2 and r["equal"] and math.isfinite(r["train_loss"])
        assert r["drop_last_diff"] < 1e-14
        assert r["loss_only_skipped"] == 1  # rank 0's loss and gradients were finite: it skipped because rank 1 said so
        assert r["warned"] == 4 and not r["warn_finite"]  # steps 5-8 trained on NaN, on both ranks
    record = [json.loads(line) for line in (tmp_path / "skip/metrics.jsonl").read_text().splitlines()][-1]
    assert record["nonfinite_skipped"] == 2 and record["step"] == 8
    err = capfd.readouterr().err
    assert err.count("on_nonfinite='skip': step skipped") == 3  # rank 0 says it, once a step (2 + the loss-only run's 1)
    assert "step 3: non-finite loss on rank 1; first non-finite tensor: the loss (nan) on rank 1; on_nonfinite='skip'" in err
    assert "step 5: non-finite loss on rank 1 and gradients on ranks 0, 1; first non-finite tensor: the loss (nan) on rank 1; on_nonfinite='warn'" in err
