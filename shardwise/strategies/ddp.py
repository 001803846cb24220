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
from pathlib import Path
from typing import Any, ClassVar, ContextManager, Mapping, Sequence

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
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Parallel, Placement, StepFn, Strategy, plan_layout


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


class DDPRun(Parallel):
    """One rank's DDP replica: torch's DistributedDataParallel around the whole model."""

    def __init__(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer, strategy: DDP, world_size: int) -> None:
        self.model, self.optimizer = model, optimizer
        self.placement = Placement()
        self._strategy, self._world_size = strategy, world_size

    def module(self) -> nn.Module:
        return self.model.module  # type: ignore[no-any-return]

    def forward_backward(self, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        return accumulate_backward(self.model, microbatches, step_fn, precision, no_sync=self.no_sync)

    def no_sync(self) -> ContextManager[None]:
        return self.model.no_sync()  # type: ignore[no-any-return,operator]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # After the allreduce every rank holds the same full gradient: its local norm is global.
        return clip_local(self.model, max_norm)

    def state_dict(self, optimizer: bool) -> dict[str, Any]:
        return plain_state_dict(self.module(), self.optimizer if optimizer else None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_plain_state_dict(self.module(), self.optimizer, state)

    def after_step(self, step: int) -> None:
        return None  # gradients were averaged in backward

    def save_extra_state(self, directory: Path) -> None:
        return None  # replicas are identical: the model and optimizer hold everything

    def load_extra_state(self, path: Path) -> None:
        return None

    def finish(self) -> None:
        return None

    def summary(self) -> dict[str, Any]:
        s = self._strategy
        return {"ddp": {"bucket_cap_mb": s.bucket_cap_mb, "world_size": self._world_size, "allreduce": s.allreduce, "compression": s.compression}}


@dataclass(frozen=True)
class DDP(Strategy):
    """Distributed data parallel: whole model per rank, gradients averaged each step."""

    name: ClassVar[str] = "ddp"

    bucket_cap_mb: float = 25.0
    """Size of each gradient bucket DDP reduces while backward runs (MiB)."""
    find_unused_parameters: bool = False
    """Allow parameters that get no gradient in some steps (slower: DDP walks the graph each step)."""
    static_graph: bool = False
    """Declare that the set of used parameters never changes across steps (lets DDP skip checks)."""
    broadcast_buffers: bool = True
    """Copy rank 0's buffers (BatchNorm statistics) to every rank before each forward."""
    allreduce: str = "native"
    """Gradient allreduce algorithm: native, ring, tree, recursive-doubling, ... (shardwise.comm.algorithms)."""
    compression: str | None = None
    """Gradient codec with error feedback: fp16, bf16, int8, topk:RATIO, powersgd:RANK, ... (shardwise.comm.codecs)."""
    record_buckets: bool = False
    """Route each native bucket through a Python hook that records it with its time (a little slower)."""

    def __post_init__(self) -> None:
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be > 0; got {self.bucket_cap_mb}")
        parse_options(self.allreduce, self.compression)  # a bad name fails here, before any process starts

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        return plan_layout(self.name, world_size, batch=batch, mesh=mesh)

    def ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of torch's DistributedDataParallel these options stand for."""
        kwargs: dict[str, Any] = dict(
            bucket_cap_mb=self.bucket_cap_mb, find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph, gradient_as_bucket_view=True,
        )
        if not self.broadcast_buffers:  # passed only when changed: torch 2.13 deprecates the name
            kwargs["broadcast_buffers"] = False
        return kwargs

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> DDPRun:
        if not dist.is_initialized():
            raise ConfigError("strategy 'ddp' needs a process group; start the run with nproc >= 1 through shardwise (Trainer, launch, or shardwise run)")
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(f"ddp got a model with no trainable parameters ({type(model).__name__}); nothing to synchronize")
        wrapped = apply_ddp(model.to(mesh.device), mesh, recorder, allreduce=self.allreduce, compression=self.compression,
                            record_buckets=self.record_buckets, **self.ddp_kwargs())
        return DDPRun(wrapped, make_optimizer(wrapped.parameters()), self, mesh.size("dp"))
