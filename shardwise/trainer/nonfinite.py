"""Non-finite losses and gradients: caught at the step they appear, on every rank, agreed.

Each training step, after backward and before the optimizer, every training rank checks its own
loss and its own gradients (the local shard of a sharded one) with ``isfinite``: the gradients
through one ``torch._foreach_norm(grads, inf)`` (the largest magnitude per tensor: a NaN or an
infinity propagates and a finite value never overflows, which a 2-norm of large finite values
could), taken before clipping so that the first bad tensor can be named (clipping multiplies every
gradient by a NaN norm). When the loop runs on more than one rank, one all-reduce of a
``group size x 3`` float64 tensor (each rank fills its own row: a code, the index of its first
non-finite gradient, its loss) makes the verdict the same everywhere; it is the only collective
added, and the single-process path syncs only to read that small tensor. ``benchmarks/nonfinite.py``
measures the per-step cost side by side.

``on_nonfinite`` (a `TrainerConfig` field) says what then happens:

- ``"stop"`` (the default): no optimizer step is taken and every rank raises `NonFiniteError`
  naming the step, the ranks and the first non-finite tensor (the loss, or the first parameter whose
  gradient is not finite, by name). No checkpoint is written after it, so the newest one is finite.
- ``"skip"``: the step is skipped as torch's ``GradScaler`` skips an overflowing one: no optimizer
  step, and the learning-rate scheduler does not step either (the loop steps the scheduler only
  after a step the optimizer took, as after a grad scaler's skip); the gradients are dropped, the
  data is consumed, the step counter advances. Counted as ``nonfinite_skipped`` in the log and
  ``summary.json``; its loss is left out of the logged mean.
- ``"warn"``: the step is trained on (the behaviour before this check), with one line per step.

Under ``precision="16-mixed"`` the grad scaler checks the gradients itself and skips the steps that
overflow, lowering its scale: that is its job, so the gradients are not checked here (a skip of the
scaler is not an error); the loss still is.

Checkpoints record whether the weights they hold came only from finite steps (``finite`` and
``loss`` in the manifest); pruning keeps the newest finite one and ``resume="auto"`` takes it
(`shardwise.checkpoint.files`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

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
    return to_local() if callable(to_local) else t  # type: ignore[no-any-return]


class NonFiniteCheck:
    """The per-step check of one fit: ``verdict(step, loss)`` before the optimizer steps."""

    def __init__(self, module: nn.Module, group: Group, recorder: Recorder | None, *, check_grads: bool) -> None:
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.group, self.recorder, self.check_grads = group, recorder, check_grads
        self._names_hash = int.from_bytes(hashlib.sha256("\n".join(n for n, _ in self.named).encode()).digest()[:6], "big")

    def verdict(self, step: int, loss: torch.Tensor) -> Verdict | None:
        """None when every rank's loss and gradients are finite, else what was not (every rank calls it)."""
        loss = loss.detach()
        row = torch.zeros(3, dtype=torch.float64, device=loss.device)
        loss_bad = ~torch.isfinite(loss).all()
        row[0] = loss_bad.double()
        row[1] = -1.0
        row[2] = loss.double().mean() if loss.numel() else 0.0
        if self.check_grads:
            present = [i for i, (_, p) in enumerate(self.named) if p.grad is not None]
            if present:
                grads = [_local(self.named[i][1].grad) for i in present]  # type: ignore[arg-type]
                finite = torch.stack([n.to(row.device, torch.float64) for n in torch._foreach_norm(grads, float("inf"))]).isfinite()
                bad = ~finite.all()
                first = torch.tensor(present, device=row.device, dtype=torch.float64)[(~finite).to(torch.int8).argmax()]
                row[0] += 2.0 * bad.double()
                row[1] = torch.where(bad, first, row[1])
        size = self.group.size
        if size > 1:
            table = torch.zeros(size, 3, dtype=torch.float64, device=row.device)
            table[self.group.rank] = row
            rows = all_reduce(table, "sum", group=self.group, recorder=self.recorder).tolist()
        else:
            rows = [row.tolist()]
        if not any(r[0] for r in rows):
            return None
        return self._explain(step, rows)

    def _explain(self, step: int, rows: list[list[float]]) -> Verdict:
        # Failure path only: one more small reduction, to know whether the other ranks name their
        # parameters as this one does (every data-parallel strategy; pipeline and tp stages do not).
        size = self.group.size
        hashes = [float(self._names_hash)]
        if size > 1:
            table = torch.zeros(size, dtype=torch.float64)
            table[self.group.rank] = float(self._names_hash)
            hashes = all_reduce(table.to(self._device()), "sum", group=self.group, recorder=self.recorder).tolist()
        glob = [self.group.global_rank(i) if size > 1 else self._own_rank() for i in range(size)]
        loss_ranks = tuple(glob[i] for i, r in enumerate(rows) if int(r[0]) & 1)
        grad_ranks = tuple(glob[i] for i, r in enumerate(rows) if int(r[0]) & 2)
        if loss_ranks:
            i = glob.index(loss_ranks[0])
            first = f"the loss ({rows[i][2]}) on rank {loss_ranks[0]}"
        else:
            i = glob.index(grad_ranks[0])
            index = int(rows[i][1])
            me = self.group.rank if size > 1 else 0
            if hashes[i] == hashes[me] and 0 <= index < len(self.named):
                first = f"the gradient of {self.named[index][0]} on rank {grad_ranks[0]}"
            else:
                first = f"the gradient of rank {grad_ranks[0]}'s parameter #{index} (its own module's named_parameters order)"
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
