"""``local-sgd``: every replica steps alone; parameters are averaged every ``sync_every`` steps.

Local SGD (Stich 2019, "Local SGD Converges Fast and Communicates Little"; Lin et al. 2020,
"Don't Use Large Mini-Batches, Use Local SGD") trades gradient synchronization on every
step for one parameter average every H steps: each rank runs its own optimizer on its own
slice of the global batch, and after steps H, 2H, ... all replicas are replaced by their
mean. Communication falls by a factor H; with H = 1 and a linear optimizer (SGD, with or
without momentum and weight decay) it is exactly data parallelism, because the mean of
``p - lr * u_i`` is ``p - lr * mean(u_i)``. Optimizer state stays local to each replica, as
in the papers.

The averaging round is the strategy's ``after_step`` hook (see
`shardwise.strategies.protocol.after_step`), called by the engine after every optimizer
step. Replicas differ between rounds, and so do their optimizer states, so a checkpoint
keeps each rank's own: ``save_extra_state`` writes ``replica-RRRRR.pt`` (model, optimizer,
the mixer's state, counters) next to the engine's files, and ``load_extra_state`` restores
it; a resume in new processes then equals an uninterrupted run bit for bit, mid-round too. This module also holds the pieces the other "replicas that step alone" strategies
share (`shardwise.strategies.diloco`, `shardwise.strategies.gossip`): the `Replicas` strategy
object, which the three build by composition with their own `Mixer` (an average, an outer
step, a ring gossip), flattening of parameters and floating-point buffers, and the option check.

>>> from shardwise import Trainer
>>> Trainer(strategy="local-sgd", strategy_options={"sync_every": 8}, nproc=2)  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint import load_file, write_file
from shardwise.comm.collectives import Group, all_reduce
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.mesh import Mesh
from shardwise.strategies.common import LocalModel
from shardwise.strategies.protocol import OptimizerFactory


# -- shared by local-sgd, diloco and gossip -------------------------------------------------------
def check_sync_every(strategy: str, sync_every: Any) -> int:
    """``sync_every`` as an int >= 1, or a ConfigError that says what was received and what to pass."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ConfigError(
            f"strategy {strategy!r}: sync_every must be a whole number of steps >= 1 (average the replicas "
            f"every that many steps); got {sync_every!r}. Use sync_every=1 to average after every step"
        )
    return sync_every


def check_group(strategy: str, world_size: int) -> None:
    if world_size < 1:
        raise ConfigError(f"strategy {strategy!r} needs at least one process; got a world size of {world_size}")


def setup_replica(strategy: str, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh) -> tuple[nn.Module, torch.optim.Optimizer, Group]:
    """The model on this rank's device, its own optimizer, and the data-parallel group it averages over.

    Every rank builds the same initial model (the launcher hands each the same object,
    the CLI seeds it), so replicas start identical; no broadcast is needed.
    """
    if not dist.is_initialized():
        raise ConfigError(f"strategy {strategy!r} needs a process group; start the run with nproc >= 1 through shardwise (Trainer, launch, or shardwise run)")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{strategy} got a model with no trainable parameters ({type(model).__name__}); nothing to train")
    model = model.to(mesh.device)
    return model, make_optimizer(model.parameters()), mesh.group("dp")


def replica_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What a replica average covers: every parameter and every floating-point buffer (BatchNorm statistics)."""
    return [p.data for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]


def by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.dtype, []).append(t)
    return out


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset: offset + n].view_as(t))
        offset += n


def average_replicas(model: nn.Module, group: Group, recorder: Recorder | None) -> None:
    """Replace every replica's parameters and floating buffers by their mean over ``group``: one allreduce per dtype."""
    with torch.no_grad():
        for tensors in by_dtype(replica_tensors(model)).values():
            flat = flatten(tensors)
            all_reduce(flat, "mean", group=group, recorder=recorder)
            unflatten_into(flat, tensors)


class Mixer(Protocol):
    """How replicas are brought together every ``sync_every`` steps: an average, an outer step, a gossip."""

    def attach(self, model: nn.Module, group: Group, recorder: Recorder | None) -> None:
        """Called once after setup, with the model this rank steps."""

    def round(self, model: nn.Module) -> None:
        """One synchronization round (every rank of the group calls it at the same step)."""

    def summary(self) -> dict[str, Any]:
        """What this mixer adds to the strategy's summary section."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the mixer (DiLoCo's outer parameters and momentum; nothing for the others)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict``."""


REPLICA_FILE = "replica-{rank:05d}.pt"
"""Each rank's own replica in a checkpoint directory: model, optimizer, mixer state, counters."""


class Replicas(LocalModel):
    """The strategy object of local-sgd, diloco and gossip: a plain module and optimizer per rank,
    no gradient synchronization, and a `Mixer` round every ``sync_every`` steps (``after_step``).

    Composition instead of a class per strategy: the three differ only in their mixer.
    """

    def __init__(self, name: str, section: str, sync_every: int, mixer: Mixer) -> None:
        self.name = name
        self.section = section
        self.sync_every = check_sync_every(name, sync_every)
        self.mixer = mixer
        self.rounds = 0
        self.steps = 0
        self._attach: tuple[Group, Recorder | None] | None = None

    def validate(self, world_size: int) -> None:
        check_group(self.name, world_size)

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, optimizer, group = setup_replica(self.name, model, make_optimizer, mesh)
        self.mixer.attach(model, group, recorder)
        self._attach = (group, recorder)
        return model, optimizer

    def after_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.steps = step
        if step % self.sync_every == 0:
            self.mixer.round(model)
            self.rounds += 1

    def save_extra_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: Path) -> None:
        """This rank's replica, into the checkpoint's temporary directory (every rank)."""
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "mixer": self.mixer.state_dict(), "steps": self.steps, "rounds": self.rounds}
        write_file(Path(directory) / REPLICA_FILE.format(rank=dist.get_rank()), state)

    def load_extra_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: Path) -> None:
        """This rank's own replica; without one (another world size, another strategy's checkpoint)
        every replica starts from the checkpoint's model, and the mixer starts afresh from it."""
        path = Path(directory) / REPLICA_FILE.format(rank=dist.get_rank())
        if not path.is_file():
            if dist.get_rank() == 0:
                print(f"shardwise {self.name}: {directory} has no state for this rank's replica; every replica "
                      "starts from the checkpoint's model", flush=True)
            assert self._attach is not None, "load before setup"
            self.mixer.attach(model, *self._attach)
            return
        state = load_file(path)
        model.load_state_dict(state["model"])
        if optimizer is not None and state["optimizer"] is not None:
            optimizer.load_state_dict(state["optimizer"])
        self.mixer.load_state_dict(state["mixer"])
        self.steps, self.rounds = int(state["steps"]), int(state["rounds"])

    def summary(self) -> dict[str, Any]:
        return {self.section: {"sync_every": self.sync_every, "rounds": self.rounds, "steps": self.steps, **self.mixer.summary()}}


class StatelessMixer:
    """A round that keeps no state of its own: ``mix(model, group, recorder)`` on the replicas.

    Local SGD's round is `average_replicas` (every replica becomes the mean of all of
    them); gossip's is a neighbour exchange. DiLoCo keeps an outer optimizer, so it
    has its own mixer.
    """

    def __init__(self, mix: Callable[[nn.Module, Group, Recorder | None], None], summary: dict[str, Any] | None = None) -> None:
        self.mix = mix
        self._summary = dict(summary or {})
        self.group: Group | None = None
        self.recorder: Recorder | None = None

    def attach(self, model: nn.Module, group: Group, recorder: Recorder | None) -> None:
        self.group, self.recorder = group, recorder

    def round(self, model: nn.Module) -> None:
        assert self.group is not None, "round before setup"
        self.mix(model, self.group, self.recorder)

    def summary(self) -> dict[str, Any]:
        return dict(self._summary)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# -- local SGD --------------------------------------------------------------------------------------
def local_sgd(*, sync_every: int = 8) -> Replicas:
    """Local SGD: replicas step alone and are averaged every ``sync_every`` steps (Stich 2019; Lin et al. 2020)."""
    return Replicas("local-sgd", "local_sgd", sync_every, StatelessMixer(average_replicas))
