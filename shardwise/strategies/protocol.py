"""The contract every strategy meets, and the types it speaks in."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, ContextManager, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from shardwise.comm.recorder import Recorder
from shardwise.mesh import Mesh
from shardwise.precision import Precision

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
"""Builds the optimizer from parameters (``lambda params: torch.optim.Adam(params, lr=1e-3)``).
Strategies that shard call it after wrapping, on the parameters they keep."""

StepFn = Callable[[nn.Module, Any], torch.Tensor]
"""Runs forward on one micro-batch through the wrapped model and returns the loss."""


@runtime_checkable
class Strategy(Protocol):
    """How a model is placed, wrapped and synchronized across processes.

    A strategy is a small object built from its options (``DDP(bucket_cap_mb=25)``);
    ``setup`` applies it. The trainer and engine call only these methods, so a new
    strategy plugs in by registering a name, without touching them.
    """

    name: ClassVar[str]

    def validate(self, world_size: int) -> None:
        """Raise `ConfigError` for a world size (or options) this strategy cannot run; called before launch."""

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Place and wrap the model, then build the optimizer on the parameters this rank keeps."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper ``setup`` returned."""

    def forward_backward(self, model: nn.Module, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        """Forward and backward over one step's micro-batches; returns the mean loss (detached)."""

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        """Skip gradient synchronization inside the block (accumulation)."""

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip gradients by their global norm (across every shard) and return that norm."""

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Model (and optimizer, when given) state under the original module's parameter names."""

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict``."""

    def summary(self) -> dict[str, Any]:
        """This strategy's own section of summary.json."""
