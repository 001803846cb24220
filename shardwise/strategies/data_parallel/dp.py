"""``dp``: one process drives every GPU of the machine (torch's ``nn.DataParallel``).

Each forward scatters the batch across the devices, replicates the module onto them, runs the
replicas in threads and gathers the outputs on the first device; backward sums the replicas'
gradients there. One process and one optimizer, so it needs no process group and no launcher,
but the GIL and the per-step replication make it slower than ``ddp`` with one process per GPU
(torch's own documentation recommends DDP). It exists for notebooks on a multi-GPU machine.
On CPU, or with fewer than two GPUs, the plan refuses it before anything runs.
"""

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
from shardwise.strategies.common import LocalParallel, load_plain_state_dict, plain_state_dict
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Strategy, plan_layout


class DataParallelRun(LocalParallel):
    """The wrapper on the first device; gradients arrive summed there, so clipping is local."""

    def __init__(self, wrapped: nn.DataParallel[nn.Module], optimizer: torch.optim.Optimizer) -> None:
        super().__init__(wrapped, optimizer)
        self.wrapped = wrapped

    def module(self) -> nn.Module:
        return self.wrapped.module

    def state_dict(self, optimizer: bool) -> dict[str, Any]:
        return plain_state_dict(self.module(), self.optimizer if optimizer else None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_plain_state_dict(self.module(), self.optimizer, state)

    def after_step(self, step: int) -> None:
        return None  # one optimizer on the first device: nothing to average

    def save_extra_state(self, directory: Path) -> None:
        return None  # the replicas are rebuilt from the module on every forward

    def load_extra_state(self, path: Path) -> None:
        return None

    def finish(self) -> None:
        return None

    def summary(self) -> dict[str, Any]:
        return {"dp": {"devices": list(self.wrapped.device_ids)}}


@dataclass(frozen=True)
class DataParallel(Strategy):
    """Single-process, multi-GPU data parallelism."""

    name: ClassVar[str] = "dp"
    compile_unit: ClassVar[str] = "none"
    compile_refusal: ClassVar[str] = "torch.compile does not trace nn.DataParallel's threads, one per device"
    smaller_last_batch: ClassVar[bool] = True

    device_ids: tuple[int, ...] | None = None
    """CUDA device indices to split each batch over (default: every visible GPU)."""

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        if world_size != 1:
            raise ConfigError(f"strategy 'dp' drives every GPU from one process; got a world size of {world_size}. Use strategy='ddp' for one process per GPU")
        count = torch.cuda.device_count()
        if count < 2:
            raise ConfigError(
                f"strategy 'dp' splits each batch across the GPUs of one process and needs at least 2 CUDA devices; "
                f"this machine has {count}. Use strategy='single' for one device, or 'ddp' with nproc=N"
            )
        wanted = list(self.device_ids or range(count))
        if len(wanted) < 2 or any(not 0 <= d < count for d in wanted):
            raise ConfigError(f"dp device_ids must be 2 or more of 0..{count - 1}; got {wanted}")
        return plan_layout(self.name, world_size, batch=batch, mesh=mesh)

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> DataParallelRun:
        ids = list(self.device_ids or range(torch.cuda.device_count()))
        wrapped = nn.DataParallel(model.to(torch.device("cuda", ids[0])), device_ids=ids)
        return DataParallelRun(wrapped, make_optimizer(wrapped.parameters()))
