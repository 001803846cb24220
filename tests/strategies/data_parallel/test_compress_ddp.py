"""Compression under ddp at world size 2: ModelPruning masks the same weights on every rank, and a
distilled student trains while its teacher stays frozen, in eval mode and bitwise unchanged."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import launch
from shardwise.tools.compress.distill import Distillation
from shardwise.tools.compress.prune import ModelPruning, masks, sparsity_of
from shardwise.tools.recipes.digits import DigitsMLP

pytestmark = pytest.mark.dist


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(512, 64, generator=g), torch.randint(0, 10, (512,), generator=g))


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode() + tensors[k].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _ce(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(output, batch[1])


class _RecordMasks(ModelPruning):
    """ModelPruning that keeps a digest of every rank's masks just before they are made permanent."""

    def on_fit_end(self, trainer, engine, summary):
        module = self._module(trainer, engine)
        self.mask_digest = _digest(masks(module))
        self.masked = {k: int((v == 0).sum()) for k, v in masks(module).items()}
        super().on_fit_end(trainer, engine, summary)


def _prune_and_distill() -> dict[str, Any]:
    from shardwise.trainer.loop import Trainer

    out: dict[str, Any] = {}
    # Pruning: ranks see different micro-batches, but ddp keeps their weights equal, so their masks agree.
    torch.manual_seed(0)
    model = DigitsMLP(hidden=32, dropout=0.0)
    rec = _RecordMasks(0.5, at_steps=(1, 3, 5), structured=False)
    Trainer(strategy="ddp", max_steps=6, global_batch_size=32, progress_bar=False, model_summary=False, callbacks=[rec], loss_fn=_ce).fit(model, _data())
    out["mask_digest"], out["masked"] = rec.mask_digest, sum(rec.masked.values())
    out["sparsity_zeros"] = sparsity_of(model)["zeros"]
    out["weights_digest"] = _digest(model.state_dict())
    # Distillation: the teacher is held by the loss, not by the strategy.
    torch.manual_seed(1)
    teacher = DigitsMLP(hidden=64, dropout=0.5)
    before = _digest(teacher.state_dict())
    student = DigitsMLP(hidden=16, dropout=0.0)
    start = _digest(student.state_dict())
    loss_fn = Distillation(teacher, temperature=4.0, soft_weight=0.9, hard_weight=0.1)
    Trainer(strategy="ddp", max_steps=4, global_batch_size=32, progress_bar=False, model_summary=False, loss_fn=loss_fn).fit(student, _data())
    out["teacher_before"], out["teacher_after"] = before, _digest(loss_fn.teacher.state_dict())
    out["teacher_eval"] = not any(m.training for m in loss_fn.teacher.modules())
    out["teacher_frozen"] = all(not p.requires_grad and p.grad is None for p in loss_fn.teacher.parameters())
    out["teacher_is_plain"] = type(loss_fn.teacher) is DigitsMLP
    out["student_moved"] = _digest(student.state_dict()) != start
    out["student_digest"] = _digest(student.state_dict())
    return out


def test_pruning_and_distillation_under_ddp():
    r0, r1 = launch(_prune_and_distill, nproc=2, threads_per_proc=1, timeout=150)
    n = 64 * 32 + 32 * 32 + 32 * 10
    assert r0["mask_digest"] == r1["mask_digest"] and r0["masked"] == r1["masked"] == round(0.5 * n)
    assert r0["sparsity_zeros"] == r1["sparsity_zeros"] == round(0.5 * n)
    assert r0["weights_digest"] == r1["weights_digest"]
    for r in (r0, r1):
        assert r["teacher_before"] == r["teacher_after"]  # bitwise
        assert r["teacher_eval"] and r["teacher_frozen"] and r["teacher_is_plain"] and r["student_moved"]
    assert r0["teacher_after"] == r1["teacher_after"] and r0["student_digest"] == r1["student_digest"]
