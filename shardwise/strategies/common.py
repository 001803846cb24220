"""Pieces shared by strategies whose model runs whole on every rank (single, ddp, ...)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from shardwise.strategies.contract import Parallel, Placement, StepFn
from shardwise.strategies.precision import Precision


def accumulate_backward(
    model: nn.Module,
    microbatches: Sequence[Any],
    step_fn: StepFn,
    precision: Precision,
    no_sync: Callable[[], AbstractContextManager[None]] | None = None,
) -> torch.Tensor:
    """Forward and backward over the micro-batches; gradients synchronize on the last one only.

    Each micro-batch's loss is divided by their number, so the accumulated gradient
    is the gradient of the mean loss over the whole (per-rank) batch.
    """
    count = len(microbatches)
    if count == 0:
        raise ValueError("a step needs at least one micro-batch")
    if count == 1:  # the common case: no scaling, no running total
        with precision.autocast():
            loss = step_fn(model, microbatches[0])
        precision.backward(loss)
        return loss.detach()
    total: torch.Tensor | None = None
    for i, batch in enumerate(microbatches):
        # We only need to sync gradients at the last micro step.
        ctx = no_sync() if (no_sync is not None and i < count - 1) else contextlib.nullcontext()
        with ctx:
            with precision.autocast():
                loss = step_fn(model, batch)
            precision.backward(loss / count)
        # Stays on the device: no host sync per micro-batch.
        total = loss.detach() if total is None else total + loss.detach()
    assert total is not None
    return total / count


def clip_local(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the norm of this rank's gradients: the global norm when gradients are replicated."""
    params = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


def plain_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": module.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    return state


def load_plain_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    module.load_state_dict(state["model"])
    if optimizer is not None and "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])


class LocalParallel(Parallel):
    """A run whose every rank holds the whole model, unwrapped, and synchronizes nothing during
    backward: `single`, local SGD / DiLoCo / gossip replicas (which average after the step),
    parameter-server workers (which push gradients in the optimizer's step) and naive model
    parallelism (one process). Each rank clips the gradient it steps or pushes with, and its
    state is plain tensors under the module's own names. Subclasses add what they do after a
    step, their extra state and their report."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, placement: Placement | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self.placement = placement or Placement()

    def module(self) -> nn.Module:
        return self.model

    def forward_backward(self, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        return accumulate_backward(self.model, microbatches, step_fn, precision)

    def no_sync(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # nothing synchronizes in backward

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_local(self.model, max_norm)

    def state_dict(self, optimizer: bool) -> dict[str, Any]:
        return plain_state_dict(self.model, self.optimizer if optimizer else None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_plain_state_dict(self.model, self.optimizer, state)
