"""Non-finite losses and gradients: caught at the step they appear, on every rank, agreed.

Each training step, after backward and before the optimizer, every training rank checks its loss and
its gradients (`NonFiniteCheck`); ``on_nonfinite`` (a `TrainerConfig` field: "stop", "skip" or "warn")
says what then happens (`act_on`). The design, its cost and each mode: docs/trainer.md, "Non-finite
steps".
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise import checkpoint as ckpt
from shardwise.comm import Group, Recorder, all_reduce
from shardwise.errors import ShardwiseError

MODES = ("stop", "skip", "warn")


class NonFiniteError(ShardwiseError):
    """A training step whose loss or gradients were not finite, under ``on_nonfinite="stop"``."""


@dataclass(frozen=True)
class Verdict:
    """What one step's check found, the same on every rank of the loop."""

    step: int
    loss_ranks: tuple[int, ...]
    """Global ranks whose loss was not finite."""
    grad_ranks: tuple[int, ...]
    """Global ranks with a non-finite gradient."""
    first: str
    """The first non-finite tensor: ``the loss (nan) on rank 1`` or ``the gradient of fc.weight on rank 0``."""

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.loss_ranks) | set(self.grad_ranks)))

    def describe(self) -> str:
        parts = []
        if self.loss_ranks and self.loss_ranks == self.grad_ranks:  # a NaN loss makes NaN gradients: one phrase
            parts.append(f"loss and gradients on {_ranks(self.loss_ranks)}")
        elif self.loss_ranks:
            parts.append(f"loss on {_ranks(self.loss_ranks)}")
        if self.grad_ranks and self.loss_ranks != self.grad_ranks:
            parts.append(f"gradients on {_ranks(self.grad_ranks)}")
        return f"step {self.step}: non-finite {' and '.join(parts)}; first non-finite tensor: {self.first}"


def _ranks(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's norm would run a collective; this rank's shard is what it can vouch for.
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class NonFiniteCheck:
    """The per-step check of one fit: ``verdict(step, loss)`` before the optimizer steps."""

    def __init__(self, module: nn.Module, group: Group, recorder: Recorder | None, *, check_grads: bool, agree: bool = True) -> None:
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.group, self.recorder, self.check_grads = group, recorder, check_grads
        self.size = group.size if agree else 1
        """The ranks that agree on a verdict: the loop's group, or this rank alone where ranks step alone."""
        self._names_hash = int.from_bytes(hashlib.sha256("\n".join(n for n, _ in self.named).encode()).digest()[:6], "big")

    def verdict(self, step: int, loss: torch.Tensor) -> Verdict | None:
        """None when every rank's loss and gradients are finite, else what was not (every rank calls it)."""
        # The common path is a few kernels and one read of one number: the loss plus the sum of every
        # gradient's norm is finite exactly when each of them is (a NaN or an infinity propagates
        # through the sum, and through a sum over the ranks: that reduction is the agreement).
        loss = loss.detach()
        total = loss.reshape(-1)[0] if loss.numel() else torch.zeros((), device=loss.device)
        grads = self._grads() if self.check_grads else []
        if grads:
            # float64 accumulation: a finite float32 gradient's norm is then finite too (magnitudes up to 3e38
            # square to 1e77), so only a NaN or an infinity raises the flag
            total = total + torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).sum().to(total.device)
        if self.size > 1:
            total = all_reduce(total.reshape(1).to(torch.float64), "sum", group=self.group, recorder=self.recorder)
        if math.isfinite(total.item()):
            return None
        return self._explain(step, self._row(loss))

    def _grads(self) -> list[torch.Tensor]:
        return [_local(p.grad) for _, p in self.named if p.grad is not None]

    def _row(self, loss: torch.Tensor) -> list[float]:
        """This rank's findings (failure path only): a code (1 the loss, 2 a gradient), the index of
        its first non-finite gradient in ``named`` (-1 none), its loss."""
        value = float(loss.double().mean()) if loss.numel() else 0.0
        code, first = (0 if math.isfinite(value) and bool(torch.isfinite(loss).all()) else 1), -1
        if self.check_grads:
            for i, (_, p) in enumerate(self.named):
                if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all()):
                    code, first = code | 2, i
                    break
        return [float(code), float(first), value]

    def _explain(self, step: int, row: list[float]) -> Verdict:
        # Failure path only: each rank's findings and whether it names its parameters as this one
        # does (every data-parallel strategy; pipeline and tp stages do not), in one more reduction.
        size = self.size
        rows = [[*row, float(self._names_hash)]]
        if size > 1:
            table = torch.zeros(size, 4, dtype=torch.float64)
            table[self.group.rank] = torch.tensor(rows[0], dtype=torch.float64)
            rows = all_reduce(table.to(self._device()), "sum", group=self.group, recorder=self.recorder).tolist()
        glob = [self.group.global_rank(i) for i in range(size)] if size > 1 else [self._own_rank()]
        loss_ranks = tuple(glob[i] for i, r in enumerate(rows) if int(r[0]) & 1)
        grad_ranks = tuple(glob[i] for i, r in enumerate(rows) if int(r[0]) & 2)
        me = self.group.rank if size > 1 else 0
        if loss_ranks:
            i = glob.index(loss_ranks[0])
            first = f"the loss ({rows[i][2]}) on rank {loss_ranks[0]}"
        elif grad_ranks:
            i = glob.index(grad_ranks[0])
            index = int(rows[i][1])
            if rows[i][3] == rows[me][3] and 0 <= index < len(self.named):
                first = f"the gradient of {self.named[index][0]} on rank {grad_ranks[0]}"
            else:
                first = f"the gradient of rank {grad_ranks[0]}'s parameter #{index} (its own module's named_parameters order)"
        else:  # every tensor finite on its own: a sum past float64's range (1.8e308), which no finite float32 run reaches
            first = "a value beyond float64's range (the sum of the loss and the gradients' norms)"
        return Verdict(step, loss_ranks, grad_ranks, first)

    def _device(self) -> torch.device:
        return self.named[0][1].device if self.named else torch.device("cpu")

    def _own_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0


def stop_message(verdict: Verdict, newest_finite: Any) -> str:
    """The `NonFiniteError` text: what, where, what was kept, how to go on."""
    kept = f"the newest checkpoint, {newest_finite}, is finite and kept (resume='auto' takes it)" if newest_finite else "no checkpoint was written"
    return (
        f"{verdict.describe()}. on_nonfinite='stop': the optimizer step was not taken and the run stopped; {kept}. "
        "Lower the learning rate or set clip_grad_norm=..., or set on_nonfinite='skip' (skip such steps, as a grad scaler does) "
        "or 'warn' (train on them)"
    )


def act_on(mode: str, verdict: Verdict, counters: dict[str, Any], write: Callable[[str], None], ckpt_root: Path | None) -> bool:
    """What ``on_nonfinite`` (``mode``) does with a step the check found non-finite; True when the step
    is to be skipped. Every rank gets the same verdict and does the same; ``write`` says the line."""
    if mode == "stop":
        newest = next((p for p in reversed(ckpt.list_checkpoints(ckpt_root)) if ckpt.is_finite(p)), None) if ckpt_root is not None else None
        raise NonFiniteError(stop_message(verdict, newest))
    if mode == "skip":
        counters["nonfinite_skipped"] = int(counters["nonfinite_skipped"]) + 1
        write(f"shardwise: {verdict.describe()}; on_nonfinite='skip': step skipped ({counters['nonfinite_skipped']} so far)")
        return True
    counters["nonfinite_trained"] = int(counters["nonfinite_trained"]) + 1
    counters["weights_finite"] = False
    write(f"shardwise: warning: {verdict.describe()}; on_nonfinite='warn': trained on it")
    return False
