"""``single``: one process, one device. The reference every other strategy is held to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.comm.mesh import Mesh
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.strategies.common import LocalParallel
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Strategy, plan_layout


def apply_single(model: nn.Module, device: torch.device) -> nn.Module:
    """Move the model to the device; nothing else."""
    return model.to(device)


class SingleRun(LocalParallel):
    """The model on one device; nothing to synchronize, no state of its own."""

    def after_step(self, step: int) -> None:
        return None  # one process: nothing to average

    def save_extra_state(self, directory: Path) -> None:
        return None  # the model and optimizer hold everything

    def load_extra_state(self, path: Path) -> None:
        return None

    def finish(self) -> None:
        return None

    def summary(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class Single(Strategy):
    """The single-process reference strategy (no options)."""

    name: ClassVar[str] = "single"
    needs_process_group: ClassVar[bool] = False  # one process, no group: the Trainer runs it in the caller's process
    smaller_last_batch: ClassVar[bool] = True

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        if world_size != 1:
            raise ConfigError(
                f"strategy 'single' runs one process; got a world size of {world_size}. "
                "Use strategy='ddp' (or another data-parallel strategy) for several processes"
            )
        return plan_layout(self.name, world_size, batch=batch, mesh=mesh)

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> SingleRun:
        model = apply_single(model, mesh.device)
        return SingleRun(model, make_optimizer(model.parameters()))
