"""``single``: one process, one device. The reference every other strategy is held to."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, ContextManager, Sequence

import torch
from torch import nn

from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.mesh import Mesh
from shardwise.precision import Precision
from shardwise.strategies.common import accumulate_backward, clip_local, load_plain_state_dict, plain_state_dict
from shardwise.strategies.protocol import OptimizerFactory, StepFn


def apply_single(model: nn.Module, device: torch.device) -> nn.Module:
    """Move the model to the device; nothing else."""
    return model.to(device)


class Single:
    """The single-process reference strategy."""

    name: ClassVar[str] = "single"

    def validate(self, world_size: int) -> None:
        if world_size != 1:
            raise ConfigError(
                f"strategy 'single' runs one process; got a world size of {world_size}. "
                "Use strategy='ddp' (or another data-parallel strategy) for several processes"
            )

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = apply_single(model, mesh.device)
        return model, make_optimizer(model.parameters())

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def forward_backward(self, model: nn.Module, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        return accumulate_backward(model, microbatches, step_fn, precision)

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_local(model, max_norm)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        return plain_state_dict(model, optimizer)

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
        load_plain_state_dict(model, optimizer, state)

    def summary(self) -> dict[str, Any]:
        return {}
