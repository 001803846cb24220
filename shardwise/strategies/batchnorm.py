"""Batch normalization over the global batch under data parallelism (SyncBatchNorm).

Under data parallelism each rank sees ``global batch / dp`` samples. A plain BatchNorm then
normalizes with its own rank's statistics, which is a different model from the one trained
on the whole batch (and the running statistics drift apart per rank; rank 0's are saved).
``sync_batchnorm=True`` replaces every BatchNorm with `SyncBatchNorm`, whose training-mode
statistics are the global batch's: each rank sums ``x`` and ``x**2`` per channel and the
counts, one all-reduce of ``2C + 1`` numbers per layer and forward, and the same all-reduce
of their gradients in backward (Ioffe and Szegedy 2015 for the normalization; the
reduction is what torch's CUDA-only ``nn.SyncBatchNorm`` does, written here so it also runs
on CPU and gloo). Summing the statistics' gradients over ranks is exact: the objective is
the mean of the ranks' losses, and each rank's input affects every rank's loss through the
shared mean and variance.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from shardwise.comm import Group, Recorder, all_reduce


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group, differentiable: the backward sums the gradients the same way."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group, recorder: Recorder | None) -> torch.Tensor:
        ctx.group, ctx.recorder = group, recorder
        return all_reduce(tensor.clone(), "sum", group=group, recorder=recorder)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_reduce(grad.contiguous().clone(), "sum", group=ctx.group, recorder=ctx.recorder), None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the whole batch across ``group``."""

    def __init__(self, bn: _BatchNorm, group: Group, recorder: Recorder | None = None) -> None:
        super().__init__(
            bn.num_features,
            bn.eps,
            bn.momentum,
            bn.affine,
            bn.track_running_stats,
            device=bn.weight.device if bn.weight is not None else None,
            dtype=bn.weight.dtype if bn.weight is not None else None,
        )
        self.weight, self.bias = bn.weight, bn.bias  # the same Parameters (optimizers and ties see them)
        if bn.track_running_stats:
            self.running_mean, self.running_var = bn.running_mean, bn.running_var
            self.num_batches_tracked = bn.num_batches_tracked
        self.group, self.recorder = group, recorder
        self._dim = bn._check_input_dim

    def _check_input_dim(self, input: torch.Tensor) -> None:
        self._dim(input)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training or self.group.size == 1:
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = torch.tensor([x.numel() // x.shape[1]], dtype=x.dtype, device=x.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        stats = _AllReduceSum.apply(stats, self.group, self.recorder)
        c = self.num_features
        n = stats[2 * c]
        mean = stats[:c] / n
        var = stats[c : 2 * c] / n - mean * mean  # biased, as BatchNorm normalizes
        tracked = self.num_batches_tracked
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None and tracked is not None:
            with torch.no_grad():
                tracked.add_(1)
                momentum = (1.0 / float(tracked)) if self.momentum is None else self.momentum
                self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
                unbiased = var.detach() * (n / (n - 1)).detach()
                self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        y = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.affine:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return y


UNSYNCED_REPLICAS = ("ps", "central", "local-sgd", "diloco", "gossip")
"""Strategies whose replicas do not take every step together: a per-forward all-reduce of
statistics would mix models of different steps (or wait on a worker that is elsewhere)."""


def check_sync_batchnorm(strategy: str, sync: bool) -> None:
    """A ConfigError for sync_batchnorm under a strategy whose replicas step apart."""
    if sync and strategy in UNSYNCED_REPLICAS:
        from shardwise.errors import ConfigError

        raise ConfigError(
            f"sync_batchnorm=True needs replicas that take every step together (ddp, zero1-3, fsdp, hsdp, tp, "
            f"pipeline); strategy {strategy!r} lets them run apart, so a statistic shared per forward has no "
            "meaning there. Drop sync_batchnorm, or choose ddp/fsdp"
        )


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Names of the model's BatchNorm layers (any ``_BatchNorm``, SyncBatchNorm included)."""
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def convert_sync_batchnorm(model: nn.Module, group: Group, recorder: Recorder | None = None) -> int:
    """Replace every BatchNorm of ``model`` in place by `SyncBatchNorm` over ``group``; returns how many."""
    converted = 0
    for name, child in list(model.named_children()):
        if isinstance(child, _BatchNorm) and not isinstance(child, (SyncBatchNorm, nn.SyncBatchNorm)):
            setattr(model, name, SyncBatchNorm(child, group, recorder))
            converted += 1
        else:
            converted += convert_sync_batchnorm(child, group, recorder)
    return converted


def unsynced_batchnorm_warning(model: nn.Module, dp: int, micro_batch: int | None = None) -> str | None:
    """The warning for a model with BatchNorm trained data-parallel without sync_batchnorm, or None."""
    layers = batchnorm_layers(model)
    if dp <= 1 or not layers:
        return None
    per_rank = f" of {micro_batch} samples" if micro_batch else ""
    return (
        f"shardwise: warning: {type(model).__name__} has {len(layers)} BatchNorm layers ({layers[0]}, ...) and trains "
        f"data-parallel over {dp} ranks: each rank normalizes with its own batch{per_rank}, not the global batch's "
        "statistics, and only rank 0's running statistics are saved. Set sync_batchnorm=True (--set "
        "trainer.sync_batchnorm=true) for statistics over the global batch."
    )
