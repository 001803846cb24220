"""What local SGD, DiLoCo and gossip share: whole replicas that step alone and meet every H steps.

- The option check (`check_sync_every`) and the plan (`plan_replicas`): every refusal is made in
  the parent, before any process starts (a bad ``sync_every``, a mesh that splits the model, a
  model with nothing to train).
- Placement (`place_replica`): the model on this rank's device and its own optimizer; every rank
  builds the same initial model (the launcher hands each the same object, the CLI seeds it), so
  replicas start identical and no broadcast is needed.
- What a round covers (`replica_tensors`: every parameter and every floating-point buffer, so
  BatchNorm statistics are averaged too), flattened per dtype (`by_dtype`, `flatten`,
  `unflatten_into`) so that a round costs one message per dtype.
- `ReplicaRun`, the `Parallel` of the three: plain module and optimizer per rank (`LocalParallel`:
  nothing synchronizes in backward, each rank clips its own gradient), a round every
  ``sync_every`` optimizer steps in ``after_step``, and each rank's own replica in checkpoints.
  A subclass says what its round does (`ReplicaRun.mix`) and, when the round keeps state between
  rounds (DiLoCo), what that state is.

The round is ``after_step`` and not an optimizer post-hook: a skipped fp16 step never calls the
optimizer, and every rank must still reach the same rounds. Replicas differ between rounds, and
so do their optimizer states, so a checkpoint keeps each rank's own: ``save_extra_state`` writes
``replica-RRRRR.pt`` (model, optimizer, the round's state, counters) next to the engine's files
and ``load_extra_state`` restores it; a resume in new processes then equals an uninterrupted run
bit for bit, mid-round too.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint import load_file, write_file
from shardwise.comm.collectives import Group
from shardwise.comm.mesh import DIM_ORDER, Mesh
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.strategies.common import LocalParallel
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Placement, Strategy, plan_layout

REPLICA_FILE = "replica-{rank:05d}.pt"
"""Each rank's own replica in a checkpoint directory: model, optimizer, the round's state, counters."""


# -- options and plan ---------------------------------------------------------------------------------
def check_sync_every(strategy: str, sync_every: Any) -> int:
    """``sync_every`` as an int >= 1, or a ConfigError that says what was received and what to pass."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ConfigError(
            f"strategy {strategy!r}: sync_every must be a whole number of steps >= 1 (average the replicas "
            f"every that many steps); got {sync_every!r}. Use sync_every=1 to average after every step"
        )
    return sync_every


def check_trainable(strategy: str, model: nn.Module) -> None:
    """A replica needs something to train."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{strategy} got a model with no trainable parameters ({type(model).__name__}); nothing to train")


def plan_replicas(strategy: str, world_size: int, model: nn.Module | None, batch: Batch | None, mesh: Mapping[str, int] | None) -> Layout:
    """The plan of a replica strategy: the whole world is one data-parallel dimension of whole models.

    Pure. Refuses a world size below one, a mesh that would split the model (``pp`` or ``tp``
    above 1: the replicas hold the whole model and average over ``dp`` only) and, when given, a
    model with no trainable parameter.
    """
    if isinstance(world_size, int) and not isinstance(world_size, bool) and world_size < 1:
        raise ConfigError(f"strategy {strategy!r} needs at least one process; got a world size of {world_size}")
    split = {dim: degree for dim, degree in (mesh or {}).items() if dim in DIM_ORDER and dim != "dp" and int(degree) != 1}
    if split:
        raise ConfigError(
            f"strategy {strategy!r} keeps the whole model on every rank and averages the replicas over the data-parallel "
            f"dimension; the mesh settings ask for {split}. Drop them (every rank is a replica), or choose 'pipeline' or 'tp' to split the model"
        )
    if model is not None:
        check_trainable(strategy, model)
    return plan_layout(strategy, world_size, batch=batch, mesh=mesh)


@dataclass(frozen=True)
class ReplicaStrategy(Strategy):
    """What local SGD, DiLoCo and gossip share as strategies: ``sync_every`` checked when built, and
    one plan (`plan_replicas`). A subclass re-declares ``sync_every`` with its own default and help."""

    sync_every: int = 8
    """Optimizer steps each replica takes alone between rounds (H)."""

    def __post_init__(self) -> None:
        check_sync_every(self.name, self.sync_every)

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        return plan_replicas(self.name, world_size, model, batch, mesh)


def place_replica(strategy: str, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh) -> tuple[nn.Module, torch.optim.Optimizer, Group]:
    """The model on this rank's device, its own optimizer, and the data-parallel group its rounds run over."""
    if not dist.is_initialized():
        raise ConfigError(f"strategy {strategy!r} needs a process group; start the run with nproc >= 1 through shardwise (Trainer, launch, or shardwise run)")
    check_trainable(strategy, model)
    model = model.to(mesh.device)
    return model, make_optimizer(model.parameters()), mesh.group("dp")


# -- what a round covers --------------------------------------------------------------------------------
def replica_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What a replica average covers: every parameter and every floating-point buffer (BatchNorm statistics)."""
    return [p.data for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]


def by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    """The tensors grouped by dtype, in first-seen order (one flat message per group)."""
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.dtype, []).append(t)
    return out


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new 1-D tensor holding ``tensors`` one after the other (they share a dtype)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Inverse of `flatten`: copy consecutive slices of ``flat`` back into ``tensors``."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


# -- the run ------------------------------------------------------------------------------------------------
class ReplicaRun(LocalParallel):
    """One rank's replica: it steps alone and meets the others every ``sync_every`` steps.

    ``after_step`` counts optimizer steps and runs `mix` after steps H, 2H, ... (every rank of
    the group at the same step). The subclass says what a round does and what it keeps between
    rounds (`mix_state`, `load_mix_state`, `restart_mix`: nothing unless overridden) and reports its
    options (`report`).
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *, strategy: str, section: str, sync_every: int, group: Group, recorder: Recorder
    ) -> None:
        super().__init__(model, optimizer, Placement(steps_together=False))  # replicas meet every H steps, not every step
        self.strategy_name, self.section = strategy, section
        self.sync_every = check_sync_every(strategy, sync_every)
        self.group, self.recorder = group, recorder
        self.rank = dist.get_rank()
        self.rounds = 0
        self.steps = 0

    # What a subclass says -------------------------------------------------------------------------
    @abstractmethod
    def mix(self) -> None:
        """One round over ``self.group`` (every rank of it calls this at the same step)."""

    def mix_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the round (DiLoCo's outer parameters and momentum); nothing by default
        (local SGD's average and gossip's neighbour mean keep nothing between rounds)."""
        return {}

    def load_mix_state(self, state: dict[str, Any]) -> None:
        """Inverse of `mix_state`."""
        return None  # nothing kept

    def restart_mix(self) -> None:
        """Start the round's state afresh from the current model (a checkpoint without this rank's replica)."""
        return None  # nothing kept

    @abstractmethod
    def report(self) -> dict[str, Any]:
        """What this strategy adds to its summary section (its options)."""

    # The contract -------------------------------------------------------------------------------------
    def after_step(self, step: int) -> None:
        self.steps = step
        if step % self.sync_every == 0:
            self.mix()
            self.rounds += 1

    def save_extra_state(self, directory: Path) -> None:
        """This rank's replica, into the checkpoint's temporary directory (every rank)."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "mixer": self.mix_state(),
            "steps": self.steps,
            "rounds": self.rounds,
        }
        write_file(Path(directory) / REPLICA_FILE.format(rank=self.rank), state)

    def load_extra_state(self, path: Path) -> None:
        """This rank's own replica; without one (another world size, another strategy's checkpoint)
        every replica starts from the checkpoint's model, and the round's state starts afresh from it."""
        file = Path(path) / REPLICA_FILE.format(rank=self.rank)
        if not file.is_file():
            if self.rank == 0:
                print(
                    f"shardwise {self.strategy_name}: {path} has no state for this rank's replica; every replica starts from the checkpoint's model", flush=True
                )
            self.restart_mix()
            return
        state = load_file(file)
        self.model.load_state_dict(state["model"])
        if state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.load_mix_state(state["mixer"])
        self.steps, self.rounds = int(state["steps"]), int(state["rounds"])

    def finish(self) -> None:
        return None  # every round ran in after_step; nothing is gathered at the end

    def summary(self) -> dict[str, Any]:
        return {self.section: {"sync_every": self.sync_every, "rounds": self.rounds, "steps": self.steps, **self.report()}}
