"""``zero1``: ZeRO stage 1 (optimizer state sharded), and the model-state accounting every
sharded strategy shares.

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020) removes the redundancy of data parallelism in three stages: stage 1
partitions the optimizer state (P_os), stage 2 the gradients too (P_os+g), stage 3 the
parameters too (P_os+g+p). Stage 1 is torch's `ZeroRedundancyOptimizer` over DDP: each rank
keeps the whole model and the whole (allreduced) gradient, steps only the parameters it owns
with the optimizer state of those parameters, then broadcasts them to the others. Stages 2
and 3 live in `shardwise.strategies.sharded.fsdp` (FSDP2).

**What zero1 keeps where.** At rest and at peak: parameters replicated, gradients replicated
(DDP's buckets), optimizer state of about ``1/N`` of the parameters. ``ZeroRedundancyOptimizer``
assigns whole tensors to ranks (greedily, largest first), so the optimizer bytes per rank
are ``K Psi / N`` only when the tensors split evenly; the report shows the real ratio.

**What zero1 sends per step** (recorded on the run's `Recorder`, group ``dp``): DDP's
gradient allreduce, one event of every trainable parameter's bytes per synchronized step
(`shardwise.strategies.data_parallel.ddp.apply_ddp`), then, after the optimizer step, one broadcast per
parameter from the rank that owns it, through `shardwise.comm.broadcast`: a rank sends the
bytes of the parameters it owns and receives the rest (``Psi`` bytes in all over the group,
the all-gather of the updated partitions that the ZeRO paper describes). The consolidation of
the optimizer state on rank 0 for a checkpoint is torch's own object broadcast, not recorded.

`ModelStateProbe` measures, once after the first optimizer step (before ``zero_grad``: the
moment parameters, gradients and optimizer state all exist), the bytes this rank holds in
each category by summing the local tensors (a DTensor's ``to_local()``), and compares them
with `shardwise.strategies.cost.memory.model_state_bytes`.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise.comm.collectives import Group, broadcast_async
from shardwise.comm.mesh import Mesh
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.strategies import compose
from shardwise.strategies.common import accumulate_backward, clip_local, load_plain_state_dict
from shardwise.strategies.compose import replicate_with_ddp
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Parallel, Placement, StepFn, Strategy, plan_layout
from shardwise.strategies.cost.memory import STAGE_OF, BytesPerParam, compare, model_state_bytes
from shardwise.strategies.precision import Precision

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer  # imported where a zero1 run is built: 1.3 s the parent never needs

# -- model-state accounting ---------------------------------------------------------------


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t`` (its local shard when ``t`` is a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[Any, dict[str, Any]]:
    # ZeroRedundancyOptimizer keeps the state of this rank's parameters in its local optimizer.
    zero = sys.modules.get("torch.distributed.optim")  # not imported: no optimizer here can be a ZeroRedundancyOptimizer
    inner = getattr(optimizer, "optim", None) if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer) else None
    return (inner or optimizer).state


def optimizer_slots(optimizer: torch.optim.Optimizer) -> int:
    """Parameter-shaped tensors the optimizer keeps per parameter (Adam 2, SGD+momentum 1, SGD 0)."""
    for state in _optimizer_state(optimizer).values():
        return sum(1 for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return 0


def measure_model_states(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state, by summing local tensors.

    ``params`` are the tensors the module computes with now; a parameter the optimizer steps
    that is *not* one of them (FSDP2's shard under zero2, kept apart from the all-gathered
    compute parameters) is a master copy and counts as optimizer state, as in the ZeRO paper.
    Scalar state (Adam's ``step``) is not per-parameter state and is left out.
    """
    compute = {id(p): p for p in module.parameters()}
    params = sum(local_bytes(p) for p in compute.values())
    stepped = [p for g in optimizer.param_groups for p in g["params"]]
    grads = sum(local_bytes(p.grad) for p in {id(p): p for p in [*compute.values(), *stepped]}.values() if p.grad is not None)
    master = sum(local_bytes(p) for p in stepped if id(p) not in compute)
    state = sum(local_bytes(v) for s in _optimizer_state(optimizer).values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": master + state}


class ModelStateProbe:
    """Measures model-state bytes after the first optimizer step and reports them against ZeRO's formula.

    ``whole``: parameters every rank keeps whole, outside the sharding (expert parallelism's slices of
    the experts, left out of FSDP2): predicted at stage 0 (unsharded), the rest at the strategy's stage.
    """

    def __init__(self, strategy: str, shard_degree: int, whole: Collection[torch.Tensor] = ()) -> None:
        self.strategy, self.shard_degree = strategy, shard_degree
        self.whole = sum(p.numel() for p in {id(p): p for p in whole}.values())
        self.measured: dict[str, int] | None = None
        self.per_param: BytesPerParam | None = None
        self.per_whole: BytesPerParam | None = None
        self.psi = 0
        self._pending: tuple[nn.Module, torch.optim.Optimizer, bool] | None = None

    def attach(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, master_copy: bool = False) -> None:
        """Measure once, right after the first ``optimizer.step()`` of training (before ``zero_grad``).

        The hook is registered by `arm`, which the strategy calls from its first
        ``forward_backward``: loading a checkpoint before that may run a step with zero
        gradients to create optimizer state (torch's ``get_optimizer_state_dict`` does), and
        that one is not a training step.
        """
        self.psi = sum(p.numel() for p in module.parameters())  # global numel (a DTensor reports its full shape)
        self._pending = (module, optimizer, master_copy)

    def arm(self) -> None:
        """Start measuring: the next optimizer step is the one measured (a no-op after the first call)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        module, optimizer, master_copy = pending
        handle: Any = None

        def after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.measured = measure_model_states(module, opt)
            # Bytes per element as kept: the compute parameters' type (bf16 when zero2 keeps them
            # gathered under mixed precision), and the stepped parameters' type for their
            # gradients, state and master copy (fp32 under FSDP2's MixedPrecisionPolicy).
            compute = next(iter(module.parameters())).element_size()
            stepped = opt.param_groups[0]["params"][0].element_size()
            slots = optimizer_slots(opt)
            self.per_param = BytesPerParam(compute, stepped, stepped * (slots + int(master_copy)))
            self.per_whole = BytesPerParam(compute, stepped, stepped * slots)  # outside FSDP: no master copy
            handle.remove()

        handle = optimizer.register_step_post_hook(after_step)

    def summary(self) -> dict[str, Any]:
        if self.measured is None or self.per_param is None:
            return {}
        stage = STAGE_OF[self.strategy]
        predicted = model_state_bytes(stage, self.psi - self.whole, self.shard_degree, self.per_param)
        if self.whole:  # kept whole on every rank: stage 0 (ep's experts)
            kept = model_state_bytes(0, self.whole, 1, self.per_whole or self.per_param)
            predicted = {k: v + kept[k] for k, v in predicted.items()}
        section: dict[str, Any] = {
            "strategy": self.strategy,
            "stage": stage,
            "shard_degree": self.shard_degree,
            "psi": self.psi,
            "whole_params": self.whole,
            "bytes_per_param": vars(self.per_param),
        }
        section.update(compare(self.measured, predicted))
        return {"memory_per_rank": section}


# -- checks every sharding stage makes --------------------------------------------------------


def require_trainable(model: nn.Module, strategy: str) -> None:
    """A sharding stage on a model with nothing to train is a user error, said before anything is built."""
    total = sum(p.numel() for p in model.parameters())
    if total == 0:
        raise ConfigError(f"the model {type(model).__name__} has no parameters; there is nothing to train")
    if sum(p.numel() for p in model.parameters() if p.requires_grad) == 0:
        raise ConfigError(
            f"strategy {strategy!r} shards parameters, gradients and optimizer state, but the model "
            f"{type(model).__name__} has no trainable parameters ({total} parameters, none with requires_grad). "
            "Give the model trainable parameters, or run it with strategy 'single' or 'ddp'"
        )


def require_dp_only(strategy: str, degrees: Mapping[str, int]) -> None:
    """Sharded data parallel runs over a mesh of data-parallel ranks only (pp = tp = 1)."""
    if any(degrees.get(d, 1) != 1 for d in ("pp", "tp")):
        raise ConfigError(
            f"strategy {strategy!r} shards over data-parallel ranks only; got mesh degrees {dict(degrees)}. "
            "Drop the pp/tp mesh settings, or use strategy 'tp' or 'pipeline' with dp_strategy='fsdp' to shard their data-parallel dimension"
        )


def require_process_group(strategy: str) -> None:
    if not dist.is_initialized():
        raise ConfigError(f"strategy {strategy!r} needs a process group; start the run through shardwise (Trainer, launch, or shardwise run)")


# -- zero1 ----------------------------------------------------------------------------------


@functools.cache
def _recorded_zero_class() -> type:
    """`RecordedZeroRedundancyOptimizer`, defined on first use (its base class's module costs about
    1.3 s to import, which the parent, planning a run, should not pay)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class RecordedZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
        """torch's `ZeroRedundancyOptimizer`, with the parameter broadcast after each step sent
        through `shardwise.comm.broadcast`, so the run's `Recorder` sees every byte of it.

        torch broadcasts each parameter from the rank that owns it (``_sync_params``, per
        parameter when ``parameters_as_bucket_view`` is off, as here, all in flight at once, then
        waits for them); this does the same broadcasts in the same order, one recorded call each:
        the values every rank ends with are the owner's, exactly as before.
        """

        def __init__(self, params: Any, *, group: Group, recorder: Recorder | None, **kwargs: Any) -> None:
            self._shardwise_group, self._shardwise_recorder = group, recorder
            super().__init__(params, process_group=group.pg, **kwargs)

        def _sync_params(self) -> None:
            pending = [
                broadcast_async(param.data, src=rank, group=self._shardwise_group, recorder=self._shardwise_recorder)
                for rank, groups in enumerate(self._partition_parameters())  # type: ignore[attr-defined]  # torch's .pyi stub omits this private method
                for param_group in groups
                for param in param_group["params"]
            ]
            for work in pending:
                work.wait()

    return RecordedZeroRedundancyOptimizer


def zero_redundancy(params: Any, make_optimizer: OptimizerFactory, group: Group, recorder: Recorder | None = None) -> ZeroRedundancyOptimizer:
    """The user's optimizer (class, defaults, parameter groups) rebuilt as a `ZeroRedundancyOptimizer`
    over ``group``, its parameter broadcasts recorded on ``recorder``.

    The factory is called once on the parameters to learn what it builds; that template
    holds no state (optimizers allocate state on their first step).
    """
    template = make_optimizer(params)
    groups = [dict(g) for g in template.param_groups]
    # Only the defaults the class's constructor takes (AdamW's defaults carry Adam's
    # ``decoupled_weight_decay``, which AdamW sets itself and does not accept).
    accepted = inspect.signature(type(template).__init__).parameters
    defaults = {k: v for k, v in template.defaults.items() if k in accepted}
    zero: ZeroRedundancyOptimizer = _recorded_zero_class()(groups, group=group, recorder=recorder, optimizer_class=type(template), **defaults)
    return zero


def apply_zero1(model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[DistributedDataParallel, ZeroRedundancyOptimizer]:
    """DDP (gradients allreduced, recorded) with the optimizer state partitioned across the dp group
    (the parameter broadcasts after each step recorded too)."""
    wrapped = replicate_with_ddp(model.to(mesh.device), mesh, recorder, gradient_as_bucket_view=True)
    return wrapped, zero_redundancy(list(wrapped.parameters()), make_optimizer, mesh.group("dp"), recorder)


class Zero1Run(Parallel):
    """One rank of zero1: DDP around the whole model, the optimizer stepping this rank's partition."""

    model: DistributedDataParallel
    optimizer: ZeroRedundancyOptimizer

    def __init__(self, model: DistributedDataParallel, optimizer: ZeroRedundancyOptimizer, probe: ModelStateProbe) -> None:
        self.model, self.optimizer = model, optimizer
        self.placement = Placement()
        self.probe = probe

    def module(self) -> nn.Module:
        return self.model.module

    def forward_backward(self, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        self.probe.arm()
        return accumulate_backward(self.model, microbatches, step_fn, precision, no_sync=self.no_sync)

    def no_sync(self) -> AbstractContextManager[None]:
        return self.model.no_sync()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_local(self.model, max_norm)  # gradients are replicated after DDP's allreduce

    def state_dict(self, optimizer: bool) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.module().state_dict()}
        if optimizer:
            # Gathered on rank 0 (collective), in the plain format ddp writes, so a zero1
            # checkpoint resumes under any strategy and at any world size.
            self.optimizer.consolidate_state_dict(to=0)
            state["optimizer"] = self.optimizer.state_dict() if dist.get_rank() == 0 else {}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_plain_state_dict(self.module(), self.optimizer, state)  # each rank keeps its partition of the full state

    def after_step(self, step: int) -> None:
        return None  # the updated partitions were broadcast inside optimizer.step()

    def save_extra_state(self, directory: Path) -> None:
        return None  # the model and the consolidated optimizer hold everything

    def load_extra_state(self, path: Path) -> None:
        return None

    def finish(self) -> None:
        return None  # the probe measured at the first step; nothing to gather

    def summary(self) -> dict[str, Any]:
        return self.probe.summary()


@dataclass(frozen=True, kw_only=True)
class Zero1(Strategy):
    """ZeRO stage 1: optimizer state sharded; parameters and gradients replicated."""

    name: ClassVar[str] = "zero1"
    smaller_last_batch: ClassVar[bool] = True

    offload: bool = False
    """Refused: zero1 keeps parameters and gradients whole on the device (zero2, zero3 and hsdp offload to CPU)."""
    ep: int = 1
    """Refused above 1: zero1's optimizer owns each parameter on one rank and broadcasts it to all (ddp, zero2, zero3 and hsdp take ep)."""
    cp: int = 1
    """Context parallelism: split each sequence over this many ranks (attention by ring or Ulysses); they share samples."""
    cp_style: Literal["ring", "ulysses"] = "ring"
    """How context-parallel attention sees the whole sequence: ring (key/value blocks passed round) or ulysses (all-to-all over heads)."""

    def __post_init__(self) -> None:
        compose.check_context_parallel_options(self.name, self.cp, self.cp_style)
        if self.offload:
            raise ConfigError(
                "strategy 'zero1' does not support offload=True: its parameters and gradients stay whole on the device "
                "(torch's ZeroRedundancyOptimizer). Use strategy 'zero2', 'zero3' or 'hsdp' with --offload "
                "(FSDP2's CPUOffloadPolicy), or drop --offload"
            )
        if self.ep != 1:
            raise ConfigError(
                f"strategy 'zero1' does not support ep={self.ep!r}: its optimizer steps each parameter on one rank and broadcasts "
                "the result to every rank, which would overwrite each rank's own experts. Use strategy 'ddp', 'zero2', 'zero3' "
                "or 'hsdp' with ep, or drop ep"
            )

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        layout = compose.context_parallel_layout(lambda w: plan_layout(self.name, w, batch=batch, mesh=mesh), world_size, self.cp, self.name)
        require_dp_only(self.name, layout.degrees)
        if model is not None:
            require_trainable(model, self.name)
        return layout

    def check_sample(self, model: nn.Module, batch: Any, layout: Layout) -> None:
        compose.check_context_parallel(model, batch, self.cp, self.cp_style, self.name)

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> Zero1Run:
        require_process_group(self.name)
        require_trainable(model, self.name)
        mesh = compose.apply_context_parallel(model, mesh, recorder, self.cp_style)  # cp first; then dp over dp x cp
        require_dp_only(self.name, mesh.degrees)
        wrapped, optimizer = apply_zero1(model, make_optimizer, mesh, recorder)
        probe = ModelStateProbe(self.name, mesh.size("dp"))
        probe.attach(wrapped.module, optimizer)
        return Zero1Run(wrapped, optimizer, probe)
