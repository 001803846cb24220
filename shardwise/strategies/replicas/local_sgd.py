"""``local-sgd``: every replica steps alone; parameters are averaged every ``sync_every`` steps.

Local SGD (Stich 2019, "Local SGD Converges Fast and Communicates Little"; Lin et al. 2020,
"Don't Use Large Mini-Batches, Use Local SGD") trades gradient synchronization on every
step for one parameter average every H steps: each rank runs its own optimizer on its own
slice of the global batch, and after steps H, 2H, ... all replicas are replaced by their
mean. Communication falls by a factor H; with H = 1 and a linear optimizer (SGD, with or
without momentum and weight decay) it is exactly data parallelism, because the mean of
``p - lr * u_i`` is ``p - lr * mean(u_i)``. Optimizer state stays local to each replica, as
in the papers.

A round is one allreduce per dtype of every parameter and floating-point buffer
(`average_replicas`), recorded as ``dp/all_reduce``; nothing is sent between rounds.
Checkpoints keep each rank's replica (`shardwise.strategies.replicas.base`).

>>> from shardwise import Trainer
>>> Trainer(strategy="local-sgd", strategy_options={"sync_every": 8}, nproc=2)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.comm.collectives import Group, all_reduce
from shardwise.comm.mesh import Mesh
from shardwise.comm.recorder import Recorder
from shardwise.strategies.contract import OptimizerFactory
from shardwise.strategies.replicas.base import (
    ReplicaRun,
    ReplicaStrategy,
    by_dtype,
    flatten,
    place_replica,
    replica_tensors,
    unflatten_into,
)


def average_replicas(model: nn.Module, group: Group, recorder: Recorder | None) -> None:
    """Replace every replica's parameters and floating buffers by their mean over ``group``: one allreduce per dtype."""
    with torch.no_grad():
        for tensors in by_dtype(replica_tensors(model)).values():
            flat = flatten(tensors)
            all_reduce(flat, "mean", group=group, recorder=recorder)
            unflatten_into(flat, tensors)


class LocalSGDRun(ReplicaRun):
    """A replica averaged with all the others every ``sync_every`` steps."""

    def mix(self) -> None:
        average_replicas(self.model, self.group, self.recorder)

    def report(self) -> dict[str, Any]:
        return {}  # sync_every is the only option


@dataclass(frozen=True)
class LocalSGD(ReplicaStrategy):
    """Local SGD: replicas step alone and are averaged every ``sync_every`` steps (Stich 2019; Lin et al. 2020)."""

    name: ClassVar[str] = "local-sgd"

    sync_every: int = 8
    """Average the replicas every this many optimizer steps (H); 1 averages after every step."""

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> LocalSGDRun:
        model, optimizer, group = place_replica(self.name, model, make_optimizer, mesh)
        return LocalSGDRun(model, optimizer, strategy=self.name, section="local_sgd", sync_every=self.sync_every, group=group, recorder=recorder)
