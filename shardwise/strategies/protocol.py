"""The contract every strategy meets, and the types it speaks in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from shardwise.comm.collectives import Group
from shardwise.comm.recorder import Recorder
from shardwise.mesh import Mesh
from shardwise.precision import Precision

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
"""Builds the optimizer from parameters (``lambda params: torch.optim.Adam(params, lr=1e-3)``).
Strategies that shard call it after wrapping, on the parameters they keep."""

StepFn = Callable[[nn.Module, Any], torch.Tensor]
"""Runs forward on one micro-batch through the wrapped model and returns the loss."""


@runtime_checkable
class Strategy(Protocol):
    """How a model is placed, wrapped and synchronized across processes.

    A strategy is a small object built from its options (``DDP(bucket_cap_mb=25)``);
    ``setup`` applies it. The trainer and engine call only these methods, so a new
    strategy plugs in by registering a name, without touching them.
    """

    name: ClassVar[str]

    def validate(self, world_size: int) -> None:
        """Raise `ConfigError` for a world size (or options) this strategy cannot run; called before launch."""

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Place and wrap the model, then build the optimizer on the parameters this rank keeps."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper ``setup`` returned."""

    def forward_backward(self, model: nn.Module, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        """Forward and backward over one step's micro-batches; returns the mean loss (detached)."""

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        """Skip gradient synchronization inside the block (accumulation)."""

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip gradients by their global norm (across every shard) and return that norm."""

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Model (and optimizer, when given) state under the original module's parameter names."""

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict``."""

    def summary(self) -> dict[str, Any]:
        """This strategy's own section of summary.json."""


# -- optional hooks ----------------------------------------------------------------------------
# Strategies that step replicas alone (local SGD, DiLoCo, gossip) act after the optimizer
# step, and a parameter server keeps some ranks out of the loop. These hooks are optional:
# strategies that do not define them (ddp, zero, fsdp, user strategies) need nothing, which is
# why they sit outside the Protocol above and are called through the functions below.


@dataclass(frozen=True)
class Placement:
    """Where the training loop runs once ``setup`` returned (a strategy's optional ``placement()``).

    The default (every rank trains, on the engine's mesh, collectives over the world) is right
    for every strategy whose ranks all run the loop. A strategy that reserves ranks for
    service (a parameter server) returns ``trains=False`` on those ranks, whose ``setup``
    returns only after serving, and, on the training ranks, the mesh and group they form.
    """

    trains: bool = True
    """False on a rank that does not run the training loop (it served inside ``setup``)."""
    mesh: Mesh | None = None
    """The training ranks' mesh, for data sharding and evaluation (None: the engine's mesh)."""
    group: Group | None = None
    """The group the loop's own collectives (logged loss, evaluation, checkpoints) run over (None: the world)."""


def after_step(strategy: Any, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Call ``strategy.after_step(model, optimizer, step)`` if it has one.

    ``step`` counts optimizer steps taken in this process (1 after the first). Local SGD
    averages replicas every H steps here (Lin et al. 2020); the step must be a strategy
    method, not an optimizer post-hook, because a skipped fp16 step never calls the
    optimizer, and every rank must still reach the same averaging rounds.
    """
    hook = getattr(strategy, "after_step", None)
    if hook is not None:
        hook(model, optimizer, step)


def trainers(strategy: Any, world_size: int) -> int:
    """``strategy.trainers(world_size)`` if it has one: how many ranks run the loop and take data (default all)."""
    hook = getattr(strategy, "trainers", None)
    return int(hook(world_size)) if hook is not None else world_size


def placement(strategy: Any) -> Placement:
    """``strategy.placement()`` if it has one, else the default: this rank trains, on the whole world."""
    hook = getattr(strategy, "placement", None)
    return hook() if hook is not None else Placement()


def mesh_degrees(strategy: Any, requested: dict[str, int] | None = None) -> dict[str, int]:
    """The mesh degrees a strategy asks for (its optional ``mesh_degrees()``: pipeline ``pp``,
    tensor ``tp``) merged with the ones a user set directly (``mesh={...}``); a conflict is a
    `ConfigError`. ``dp`` is left out unless given: it is whatever the world size leaves."""
    from shardwise.errors import ConfigError

    hook = getattr(strategy, "mesh_degrees", None)
    own = {k: int(v) for k, v in (hook() if hook is not None else {}).items()}
    merged = dict(requested or {})
    for key, value in own.items():
        if key in merged and merged[key] != value:
            raise ConfigError(f"strategy {getattr(strategy, 'name', strategy)!r} asks for {key}={value} but the mesh settings say {key}={merged[key]}")
        merged[key] = value
    return merged


def check_batch(strategy: Any, micro_batch: int, accumulate: int) -> None:
    """``strategy.check_batch(micro_batch, accumulate)`` if it has one: refuse, before anything
    runs, a batch the strategy cannot split (a pipeline's micro-batches). Each step hands
    ``forward_backward`` ``accumulate`` loader micro-batches of ``micro_batch`` samples per rank."""
    hook = getattr(strategy, "check_batch", None)
    if hook is not None:
        hook(micro_batch, accumulate)


def check_model(strategy: Any, model: nn.Module) -> None:
    """``strategy.check_model(model)`` if it has one: refuse, before any process starts, a model
    the strategy cannot apply to (a tensor-parallel plan that does not fit it, a pipeline split
    with fewer layers than stages), so the error is one line in the parent, not one per rank."""
    hook = getattr(strategy, "check_model", None)
    if hook is not None:
        hook(model)


# -- hooks for strategies with ranks that loop alone or keep state outside the model ----------


def data_mesh(strategy: Any) -> Mesh | None:
    """``strategy.data_mesh()`` if it has one: the mesh each global batch is split over, when it
    differs from the loop's (asynchronous parameter-server workers loop alone on a mesh of one,
    yet each takes its own slice of every global batch). None: the loop's mesh."""
    hook = getattr(strategy, "data_mesh", None)
    return hook() if hook is not None else None


def expendable_ranks(strategy: Any, world_size: int) -> list[int]:
    """``strategy.expendable_ranks(world_size)`` if it has one: ranks whose death the run survives
    (asynchronous workers other than rank 0); `shardwise.launch` keeps going without them."""
    hook = getattr(strategy, "expendable_ranks", None)
    return sorted(int(r) for r in hook(world_size)) if hook is not None else []


def save_extra_state(strategy: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: Any) -> None:
    """``strategy.save_extra_state(model, optimizer, directory)`` if it has one: write the state the
    model and optimizer do not hold (parameter servers' shards, each replica's own copy, DiLoCo's
    outer momentum) into the checkpoint's temporary directory, before its manifest is written."""
    hook = getattr(strategy, "save_extra_state", None)
    if hook is not None:
        hook(model, optimizer, directory)


def has_extra_state(strategy: Any) -> bool:
    return getattr(strategy, "save_extra_state", None) is not None


def load_extra_state(strategy: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None, path: Any) -> None:
    """``strategy.load_extra_state(model, optimizer, path)`` if it has one: the inverse of
    `save_extra_state`, after the model and optimizer are loaded."""
    hook = getattr(strategy, "load_extra_state", None)
    if hook is not None:
        hook(model, optimizer, path)
