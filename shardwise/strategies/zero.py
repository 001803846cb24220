"""``zero1``: ZeRO stage 1 (optimizer state sharded), and the model-state accounting every
sharded strategy shares.

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020) removes the redundancy of data parallelism in three stages: stage 1
partitions the optimizer state (P_os), stage 2 the gradients too (P_os+g), stage 3 the
parameters too (P_os+g+p). Stage 1 is torch's `ZeroRedundancyOptimizer` over DDP: each rank
keeps the whole model and the whole (allreduced) gradient, steps only the parameters it owns
with the optimizer state of those parameters, then broadcasts them to the others. Stages 2
and 3 live in `shardwise.strategies.fsdp` (FSDP2).

**What zero1 keeps where.** At rest and at peak: parameters replicated, gradients replicated
(DDP's buckets), optimizer state of about ``1/N`` of the parameters. ``ZeroRedundancyOptimizer``
assigns whole tensors to ranks (greedily, largest first), so the optimizer bytes per rank
are ``K Psi / N`` only when the tensors split evenly; the report shows the real ratio.

`ModelStateProbe` measures, once after the first optimizer step (before ``zero_grad``: the
moment parameters, gradients and optimizer state all exist), the bytes this rank holds in
each category by summing the local tensors (a DTensor's ``to_local()``), and compares them
with `shardwise.plan.memory.model_state_bytes`.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.mesh import Mesh
from shardwise.plan.memory import STAGE_OF, BytesPerParam, compare, model_state_bytes
from shardwise.precision import Precision
from shardwise.strategies.common import accumulate_backward, clip_local, load_plain_state_dict, plain_state_dict
from shardwise.strategies.protocol import OptimizerFactory, StepFn

# -- model-state accounting ---------------------------------------------------------------


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t`` (its local shard when ``t`` is a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[Any, dict[str, Any]]:
    # ZeroRedundancyOptimizer keeps the state of this rank's parameters in its local optimizer.
    inner = getattr(optimizer, "optim", None) if isinstance(optimizer, ZeroRedundancyOptimizer) else None
    return (inner or optimizer).state  # type: ignore[return-value]


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
    """Measures model-state bytes after the first optimizer step and reports them against ZeRO's formula."""

    def __init__(self, strategy: str, shard_degree: int) -> None:
        self.strategy, self.shard_degree = strategy, shard_degree
        self.measured: dict[str, int] | None = None
        self.per_param: BytesPerParam | None = None
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
            handle.remove()

        handle = optimizer.register_step_post_hook(after_step)

    def summary(self) -> dict[str, Any]:
        if self.measured is None or self.per_param is None:
            return {}
        stage = STAGE_OF[self.strategy]
        predicted = model_state_bytes(stage, self.psi, self.shard_degree, self.per_param)
        section: dict[str, Any] = {"strategy": self.strategy, "stage": stage, "shard_degree": self.shard_degree, "psi": self.psi,
                                   "bytes_per_param": vars(self.per_param)}
        section.update(compare(self.measured, predicted))
        return {"memory_per_rank": section}


# -- zero1 ----------------------------------------------------------------------------------


def zero_redundancy(params: Any, make_optimizer: OptimizerFactory, group: Any) -> ZeroRedundancyOptimizer:
    """The user's optimizer (class, defaults, parameter groups) rebuilt as a `ZeroRedundancyOptimizer`.

    The factory is called once on the parameters to learn what it builds; that template
    holds no state (optimizers allocate state on their first step).
    """
    template = make_optimizer(params)
    groups = [dict(g) for g in template.param_groups]
    # Only the defaults the class's constructor takes (AdamW's defaults carry Adam's
    # ``decoupled_weight_decay``, which AdamW sets itself and does not accept).
    accepted = inspect.signature(type(template).__init__).parameters
    defaults = {k: v for k, v in template.defaults.items() if k in accepted}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(template), process_group=group, **defaults)


def apply_zero1(model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[nn.Module, ZeroRedundancyOptimizer]:
    """DDP (gradients allreduced, recorded) with the optimizer state partitioned across the dp group."""
    from shardwise.strategies.ddp import apply_ddp  # the other data-parallel strategy, reused as it is

    wrapped = apply_ddp(model.to(mesh.device), mesh, recorder, gradient_as_bucket_view=True)
    return wrapped, zero_redundancy(list(wrapped.parameters()), make_optimizer, mesh.group("dp").pg)


class Zero1:
    """ZeRO stage 1: optimizer state sharded; parameters and gradients replicated."""

    name: ClassVar[str] = "zero1"

    def __init__(self, *, offload: bool = False) -> None:
        if offload:
            raise ConfigError(
                "strategy 'zero1' does not support offload=True: its parameters and gradients stay whole on the device "
                "(torch's ZeroRedundancyOptimizer). Use strategy 'zero2', 'zero3' or 'hsdp' with --offload "
                "(FSDP2's CPUOffloadPolicy), or drop --offload"
            )
        self.probe = ModelStateProbe("zero1", 1)

    def validate(self, world_size: int) -> None:
        if world_size < 1:
            raise ConfigError(f"zero1 needs at least one process; got a world size of {world_size}")

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[nn.Module, torch.optim.Optimizer]:
        if not dist.is_initialized():
            raise ConfigError("strategy 'zero1' needs a process group; start the run through shardwise (Trainer, launch, or shardwise run)")
        require_trainable(model, "zero1")
        wrapped, optimizer = apply_zero1(model, make_optimizer, mesh, recorder)
        self.probe = ModelStateProbe("zero1", mesh.size("dp"))
        self.probe.attach(wrapped.module, optimizer)
        return wrapped, optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def forward_backward(self, model: nn.Module, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        self.probe.arm()
        return accumulate_backward(model, microbatches, step_fn, precision, no_sync=lambda: self.no_sync(model))

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        return model.no_sync()  # type: ignore[operator,no-any-return]

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_local(model, max_norm)  # gradients are replicated after DDP's allreduce

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        # The optimizer state is gathered on rank 0 (collective), in the plain format ddp writes,
        # so a zero1 checkpoint resumes under any strategy and at any world size.
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.consolidate_state_dict(to=0)
            full = optimizer.state_dict() if dist.get_rank() == 0 else {}
            return {"model": self.unwrap(model).state_dict(), "optimizer": full}
        return plain_state_dict(self.unwrap(model), optimizer)

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
        load_plain_state_dict(self.unwrap(model), optimizer, state)

    def summary(self) -> dict[str, Any]:
        return self.probe.summary()


def require_trainable(model: nn.Module, strategy: str) -> None:
    """A sharding stage on a model with nothing to train is a user error, said before anything is built."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if n == 0:
        total = sum(p.numel() for p in model.parameters())
        raise ConfigError(
            f"strategy {strategy!r} shards parameters, gradients and optimizer state, but the model "
            f"{type(model).__name__} has no trainable parameters ({total} parameters, none with requires_grad). "
            "Give the model trainable parameters, or run it with strategy 'single' or 'ddp'"
        )
