"""``gossip``: decentralized SGD; every ``sync_every`` steps each replica averages with its ring neighbours.

Decentralized parallel SGD (Lian et al. 2017, "Can Decentralized Algorithms Outperform
Centralized Algorithms? A Case Study for Decentralized Parallel Stochastic Gradient
Descent") has no global allreduce and no server: rank ``k`` mixes its parameters with its
neighbours on a ring through a doubly stochastic matrix,

    theta_k <- (theta_{k-1} + theta_k + theta_{k+1}) / 3      (p >= 3)
    theta_k <- (theta_0 + theta_1) / 2                          (p == 2: the one neighbour)

so each rank sends and receives one message per neighbour and dtype per round whatever the
world size, and the replicas approach consensus at a rate set by the ring's spectral gap.
With p == 2 the mix is the full average: the same as local SGD with ``sync_every=1``.

The exchange is point-to-point through `shardwise.comm.p2p.Peers` (tensors only, every byte
counted) and is recorded as one ``gossip`` event per round: payload the replica's bytes, sent
and received that many per neighbour, one step per dtype.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.comm.collectives import Group
from shardwise.comm.mesh import Mesh
from shardwise.comm.p2p import Peers
from shardwise.comm.recorder import CommEvent, Recorder
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


def ring_neighbours(rank: int, size: int) -> list[int]:
    """The distinct ring neighbours of ``rank`` (one when ``size`` is 2, none alone)."""
    return sorted({(rank - 1) % size, (rank + 1) % size} - {rank})


def gossip_round(model: nn.Module, group: Group, recorder: Recorder | None) -> None:
    """Mix this replica with its ring neighbours: the uniform average of itself and them."""
    p, k = group.size, group.rank
    peers_of = ring_neighbours(k, p)
    if not peers_of:
        return
    peers = Peers(group, "gossip")
    start = time.perf_counter()
    payload = 0
    with torch.no_grad():
        for tensors in by_dtype(replica_tensors(model)).values():
            mine = flatten(tensors)
            payload += mine.numel() * mine.element_size()
            inbox = {q: torch.empty_like(mine) for q in peers_of}
            recvs = [(q, peers.irecv(inbox[q], q)) for q in peers_of]
            sends = [(q, peers.isend(mine, q)) for q in peers_of]
            for q, work in recvs + sends:
                peers.wait(work, q)
            peers.steps += 1
            # A fixed order (self, then neighbours by rank) so the arithmetic never depends on arrival order.
            total = mine.clone()
            for q in peers_of:
                total.add_(inbox[q])
            unflatten_into(total.div_(len(peers_of) + 1), tensors)
    if recorder is not None:
        recorder.add(CommEvent("gossip", group.name, p, payload, peers.sent, peers.received, time.perf_counter() - start, peers.steps))


class GossipRun(ReplicaRun):
    """A replica mixed with its ring neighbours every ``sync_every`` steps."""

    def mix(self) -> None:
        gossip_round(self.model, self.group, self.recorder)

    def report(self) -> dict[str, Any]:
        return {"topology": "ring"}


@dataclass(frozen=True)
class Gossip(ReplicaStrategy):
    """Gossip (decentralized) SGD on a ring: neighbour averaging every ``sync_every`` steps (Lian et al. 2017)."""

    name: ClassVar[str] = "gossip"

    sync_every: int = 1
    """Average with the two ring neighbours every this many optimizer steps (1: after every step)."""

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> GossipRun:
        model, optimizer, group = place_replica(self.name, model, make_optimizer, mesh)
        return GossipRun(model, optimizer, strategy=self.name, section="gossip", sync_every=self.sync_every, group=group, recorder=recorder)
