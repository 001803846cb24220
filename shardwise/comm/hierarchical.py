"""Hierarchical allreduce on a two-level mesh: nodes x local ranks.

>>> levels = NodeLevels.build(WORLD, node_size=2)  # doctest: +SKIP  (collective: every rank calls it)
>>> hierarchical_allreduce(grad, "avg", levels, recorder=rec)  # doctest: +SKIP

The world's ``p`` ranks are ``p / L`` nodes of ``L`` consecutive ranks (as torchrun, Slurm and
``mpirun`` number them: one machine's processes in a row); the first rank of each node is its
leader. An allreduce then runs in three levels, so only the leaders cross the slow inter-node
link, with the whole vector once (Goyal et al. 2017, "Accurate, Large Minibatch SGD", section 4:
within a server, across servers, back within; Jia et al. 2018 on 2D/hierarchical allreduce):

1. ``reduce`` inside each node onto its leader (group ``node``, the backend's reduce);
2. ``all_reduce`` among the leaders (group ``leaders``, any algorithm of `shardwise.comm.algorithms`,
   the backend's own by default);
3. ``broadcast`` inside each node from its leader.

Each level is recorded as its own event (``node/reduce``, ``leaders/all_reduce:<inter>``,
``node/broadcast``), so the bytes of each level show apart; `shardwise.comm.traffic.hierarchical_traffic`
gives them as formulas. The node size comes from the launcher (``LOCAL_WORLD_SIZE``) or is given
(the ddp option ``node_size``), so several "nodes" can be laid out on one machine to test it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise.comm.algorithms import allreduce, check_algorithm, check_op
from shardwise.comm.collectives import WORLD, Group, broadcast, new_group, reduce
from shardwise.comm.p2p import Workspace
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError


@dataclass(frozen=True)
class NodeLevels:
    """This rank's place on the two levels: its node's group and, on a leader, the leaders' group."""

    node_size: int
    nodes: int
    leader: bool
    """Whether this rank is the first of its node."""
    node: Group | None
    """The ranks of this rank's node (group rank 0: the leader); None with one rank per node."""
    leaders: Group | None
    """The first rank of every node; None on the other ranks, and with one node."""

    @staticmethod
    def build(group: Group = WORLD, node_size: int = 1) -> NodeLevels:
        """The levels for ``node_size`` consecutive ranks per node. Collective over the world: every
        rank calls it, in the same order (it creates one group per node and the leaders' group)."""
        p = group.size
        if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1 or p % node_size:
            raise ConfigError(
                f"hierarchical allreduce needs whole nodes: node size {node_size!r} does not divide the world size {p}; "
                "pass the processes per node (the launcher's LOCAL_WORLD_SIZE), a divisor of the world size"
            )
        world = dist.get_world_size() if dist.is_initialized() else 1
        if p != world:
            raise ConfigError(f"hierarchical allreduce runs over the whole world ({world} ranks); group '{group.name}' has {p}")
        rank, nodes = group.rank, p // node_size
        leader = rank % node_size == 0
        node: Group | None = None
        leaders: Group | None = None
        if nodes == 1:
            node = Group("node", WORLD.pg) if node_size > 1 else None
        elif node_size == 1:
            leaders = Group("leaders", WORLD.pg)
        else:  # both levels real: one group per node, then the leaders'; every rank creates every group
            for k in range(nodes):
                made = new_group(range(k * node_size, (k + 1) * node_size), name="node")
                node = made if k == rank // node_size else node
            made = new_group(range(0, p, node_size), name="leaders")
            leaders = made if leader else None
        return NodeLevels(node_size, nodes, leader, node, leaders)


def hierarchical_allreduce(
    tensor: torch.Tensor,
    op: str,
    levels: NodeLevels,
    *,
    inter: str = "native",
    recorder: Recorder | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` in place across the world through ``levels`` and return it (ops sum, avg/mean,
    min, max; dtypes as `shardwise.comm.algorithms.allreduce`). Every rank ends with the same bits:
    the leader's result is broadcast. ``avg`` sums, and the leaders divide before the broadcast."""
    check_algorithm(inter)
    op = check_op(op, tensor)
    if levels.node_size * levels.nodes == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    summed = "sum" if op == "avg" else op
    if levels.node is not None:
        reduce(flat, 0, summed, group=levels.node, recorder=recorder)
    if levels.leaders is not None:
        allreduce(flat, summed, algorithm=inter, group=levels.leaders, recorder=recorder, workspace=workspace)
    if op == "avg" and levels.leader:
        flat.div_(levels.node_size * levels.nodes)
    if levels.node is not None:
        broadcast(flat, 0, group=levels.node, recorder=recorder)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor
