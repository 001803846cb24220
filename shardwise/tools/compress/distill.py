"""Knowledge distillation: a student trained on a frozen teacher's softened outputs plus the true labels.

Hinton, Vinyals and Dean 2015, "Distilling the Knowledge in a Neural Network", section 2: the
soft targets are the teacher's probabilities at temperature T, ``softmax(z_t / T)``; the
student's matching term is the cross entropy against them at the same T, which differs from
``KL(p_t || p_s)`` by the teacher's entropy, a constant for the student, so the KL is used (it is
0 when the student matches). Its gradients scale as 1/T^2, so the term is multiplied by T^2 to
keep its weight against the hard-label cross entropy (at T = 1) independent of T::

    loss = soft_weight * T^2 * KL(softmax(z_t/T) || softmax(z_s/T)) + hard_weight * CE(z_s, y)

with the KL summed over classes and averaged over samples (every position of a sequence is a
sample for a language model's (B, T, V) logits).

`Distillation` is a Trainer ``loss_fn``: it holds the teacher, runs it on each micro-batch's
input under ``torch.no_grad`` in eval mode, and returns the loss above. The teacher lives in the
loss, not in the model the Trainer is given, so no strategy wraps it, shards it, or syncs it: under
any data-parallel strategy each rank holds its own frozen copy (parameters with
``requires_grad=False``) and computes the soft targets of its own micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 2.0,
    soft_weight: float = 0.5,
    hard_weight: float = 0.5,
) -> torch.Tensor:
    """``soft_weight * T^2 * KL(softmax(t/T) || softmax(s/T)) + hard_weight * CE(s, target)`` (see the module docstring)."""
    classes = student_logits.shape[-1]
    s = student_logits.reshape(-1, classes).float()
    t = teacher_logits.reshape(-1, classes).float().to(s.device)
    soft = F.kl_div(F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1), log_target=True, reduction="batchmean")
    hard = F.cross_entropy(s, target.reshape(-1))
    return soft_weight * temperature**2 * soft + hard_weight * hard


def _first(batch: Any) -> Any:
    return batch[0]


def _last(batch: Any) -> Any:
    return batch[-1]


class Distillation:
    """A Trainer ``loss_fn`` that distills ``teacher`` into the model being trained.

    ``inputs(batch)`` is what the teacher is called on (the batch's first element by default) and
    ``targets(batch)`` the hard labels (its last). The teacher is frozen here, once: eval mode,
    ``requires_grad_(False)``; it moves to the student's device on first use.

    >>> trainer = Trainer(loss_fn=Distillation(teacher, temperature=4.0), strategy="ddp", nproc=2)  # doctest: +SKIP
    >>> trainer.fit(student, train, val)  # doctest: +SKIP
    """

    def __init__(
        self,
        teacher: nn.Module,
        *,
        temperature: float = 2.0,
        soft_weight: float = 0.5,
        hard_weight: float = 0.5,
        inputs: Callable[[Any], Any] = _first,
        targets: Callable[[Any], torch.Tensor] = _last,
    ) -> None:
        if not isinstance(teacher, nn.Module):
            raise ConfigError(f"Distillation needs the teacher as a torch.nn.Module; got {type(teacher).__name__}")
        if not temperature > 0:
            raise ConfigError(f"Distillation: temperature must be > 0 (1 is the plain softmax; Hinton et al. use 1 to 20); got {temperature!r}")
        if soft_weight < 0 or hard_weight < 0 or soft_weight + hard_weight == 0:
            raise ConfigError(f"Distillation: soft_weight and hard_weight must be >= 0 and not both 0; got {soft_weight!r} and {hard_weight!r}")
        self.teacher = teacher.eval().requires_grad_(False)
        self.temperature, self.soft_weight, self.hard_weight = float(temperature), float(soft_weight), float(hard_weight)
        self.inputs, self.targets = inputs, targets

    def teacher_logits(self, batch: Any, like: torch.Tensor) -> torch.Tensor:
        x = self.inputs(batch)
        param = next(self.teacher.parameters(), None)
        if param is not None and param.device != like.device:
            self.teacher.to(like.device)
            param = next(self.teacher.parameters())
        if param is not None and isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != param.dtype:
            x = x.to(param.dtype)  # the student may run in float64 (precision "64"); the teacher keeps its own dtype
        self.teacher.eval()  # whatever switched modes since, the teacher's dropout stays off
        with torch.no_grad():
            return self.teacher(x)

    def __call__(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        teacher = self.teacher_logits(batch, output)
        loss = distillation_loss(output, teacher, self.targets(batch), temperature=self.temperature, soft_weight=self.soft_weight, hard_weight=self.hard_weight)
        return loss.to(output.dtype)
