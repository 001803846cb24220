"""``ddp``: replicate the model on every rank and average gradients (torch's DistributedDataParallel).

Each rank holds the whole model and optimizer; after backward, gradients are
averaged across the data-parallel group in buckets that overlap with the rest of
backward (Li et al., "PyTorch Distributed", VLDB 2020). Gradient accumulation
skips that allreduce on all but the last micro-batch (``no_sync``).

DDP's traffic shows up in ``summary.json`` like any other collective. By default
the buckets go through DDP's own C++ allreduce (no Python on the backward path)
and each synchronized step is recorded as one ``all_reduce`` event carrying every
gradient byte; ``record_buckets=True`` instead routes each bucket through a Python
hook that records it with its time (about 5% slower on a small model, measured by
benchmarks/overhead.py's setting). Options ``allreduce="ring"`` (or any algorithm of
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


def record_synced_steps(ddp: DistributedDataParallel, group: Group, recorder: Recorder) -> None:
    """Record one allreduce of all gradient bytes for each forward whose backward will sync.

    DDP reduces every gradient bucket after a forward run with gradients enabled
    outside ``no_sync`` (``require_backward_grad_sync``), so the bytes are known at
    forward time, without a Python hook on the backward path. Seconds are not
    observed on this path (the reduction overlaps backward inside DDP's reducer).
    """
    p = group.size
    n = sum(t.numel() * t.element_size() for t in ddp.parameters() if t.requires_grad)
    sent, recv = wire_bytes("all_reduce", n, p)
    event = CommEvent("all_reduce", group.name, p, n, sent, recv, None)  # C++ buckets: time not seen (record_buckets=True times them)

    def before_forward(module: nn.Module, args: Any) -> None:
        if ddp.require_backward_grad_sync and torch.is_grad_enabled():
            recorder.add(event)

    ddp.register_forward_pre_hook(before_forward)


def apply_ddp(
    model: nn.Module, mesh: Mesh, recorder: Recorder, *, allreduce: str = "native", compression: str | None = None,
    record_buckets: bool = False, **ddp_kwargs: Any,
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
        if record_buckets:
            ddp.register_comm_hook(_HookState(group, recorder), recorded_allreduce_hook)
        else:
            record_synced_steps(ddp, group, recorder)
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
        record_buckets: bool = False,
    ) -> None:
        if bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be > 0; got {bucket_cap_mb}")
        parse_options(allreduce, compression)  # a bad name fails here, before any process starts
        self.allreduce, self.compression, self.record_buckets = allreduce, compression, record_buckets
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
        wrapped = apply_ddp(model.to(mesh.device), mesh, recorder, allreduce=self.allreduce, compression=self.compression, record_buckets=self.record_buckets, **self.kwargs)
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
