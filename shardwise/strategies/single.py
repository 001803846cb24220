"""``single``: one process, one device. The reference every other strategy is held to."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.mesh import Mesh
from shardwise.strategies.common import LocalModel
from shardwise.strategies.protocol import OptimizerFactory


def apply_single(model: nn.Module, device: torch.device) -> nn.Module:
    """Move the model to the device; nothing else."""
    return model.to(device)


class Single(LocalModel):
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

    def summary(self) -> dict[str, Any]:
        return {}
