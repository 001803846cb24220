"""``ddp``: replicate the model on every rank and average gradients (torch's DistributedDataParallel).

Each rank holds the whole model and optimizer; after backward, gradients are
averaged across the data-parallel group in buckets that overlap with the rest of
backward (Li et al., "PyTorch Distributed", VLDB 2020). Gradient accumulation
skips that allreduce on all but the last micro-batch (``no_sync``).

The bucket allreduce goes through a communication hook that records each bucket
in the run's `Recorder`, so DDP's traffic shows up in ``summary.json`` like any
other collective. Options ``allreduce="ring"`` (or any algorithm of
`shardwise.comm.algorithms`) and ``compression="int8"`` (or any codec of
`shardwise.comm.codecs`) swap in our own hooks from `shardwise.comm.hooks`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise.comm.collectives import Group
from shardwise.comm.hooks import make_comm_hook, parse_options
from shardwise.comm.recorder import CommEvent, Recorder, wire_bytes
from shardwise.errors import ConfigError
from shardwise.mesh import Mesh
from shardwise.precision import Precision
from shardwise.strategies.common import accumulate_backward, clip_local, load_plain_state_dict, plain_state_dict
from shardwise.strategies.protocol import OptimizerFactory, StepFn


@dataclass
class _HookState:
    group: Group
    recorder: Recorder


def recorded_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's default hook (divide, then sum across the group), with the bucket recorded.

    (state: _HookState, bucket: dist.GradBucket) -> Future[Tensor]. Unannotated on
    purpose: DDP rejects a hook whose annotations are strings, which they are
    under ``from __future__ import annotations``.
    """
    buf = bucket.buffer()
    p = state.group.size
    n = buf.numel() * buf.element_size()
    sent, recv = wire_bytes("all_reduce", n, p)
    start = time.perf_counter()
    buf.div_(p)
    fut = dist.all_reduce(buf, group=state.group.pg, async_op=True).get_future()

    def done(f: torch.futures.Future[Any]) -> torch.Tensor:
        state.recorder.add(CommEvent("all_reduce", state.group.name, p, n, sent, recv, time.perf_counter() - start))
        return f.value()[0]

    return fut.then(done)


def apply_ddp(
    model: nn.Module, mesh: Mesh, recorder: Recorder, *, allreduce: str = "native", compression: str | None = None, **ddp_kwargs: Any
) -> DistributedDataParallel:
    """Wrap ``model`` (already on its device) in DDP over the mesh's data-parallel group.

    ``allreduce`` names the algorithm that averages each gradient bucket and
    ``compression`` a codec (see `shardwise.comm.hooks`); with neither, buckets go
    through the backend's own allreduce.
    """
    group = mesh.group("dp")
    device_ids = [mesh.device.index] if mesh.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=group.pg, **ddp_kwargs)
    if allreduce == "native" and compression in (None, "", "none"):
        ddp.register_comm_hook(_HookState(group, recorder), recorded_allreduce_hook)
    else:
        ddp.register_comm_hook(*make_comm_hook(group, recorder, allreduce=allreduce, compression=compression))
    return ddp


class DDP:
    """Distributed data parallel: whole model per rank, gradients averaged each step."""

    name: ClassVar[str] = "ddp"

    def __init__(
        self,
        *,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        broadcast_buffers: bool = True,
        allreduce: str = "native",
        compression: str | None = None,
    ) -> None:
        if bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be > 0; got {bucket_cap_mb}")
        parse_options(allreduce, compression)  # a bad name fails here, before any process starts
        self.allreduce, self.compression = allreduce, compression
        self.kwargs = dict(
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=True,
        )
        if not broadcast_buffers:  # passed only when changed: torch 2.13 deprecates the name
            self.kwargs["broadcast_buffers"] = False
        self.world_size = 1

    def validate(self, world_size: int) -> None:
        if world_size < 1:
            raise ConfigError(f"ddp needs at least one process; got a world size of {world_size}")

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[nn.Module, torch.optim.Optimizer]:
        if not dist.is_initialized():
            raise ConfigError("strategy 'ddp' needs a process group; start the run with nproc >= 1 through shardwise (Trainer, launch, or shardwise run)")
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(f"ddp got a model with no trainable parameters ({type(model).__name__}); nothing to synchronize")
        self.world_size = mesh.size("dp")
        wrapped = apply_ddp(model.to(mesh.device), mesh, recorder, allreduce=self.allreduce, compression=self.compression, **self.kwargs)
        return wrapped, make_optimizer(wrapped.parameters())

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def forward_backward(self, model: nn.Module, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        return accumulate_backward(model, microbatches, step_fn, precision, no_sync=lambda: self.no_sync(model))

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"no_sync needs the model returned by setup (a DistributedDataParallel); got {type(model).__name__}")
        return model.no_sync()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        # After the allreduce every rank holds the same full gradient: its local norm is global.
        return clip_local(model, max_norm)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return plain_state_dict(self.unwrap(model), optimizer)

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
        load_plain_state_dict(self.unwrap(model), optimizer, state)

    def summary(self) -> dict[str, Any]:
        return {"ddp": {"bucket_cap_mb": self.kwargs["bucket_cap_mb"], "world_size": self.world_size,
                        "allreduce": self.allreduce, "compression": self.compression}}
