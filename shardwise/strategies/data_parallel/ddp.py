"""``ddp``: replicate the model on every rank and average gradients (torch's DistributedDataParallel).

Each rank holds the whole model and optimizer; after backward, gradients are
averaged across the data-parallel group in buckets that overlap with the rest of
backward (Li et al., "PyTorch Distributed", VLDB 2020). Gradient accumulation
skips that allreduce on all but the last micro-batch (``no_sync``).

DDP's traffic shows up in ``summary.json`` like any other collective, measured
rather than derived: each gradient bucket DDP's reducer hands over goes through a
small communication hook that records the bucket's bytes and starts the backend's
own asynchronous allreduce on it (`shardwise.comm.all_reduce_async`), so what is
counted is what is reduced (a parameter left out of the buckets adds nothing) and
the reduction still overlaps the rest of backward. ``record_buckets=True`` also
times each bucket, from launch to completion. Options ``allreduce="ring"`` (or any
algorithm of `shardwise.comm.algorithms`, or ``hierarchical`` over nodes of ``node_size``) and
``compression="int8"`` (or any codec of `shardwise.comm.codecs`) swap in our own hooks from
`shardwise.comm.hooks`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise.comm.collectives import Group, all_reduce_async
from shardwise.comm.hooks import make_comm_hook, parse_options
from shardwise.comm.mesh import Mesh
from shardwise.comm.recorder import Recorder
from shardwise.comm.traffic import HIERARCHICAL
from shardwise.errors import ConfigError
from shardwise.launcher.env import detect_env
from shardwise.strategies import compose
from shardwise.strategies.common import accumulate_backward, clip_local, load_plain_state_dict, plain_state_dict
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Parallel, Placement, StepFn, Strategy, plan_layout
from shardwise.strategies.precision import Precision


@dataclass
class _HookState:
    group: Group
    recorder: Recorder
    timed: bool = False


def recorded_allreduce_hook(state, bucket):
    """DDP's default reduction of one bucket (divide by p, then sum across the group), recorded.

    (state: _HookState, bucket: dist.GradBucket) -> Future[Tensor]. The bucket is the
    flat buffer DDP's reducer hands over, so the recorder counts what is actually
    reduced: a parameter DDP leaves out of its buckets (frozen, or ignored through
    ``_ddp_params_and_buffers_to_ignore``) adds no bytes, and each bucket is one event.
    The reduction is the backend's own asynchronous allreduce (`all_reduce_async`), so
    it still overlaps the rest of backward. Unannotated on purpose: DDP rejects a hook
    whose annotations are strings, which they are under ``from __future__ import annotations``.
    """
    buf = bucket.buffer()
    buf.div_(state.group.size)
    return all_reduce_async(buf, "sum", group=state.group, recorder=state.recorder, timed=state.timed)


def apply_ddp(
    model: nn.Module,
    mesh: Mesh,
    recorder: Recorder,
    *,
    allreduce: str = "native",
    compression: str | None = None,
    record_buckets: bool = False,
    node_size: int = 0,
    **ddp_kwargs: Any,
) -> DistributedDataParallel:
    """Wrap ``model`` (already on its device) in DDP over the mesh's data-parallel group.

    ``allreduce`` names the algorithm that averages each gradient bucket and
    ``compression`` a codec (see `shardwise.comm.hooks`); with neither, buckets go
    through the backend's own allreduce. ``allreduce='hierarchical'`` groups the ranks into
    nodes of ``node_size`` (0: the launcher's ``LOCAL_WORLD_SIZE``).
    """
    group = mesh.group("dp")
    device_ids = [mesh.device.index] if mesh.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=group.pg, **ddp_kwargs)
    if allreduce == "native" and compression in (None, "", "none"):
        ddp.register_comm_hook(_HookState(group, recorder, timed=record_buckets), recorded_allreduce_hook)
    else:
        local = node_size or detect_env().local_world_size
        ddp.register_comm_hook(*make_comm_hook(group, recorder, allreduce=allreduce, compression=compression, node_size=local))
    return ddp


class DDPRun(Parallel):
    """One rank's DDP replica: torch's DistributedDataParallel around the whole model."""

    model: DistributedDataParallel

    def __init__(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer, strategy: DDP, world_size: int, ep: Any = None) -> None:
        self.model, self.optimizer = model, optimizer
        self.placement = Placement()
        self._strategy, self._world_size = strategy, world_size
        self._ep = ep  # expert parallelism (compose.expert_parallel), None without

    def module(self) -> nn.Module:
        return self.model.module

    def forward_backward(self, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        loss = accumulate_backward(self.model, microbatches, step_fn, precision, no_sync=self.no_sync)
        if self._ep is not None:
            self._ep.reduce_grads()
        return loss

    def no_sync(self) -> AbstractContextManager[None]:
        return self.model.no_sync()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if self._ep is not None:
            return self._ep.clip_grad_norm(self.module(), max_norm)
        # After the allreduce every rank holds the same full gradient: its local norm is global.
        return clip_local(self.model, max_norm)

    def state_dict(self, optimizer: bool) -> dict[str, Any]:
        state = plain_state_dict(self.module(), self.optimizer if optimizer else None)
        return state if self._ep is None else self._ep.whole_state(state, self.optimizer if optimizer else None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_plain_state_dict(self.module(), self.optimizer, state if self._ep is None else self._ep.local_state(state, self.optimizer))

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
        out = {"ddp": {"bucket_cap_mb": s.bucket_cap_mb, "world_size": self._world_size, "allreduce": s.allreduce, "compression": s.compression}}
        if self._ep is not None:
            out["expert_parallel"] = self._ep.summary()
        return out


@dataclass(frozen=True)
class DDP(Strategy):
    """Distributed data parallel: whole model per rank, gradients averaged each step."""

    name: ClassVar[str] = "ddp"
    smaller_last_batch: ClassVar[bool] = True

    bucket_cap_mb: float = 25.0
    """Size of each gradient bucket DDP reduces while backward runs (MiB)."""
    find_unused_parameters: bool = False
    """Allow parameters that get no gradient in some steps (slower: DDP walks the graph each step)."""
    static_graph: bool = False
    """Declare that the set of used parameters never changes across steps (lets DDP skip checks)."""
    broadcast_buffers: bool = True
    """Copy rank 0's buffers (BatchNorm statistics) to every rank before each forward."""
    allreduce: str = "native"
    """Gradient allreduce algorithm: native, ring, tree, recursive-doubling, ... (shardwise.comm.algorithms),
    or hierarchical (reduce inside each node, all-reduce among node leaders, broadcast back)."""
    node_size: int = 0
    """Processes per node for allreduce=hierarchical (0: the launcher's LOCAL_WORLD_SIZE); a divisor of the world size."""
    compression: str | None = None
    """Gradient codec with error feedback: fp16, bf16, int8, topk:RATIO, powersgd:RANK, ... (shardwise.comm.codecs)."""
    record_buckets: bool = False
    """Also time each native gradient bucket (launch to completion) in the comm record; bytes are recorded either way."""
    ep: int = 1
    """Expert parallelism: split each mixture-of-experts layer's experts over groups of ep data-parallel ranks
    (tokens exchanged by all-to-all); a divisor of the world size and of the number of experts."""
    cp: int = 1
    """Context parallelism: split each sequence over this many ranks (attention by ring or Ulysses); they share samples."""
    cp_style: Literal["ring", "ulysses"] = "ring"
    """How context-parallel attention sees the whole sequence: ring (key/value blocks passed round) or ulysses (all-to-all over heads)."""

    def __post_init__(self) -> None:
        compose.check_context_parallel_options(self.name, self.cp, self.cp_style)
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be > 0; got {self.bucket_cap_mb}")
        parse_options(self.allreduce, self.compression)  # a bad name fails here, before any process starts
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ConfigError(f"ep must be a whole number >= 1 (ranks that split the experts); got {self.ep!r}")
        if self.node_size < 0 or (self.node_size and self.allreduce != HIERARCHICAL):
            raise ConfigError(
                f"node_size applies to allreduce='hierarchical' (processes per node, >= 1); got node_size={self.node_size} with allreduce={self.allreduce!r}"
            )

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        if self.node_size and world_size % self.node_size:
            raise ConfigError(
                f"allreduce='hierarchical' needs whole nodes: node_size {self.node_size} does not divide the world size {world_size}; "
                f"choose a node size that divides it, or a world size that is a multiple of {self.node_size}"
            )
        if self.ep > 1:
            if self.cp > 1:
                raise ConfigError(f"ep={self.ep} with cp={self.cp}: expert and context parallelism do not compose yet; use one of them")
            compose.check_expert_parallel(model, self.ep, world_size)
        return compose.context_parallel_layout(lambda w: plan_layout(self.name, w, batch=batch, mesh=mesh), world_size, self.cp, self.name)

    def check_sample(self, model: nn.Module, batch: Any, layout: Layout) -> None:
        compose.check_context_parallel(model, batch, self.cp, self.cp_style, self.name)

    def ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of torch's DistributedDataParallel these options stand for."""
        kwargs: dict[str, Any] = dict(
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            gradient_as_bucket_view=True,
        )
        if not self.broadcast_buffers:  # passed only when changed: torch 2.13 deprecates the name
            kwargs["broadcast_buffers"] = False
        return kwargs

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> DDPRun:
        if not dist.is_initialized():
            raise ConfigError("strategy 'ddp' needs a process group; start the run with nproc >= 1 through shardwise (Trainer, launch, or shardwise run)")
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(f"ddp got a model with no trainable parameters ({type(model).__name__}); nothing to synchronize")
        model = model.to(mesh.device)
        mesh = compose.apply_context_parallel(model, mesh, recorder, self.cp_style)  # cp first; ddp then averages over dp x cp
        ep = compose.expert_parallel(model, self.ep, mesh, recorder) if self.ep > 1 else None
        if ep is not None:
            ep.ignore(model)
        wrapped = apply_ddp(
            model,
            mesh,
            recorder,
            allreduce=self.allreduce,
            compression=self.compression,
            record_buckets=self.record_buckets,
            node_size=self.node_size,
            **self.ddp_kwargs(),
        )
        return DDPRun(wrapped, make_optimizer(wrapped.parameters()), self, mesh.size("dp"), ep)
